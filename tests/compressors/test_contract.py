"""The contract every registered compression method keeps, checked for each name in
:data:`kvcli.compressors.base.REGISTRY` — a method registered later is covered without a new test:

(a) its keep-everything spec (the class's ``keep_all``) and its compressing spec
    (``COMPRESSING`` of test_compression_ratio) round-trip through the parser, and so does the
    spec the model resolves (what ``--json`` reports);
(b) told to keep everything, it reproduces full attention's fp32 logits at the prompt's last
    position and at 5 greedy decoding steps, through the whole pipeline (prefix state, selectors,
    its own prefill / decoding step), on a tiny model of every supported family (tiny_models'
    FAMILIES: llama, mistral, qwen2 with q/k/v biases, qwen3 with q/k norms, phi3 with fused
    projections);
(c) compressing, it answers the same warm (disk store hit), cold (store miss) and without the
    store; a method that stores nothing is "off" all three times and still answers the same;
(d) ``Result.kept_mask`` is (layers, KV heads, prompt) bool and ``n_kept_tokens`` its mean, the
    cache's ``stats()`` (``method_stats``) are JSON-able and agree with both;
(e) its ``kvcli ask --json`` record (:func:`kvcli.report.record.result_record`, what the CLI prints) has
    every field docs/usage.md documents, with its type, and no field it does not.

Everything is memoised per session, on tiny random models and a ~210-token prompt: one
keep-everything run per (method, family), three store runs per method (whose third, without the
store, also gives the --json record), one CLI run in all; head profiles (razor, duo) are computed
once per model.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from kvcli import notices
from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.question import QuestionOptions
from kvcli.compressors.base import REGISTRY, Compressor, Runtime, keep_all_spec
from kvcli.documents import document_from_text
from kvcli.errors import UsageError
from kvcli.report.record import compute_fractions, result_record
from kvcli.store import KVStore
from tests.helpers.documented import json_fields
from tests.helpers.reference import assert_same_logits
from tests.helpers.runs import DOC, RecordingEngine, configured, full_references, prompt_for
from tests.helpers.specs import COMPRESSING, NOT_ON_HYBRIDS
from tests.helpers.stores import session_for
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)
from tests.helpers.tiny_models import FAMILIES, HYBRID_FAMILIES  # every family kvcli supports (b) runs on

METHODS = sorted(REGISTRY)
# the methods whose state depends on the question (nothing to keep on disk), written out: every
# other method must store its prefix state and read it back
NO_PREFIX_STATE = {
    "h2o",
    "finch",
    "pages",
}  # H2O scores every query row, the question's too; Finch's chunks are read with the question;
# pages chooses its passages by the question (and runs no model pass before that)
STORE_FAMILY = "llama"  # (c), (d) and (e) run on one family
QUESTION = "How many gulls?"  # prompt_for's
STEPS = 5  # greedy decoding steps after the prefill's token
TOL = 1e-4

# (method, family) -> why it does not reproduce full attention when told to keep everything
# (each one an xfail(strict=True): fixing the method turns the test red until the entry goes)
KNOWN_DIFFERENT: dict[tuple[str, str], str] = {}

# the fields every `kvcli ask --json` record has, as docs/usage.md's table documents them
DOCUMENTED_FIELDS = tuple(json_fields()[0])


# --------------------------------------------------------------------------- helpers


def keep_all_for(name: str, prompt) -> str:
    return keep_all_spec(REGISTRY[name], prompt.n_tokens, prompt.prefix_len)


def known(name: str, family: str) -> list:
    reason = KNOWN_DIFFERENT.get((name, family))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.fixture(scope="session")
def profiles(isolated_cache_dir) -> Path:
    """Where razor's and duo's per-model head profiles go: the session's cache dir, which is also
    where a run without --cache-dir puts them, so each is computed once per model."""
    return isolated_cache_dir


@pytest.fixture(scope="session")
def kept_all(tiny_lm, profiles):
    """``kept_all(name, family)`` -> (Result, logits per position) of the method's keep_all spec:
    the whole pipeline, no store, 1 + STEPS greedy tokens, no stop token."""

    @functools.cache
    def get(name: str, family: str):
        lm = tiny_lm(family)
        prompt = prompt_for(lm)
        engine = RecordingEngine(lm)
        pipeline = configured(keep_all_for(name, prompt), lm, profiles)
        result = run(engine, prompt, pipeline, max_new_tokens=STEPS + 1, stop_ids=set())
        return result, engine.seen

    return get


@pytest.fixture(scope="session")
def full_logits(tiny_lm):
    """``full_logits(family)``: full attention's logits, computed the plain way (one prefill)."""
    return full_references(tiny_lm, STEPS)


@pytest.fixture(scope="session")
def stored(tiny_lm, tmp_path_factory, profiles):
    """``stored(name)`` -> {cold, warm, off: Result, record: off's --json record} of COMPRESSING[name]
    through ``Session.ask``: a fresh store (miss), a new session on it (hit), no store at all."""

    @functools.cache
    def get(name: str):
        lm = tiny_lm(STORE_FAMILY)
        store = tmp_path_factory.mktemp(f"contract-store-{name}")
        document = document_from_text(DOC)

        def with_store():
            session = session_for(lm, profiles)  # head profiles from the session's cache dir
            session.store = KVStore.open(store)  # KV entries in a store of this method's own
            return session

        def ask(session):
            pipeline = Pipeline.parse(COMPRESSING[name])
            return session.ask(document, QUESTION, pipeline, QuestionOptions(max_new_tokens=STEPS)), pipeline

        (cold, _), (warm, _) = ask(with_store()), ask(with_store())  # the second: nothing in memory, all from the disk
        off_session = session_for(lm, None, use_cache=False)
        off, pipeline = ask(off_session)
        return {"cold": cold, "warm": warm, "off": off, "record": result_record(off, off_session, pipeline, document)}

    return get


# --------------------------------------------------------------------------- (a) specs


def test_a_method_without_keep_all_cannot_register():
    """A named class registers itself when it is defined, so the refusal comes there."""
    with pytest.raises(TypeError, match="declares no keep_all"):

        class Anonymous(Compressor):
            name = "test-no-keep-all"

    with pytest.raises(TypeError, match="declares no keep_all"):

        class Inherited(REGISTRY["snapkv"]):  # a subclass states its own: its knobs may differ
            name = "test-inherited-keep-all"

    assert not {"test-no-keep-all", "test-inherited-keep-all"} & set(REGISTRY)


def test_a_base_without_a_name_does_not_register():
    before = dict(REGISTRY)

    class Base(Compressor):  # like scoring.Eviction: what methods are built on
        pass

    assert before == REGISTRY


STORE_WRITER_HOOKS = ("read", "stored_bytes", "storage_precision")


@pytest.mark.parametrize("name", METHODS)
def test_a_method_that_writes_its_prefix_declares_how_it_is_read_and_sized(name):
    """``writes_prefix`` is the one flag for a state the store has read into its entry: such a
    method overrides all three hooks the base declares for it, any other none (the base's refuse)."""
    cls = REGISTRY[name]
    overridden = {h for h in STORE_WRITER_HOOKS if getattr(cls, h) is not getattr(Compressor, h)}
    assert overridden == (set(STORE_WRITER_HOOKS) if cls.writes_prefix else set())
    if not cls.writes_prefix:
        with pytest.raises(NotImplementedError, match="writes_prefix"):
            Compressor.stored_bytes(cls(), None, 10)


@pytest.mark.parametrize("name", METHODS)
def test_specs_round_trip_through_the_parser(name, tiny_lm, profiles):
    cls = REGISTRY[name]
    assert isinstance(vars(cls).get("keep_all"), str)  # declared by the class itself (register refuses otherwise)
    lm = tiny_lm(STORE_FAMILY)
    for spec in (keep_all_for(name, prompt_for(lm)), COMPRESSING[name]):
        parsed = Pipeline.parse(spec)
        printed = parsed.spec()
        again = Pipeline.parse(printed)
        assert again.spec() == printed, spec
        assert [type(s) for s in again.stages] == [type(s) for s in parsed.stages]
        assert [s.knob_values() for s in again.stages] == [s.knob_values() for s in parsed.stages], spec
        # what the model resolves (automatic knobs filled in; --json's `compressor`) is a fixed point:
        # given back with -c it parses, configures and prints the same
        resolved = configured(spec, lm, profiles).spec()
        assert configured(resolved, lm, profiles).spec() == resolved, spec


# --------------------------------------------------------------------------- (b) keep everything


@pytest.mark.parametrize(
    "name, family",
    [pytest.param(n, f, id=f"{n}-{f}", marks=known(n, f)) for n in METHODS for f in FAMILIES],
)
def test_keeping_everything_reproduces_full_attention(name, family, kept_all, full_logits, tiny_lm):
    assert tiny_lm(family).model.dtype == torch.float32
    if name in NOT_ON_HYBRIDS and family in HYBRID_FAMILIES:
        with pytest.raises(UsageError, match="sliding-window") as refused:
            kept_all(name, family)
        assert "\n" not in str(refused.value)
        return
    result, got = kept_all(name, family)
    want = full_logits(family)
    assert len(got) == len(want) == STEPS + 1
    assert all(g.dtype == torch.float32 for g in got)
    worst = [float((g - w).abs().max()) for g, w in zip(got, want)]
    assert max(worst) <= TOL, f"max |logits - full attention's| per position (prefill, steps 1..{STEPS}): {worst}"
    assert_same_logits(got, want, TOL)
    assert len(result.answer_ids) == STEPS + 1


# --------------------------------------------------------------------------- (c) the disk store


@pytest.mark.parametrize("name", METHODS)
def test_warm_cold_and_no_store_give_the_same_answer(name, stored, tiny_lm, profiles):
    cold, warm, off = (stored(name)[k] for k in ("cold", "warm", "off"))
    lm = tiny_lm(STORE_FAMILY)
    keeps_state = name not in NO_PREFIX_STATE
    assert (configured(COMPRESSING[name], lm, profiles).reader().prefix_state(lm) is not None) == keeps_state
    statuses = [r.extra["cache"]["status"] for r in (cold, warm, off)]
    assert statuses == (["miss", "hit", "off"] if keeps_state else ["off", "off", "off"])
    assert cold.answer_ids, "no answer token: nothing compared"
    assert cold.answer_ids == warm.answer_ids == off.answer_ids
    assert cold.selection.kept.tolist() == warm.selection.kept.tolist() == off.selection.kept.tolist()
    assert cold.n_kept_tokens == warm.n_kept_tokens == off.n_kept_tokens
    assert cold.extra["kv_cache_bytes"] == warm.extra["kv_cache_bytes"] == off.extra["kv_cache_bytes"]


# --------------------------------------------------------------------------- (d) kept_mask, stats


def full_held(n: int, lm) -> float:
    """What full attention holds of an n-token prompt per layer and KV head: n, but on a hybrid
    (Gemma 2 / 3) a sliding layer of window w only its last w - 1 tokens."""
    windows = [lm.windows.window(layer) for layer in range(lm.n_layers)]
    return sum(n if w is None else min(n, w - 1) for w in windows) / len(windows)


def check_kept(result, lm) -> None:
    """kept_mask: (layers, KV heads, prompt tokens) bool, nothing a selector dropped; n_kept_tokens
    its mean over layers and heads; compression_ratio the prompt over it; stats JSON-able and in
    agreement with the mask and the bytes held."""
    n = result.prompt.n_tokens
    mask = result.kept_mask()
    assert mask is not None, "the cache does not report what it held (kept_mask)"
    assert mask.dtype == torch.bool and tuple(mask.shape) == (lm.n_layers, lm.n_kv_heads, n)
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[result.selection.kept] = False
    assert not mask[:, :, dropped].any()
    held = float(mask.sum()) / (lm.n_layers * lm.n_kv_heads)
    assert result.n_kept_tokens == pytest.approx(held) and 0 < held <= result.selection.n_kept
    assert result.compression_ratio == pytest.approx(full_held(n, lm) / held)
    stats = result.extra["method_stats"]
    assert isinstance(stats, dict) and all(isinstance(k, str) for k in stats)
    assert json.loads(json.dumps(stats)) == stats  # JSON-able as it is (the --json record carries it)
    assert set(stats) == set(result.cache.stats())
    for key, value in compute_fractions(stats).items():
        assert value is None or 0.0 <= value <= 1.0, (key, value)
    if "kv_bytes" in stats:
        assert stats["kv_bytes"] == result.extra["kv_cache_bytes"] == result.cache.nbytes()
    if "per_layer_kv_tokens" in stats:  # prompt tokens holding KV, per layer (the same in every head)
        assert stats["per_layer_kv_tokens"] == mask[:, 0].sum(dim=-1).tolist()
    if "kv_heads" in stats:  # grouped caches: protected (retrieval) heads hold all, the others lose dropped_tokens
        assert stats["kv_heads"] == lm.n_layers * lm.n_kv_heads
        cut = (stats["kv_heads"] - stats["protected_kv_heads"]) / stats["kv_heads"]
        # a hybrid's sliding layers (every head protected) hold their window only
        windows = (lm.windows.window(layer) for layer in range(lm.n_layers))
        window_cut = sum(n - min(n, w - 1) for w in windows if w is not None) / lm.n_layers
        assert held == pytest.approx(n - cut * stats["dropped_tokens"] - window_cut)
    if "kv_entries" in stats:  # ragged caches: entries held (prompt and later tokens) within the padded slots
        assert held * lm.n_layers * lm.n_kv_heads <= stats["kv_entries"] <= stats["kv_slots"]


@pytest.mark.parametrize("name", METHODS)
def test_kept_mask_and_stats_agree_with_n_kept_tokens(name, kept_all, stored, tiny_lm):
    for family in FAMILIES:
        if name in NOT_ON_HYBRIDS and family in HYBRID_FAMILIES:
            continue  # refused (test_keeping_everything_reproduces_full_attention)
        everything, _ = kept_all(name, family)
        lm = tiny_lm(family)
        check_kept(everything, lm)
        # keeping everything: every layer and head held every prompt token, computed and attended all of it
        # (a hybrid's sliding layers: at least their window; a layout that does not trim them, more)
        n, mask = everything.prompt.n_tokens, everything.kept_mask()
        if family in HYBRID_FAMILIES:
            for layer in range(lm.n_layers):
                w = lm.windows.window(layer)
                assert mask[layer, :, n - (n if w is None else w - 1) :].all(), (family, layer)
            assert everything.n_kept_tokens >= full_held(n, lm) and everything.compression_ratio <= 1.0 + 1e-9
        else:
            assert mask.all(), family
            assert everything.n_kept_tokens == n and everything.compression_ratio == 1.0
        for key, value in compute_fractions(everything.extra["method_stats"]).items():
            if family in HYBRID_FAMILIES and key == "kv_attended_frac":
                continue  # a hybrid's sliding layers attend to their window only, as full attention does
            assert value is None or value == pytest.approx(1.0), (family, key, value)
    cold, warm, off = (stored(name)[k] for k in ("cold", "warm", "off"))
    for result in (cold, warm, off):
        check_kept(result, tiny_lm(STORE_FAMILY))
    # warm, cold and no store held the same entries
    assert torch.equal(cold.kept_mask(), warm.kept_mask()) and torch.equal(cold.kept_mask(), off.kept_mask())


# --------------------------------------------------------------------------- (e) --json


def check_record(record: dict) -> None:
    """Every documented field of a ``kvcli ask --json`` record (no store), with its type, and no other."""
    missing = [f for f in DOCUMENTED_FIELDS if f not in record]
    assert not missing, f"the --json record lacks documented fields {missing}"
    # a record on CUDA adds the fields docs/usage.md's second table says a CUDA record has
    cuda_only = [f for f, row in json_fields()[1].items() if row.split("|")[0].strip() == "CUDA"]
    extra = cuda_only if record.get("device", "").startswith("cuda") else []
    undocumented = [f for f in record if f not in DOCUMENTED_FIELDS and f not in extra]
    assert not undocumented, f"the --json record has fields docs/usage.md does not document: {undocumented}"
    assert isinstance(record["answer"], str) and isinstance(record["model"], str) and record["model"]
    spec = record["compressor"]
    assert isinstance(spec, str) and Pipeline.parse(spec).spec() == spec
    for key in ("n_context_tokens", "n_document_tokens", "n_selected_tokens", "kv_cache_bytes"):
        assert type(record[key]) is int and record[key] > 0, key
    n = record["n_context_tokens"]
    assert record["n_document_tokens"] < n and record["n_selected_tokens"] <= n
    assert isinstance(record["n_kept_tokens"], float) and 0 < record["n_kept_tokens"] <= record["n_selected_tokens"]
    if Pipeline.parse(spec).retrieves():  # pages: what it read, and no ratio
        read = record["read"]
        assert record["compression_ratio"] is None and read["passages"]
        assert read["n_tokens"] == sum(p["n_tokens"] for p in read["passages"]) <= record["n_selected_tokens"]
        assert read["n_document_tokens"] == record["n_document_tokens"]
        assert all(
            p["how"] in ("whole", "beginning", "skimmed") and ("pages" in p or "lines" in p) for p in read["passages"]
        )
    else:
        assert record["read"] is None
        assert record["compression_ratio"] == pytest.approx(n / record["n_kept_tokens"], rel=1e-3)
    for key in ("prompt_computed_frac", "kv_attended_frac"):
        assert record[key] is None or 0.0 <= record[key] <= 1.0, key
    for key in ("ttft_s", "total_s", "peak_mem_mb"):
        assert (
            isinstance(record[key], (int, float)) and not isinstance(record[key], bool) and math.isfinite(record[key])
        ), key
    assert 0 <= record["ttft_s"] <= record["total_s"]
    assert record["decode_tokens_per_s"] is None or record["decode_tokens_per_s"] > 0
    assert record["cache"] == "off" and record["cache_saved_s"] is None and record["cache_entry_bytes"] is None
    assert isinstance(record["method_stats"], dict) and isinstance(record["warnings"], list)
    assert json.loads(json.dumps(record)) == record


@pytest.mark.parametrize("name", METHODS)
def test_ask_json_record_has_every_documented_field(name, stored):
    record = stored(name)["record"]
    check_record(record)
    off = stored(name)["off"]
    assert (
        record["n_kept_tokens"] == round(off.n_kept_tokens, 2) and record["n_selected_tokens"] == off.selection.n_kept
    )
    assert record["compressor"] == off.extra["compressor"]


def test_the_cli_prints_that_record(cli, tiny_dir, tmp_path, stored, device):
    """`kvcli ask --json` prints :func:`result_record` (checked for one method, a two-stage pipeline):
    the same fields and, for the same model, document, question and method, the same answer."""
    name = "decoding"
    doc = tmp_path / "gulls.txt"
    doc.write_text(DOC, encoding="utf-8")
    model = tiny_dir(STORE_FAMILY, num_hidden_layers=4)  # tiny_lm(STORE_FAMILY)'s folder
    code, out, err = cli(
        "ask",
        doc,
        QUESTION,
        "-m",
        model,
        "-c",
        COMPRESSING[name],
        "--json",
        "--max-new-tokens",
        str(STEPS),
        "--no-cache",
        "--no-answer-guard",
        "--device",
        str(device),
        "--dtype",
        "float32",  # as the library's record (tiny_lm): not the GPU's default bfloat16
    )
    assert code == 0, err
    assert out.count("\n") == 1, out  # one JSON object, one line
    record = json.loads(out)
    check_record(record)
    library = stored(name)["record"]
    assert record.keys() == library.keys()
    for key in (
        "answer",
        "compressor",
        "n_context_tokens",
        "n_kept_tokens",
        "n_selected_tokens",
        "kv_cache_bytes",
        "method_stats",
    ):
        assert record[key] == library[key], key


# --------------------------------------------------------------------------- (f) --kv-bits 8


@pytest.mark.parametrize("name", METHODS)
def test_every_method_runs_in_8_bits_or_says_it_keeps_16(name, tiny_lm, profiles, tmp_path):
    """With ``--kv-bits 8`` a method decodes over 8-bit KV (bytes held: the quantized ones) or keeps
    16 bits and says so once; cold and warm runs agree; an 8-bit run never reads a 16-bit entry;
    ``--kv-bits auto`` holds 8 bits exactly where the method does."""
    lm = tiny_lm(STORE_FAMILY)
    document = document_from_text(DOC)

    def ask(bits):
        session = session_for(lm, profiles, kv_bits=bits)
        session.store = KVStore.open(tmp_path)
        return session.ask(document, QUESTION, Pipeline.parse(COMPRESSING[name]), QuestionOptions(max_new_tokens=STEPS))

    sixteen = ask(16)
    cold, warm = ask(8), ask(8)
    warned = [line for line in notices.collected() if "--kv-bits 8" in line]
    assert cold.answer_ids and cold.answer_ids == warm.answer_ids
    assert cold.extra["kv_bits"] == warm.extra["kv_bits"]
    pipeline = Pipeline.parse(COMPRESSING[name])
    pipeline.configure(lm, Runtime(cache_dir=profiles, kv_bits=8))
    state = pipeline.reader().prefix_state(lm)
    if state is not None:  # a state built in 8 bits has a key of its own; one built in 16 is shared
        assert sixteen.extra["cache"]["status"] == "miss"
        assert cold.extra["cache"]["status"] == ("hit" if state.get("kv_bits", 16) == 16 else "miss")
    # --kv-bits auto: 8 bits exactly where the method's layout holds them (Compressor.auto_kv_bits)
    assert Pipeline.parse(COMPRESSING[name]).kv_bits("auto") == cold.extra["kv_bits"]
    if cold.extra["kv_bits"] == 8:
        assert not warned
        assert cold.extra["kv_cache_bytes"] == cold.cache.nbytes() < sixteen.extra["kv_cache_bytes"]
    else:
        assert cold.extra["kv_bits"] == 16 and len(warned) == 1 and "keeps its KV in 16 bits" in warned[0]
