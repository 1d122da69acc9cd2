"""A stored book in 8 or 4 bits (``--kv-bits``: InfLLM's book, kvcli.caches.bookfile.QuantRows):
it answers as a 16-bit book whose storage rounds each row it is given with the codec itself (an
independent reference: kvcli.caches.quant on the rows, not the book's file layout); its entry is
an ordinary safetensors file of the codes and scales, about half (8 bits) or a quarter (4 bits) of
the 16-bit one, counted as such; an entry of one precision is never served to a run of another;
a read that stops resumes to the book an uninterrupted read gives, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline, run
from kvcli.answer.prompt import build_prompt
from kvcli.caches import quant
from kvcli.caches.book import BookCache
from kvcli.caches.bookfile import HEADER_ROOM, Destination, FileStorage, MemoryStorage, nbytes_of, tensor_specs
from kvcli.caches.representatives import partition
from kvcli.compressors import parse_one
from kvcli.compressors.base import Runtime
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore, book
from tests.helpers.books import CHUNK, DOC, QUESTION, SPEC, entry_tensors
from tests.helpers.stores import silent_notices  # noqa: F401  (autouse: the store's warnings silenced)
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one intra-op thread in this module)

TOL = 1e-4


class RoundingStorage(MemoryStorage):
    """The reference: a 16-bit book's storage that keeps each key and value row it is given
    quantized and dequantized by the codec (the representatives as they are)."""

    def __init__(self, specs: dict, d: int, bits: int) -> None:
        super().__init__(specs)
        self.d, self.bits = d, bits

    def write(self, name: str, index: tuple, value: torch.Tensor) -> None:
        if not name.startswith("repsum."):
            value = quant.dequantize(quant.quantize(value, self.bits), self.d, value.dtype)
        super().write(name, index, value)


class Into(Destination):
    """A read into the storage ``make(specs)`` gives."""

    def __init__(self, make) -> None:
        self.make = make

    def start(self, specs: dict, room: int, new):
        return new(self.make(specs))


class _Prefix:
    """The pipeline's Prefix, reduced to what InfLLM.prefill reads."""

    def __init__(self, book, n):
        self.book, self.n_tokens = book, n

    def take(self):
        return self.book.copy()


def stage(lm, bits: int, spec: str = SPEC):
    s = parse_one(spec)
    s.runtime = Runtime(kv_bits=bits)
    s.configure(lm)
    return s


def logits_of(s, engine, ids, n_doc, book, tokens: list[int]) -> torch.Tensor:
    """The question pass's logits and those of decoding ``tokens`` on ``book``."""
    cache, logits, pos = s.prefill(engine, ids, prefix=_Prefix(book, n_doc))
    out = [logits]
    for i, t in enumerate(tokens):
        out.append(s.decode_step(engine, t, pos + i, cache))
    return torch.stack(out)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("knobs", ["", ",retrieval=step,answer_scores=tokens", ",answer_scores=attention"])
def test_a_book_in_fewer_bits_answers_as_one_whose_stored_rows_are_rounded(tiny_lm, bits, knobs):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    ids, n_doc = prompt.ids, prompt.prefix_len
    small, reference = stage(lm, bits, SPEC + knobs), stage(lm, 16, SPEC + knobs)
    got = small.read(engine, ids[:n_doc])
    want = reference.read(engine, ids[:n_doc], Into(lambda specs: RoundingStorage(specs, lm.head_dim, bits)))
    assert got.kv_bits == bits and want.kv_bits == 16 and got.n_blocks == want.n_blocks > 3
    assert {dt for dt, _ in got.storage.specs.values()} == {torch.uint8, torch.float16, torch.float32}
    assert got.dtype == want.dtype == torch.float16  # the rows read back: kv_dtype's, as a 16-bit book's
    for t in ("k", "v"):  # every row stored, Local's tail included, rounded as the reference rounds it
        for layer in range(lm.n_layers):
            assert torch.equal(got.storage_rows(t, layer, 0, n_doc), want.storage_rows(t, layer, 0, n_doc))
    exact = stage(lm, 16, SPEC + knobs).read(engine, ids[:n_doc])
    assert not torch.equal(got.storage_rows("k", 0, 0, n_doc), exact.storage_rows("k", 0, 0, n_doc))
    seed = torch.Generator().manual_seed(bits)
    tokens = [int(t) for t in torch.randint(0, lm.model.config.vocab_size, (4,), generator=seed)]
    expected = logits_of(reference, engine, ids, n_doc, want, tokens)
    torch.testing.assert_close(logits_of(small, engine, ids, n_doc, got, tokens), expected, atol=TOL, rtol=0)
    # a stored book opened again (the store's hit) is the same book
    again = BookCache.from_storage(got.storage, got.facts(), retrieval=got.retrieval)
    assert again.kv_bits == bits and again.dtype == got.dtype
    torch.testing.assert_close(logits_of(small, engine, ids, n_doc, again, tokens), expected, atol=TOL, rtol=0)


def test_the_stored_bytes_are_the_quantized_ones():
    """The embedded model's geometry (30 layers, 3 KV heads of 64 channels) at 72k tokens: the
    file (header room, codes, scales, representatives) at 8 bits is <= 0.55x and at 4 bits <= 0.3x
    the 16-bit one; and the codes and scales are row_bytes a row."""
    n, blocks = 72_000, partition(72_000, 128, 1024, 128)[1]
    size = {b: 8 + HEADER_ROOM + nbytes_of(tensor_specs(30, 3, n, 64, blocks, torch.float16, b)) for b in (16, 8, 4)}
    assert size[8] <= 0.55 * size[16] and size[4] <= 0.3 * size[16]
    repsums = 30 * 3 * blocks * 64 * 4
    for b in (16, 8, 4):
        assert size[b] == 8 + HEADER_ROOM + repsums + 2 * 30 * 3 * n * quant.row_bytes(64, b)
    assert size[8] / size[16] == pytest.approx(0.535, abs=0.005)
    assert size[4] / size[16] == pytest.approx(0.287, abs=0.005)


def answer(lm, store, bits: int):
    """The question about DOC with SPEC, its book read in ``bits`` from (or into) ``store``."""
    pipeline = Pipeline.parse(SPEC)
    pipeline.configure(lm, Runtime(kv_bits=bits))
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    return run(Engine(lm), prompt, pipeline, max_new_tokens=4, stop_ids=set(), store=store, meta={"document": "d"})


def test_an_entry_is_served_to_runs_of_its_own_precision_only(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    store = KVStore.open(tmp_path)
    sixteen = answer(lm, store, 16)
    assert sixteen.extra["cache"]["status"] == "miss"
    cold = answer(lm, KVStore.open(tmp_path), 8)  # the 16-bit entry is not this run's
    assert cold.extra["cache"]["status"] == "miss"
    files = {f.stat().st_size: f for f in (tmp_path / "kv").glob("*.safetensors")}
    n, small = cold.prompt.prefix_len, cold.extra["cache"]["entry_bytes"]
    assert sorted(files) == [small, sixteen.extra["cache"]["entry_bytes"]]
    assert small == stage(lm, 8).stored_bytes(lm, n) and max(files) == stage(lm, 16).stored_bytes(lm, n)
    tensors = entry_tensors(files[small])  # an ordinary safetensors file
    assert tensors["k.0.codes"].dtype == torch.uint8 and tensors["k.0.codes"].shape == (lm.n_kv_heads, n, lm.head_dim)
    assert tensors["v.0.scale"].dtype == tensors["v.0.zero"].dtype == torch.float16 and "k.0" not in tensors
    # the KV held: the 8-bit book and the question's and answer's Local, in 16 bits as the 16-bit run's
    local = sixteen.extra["kv_cache_bytes"] - nbytes_of(stage(lm, 16).specs(lm, n))
    assert local > 0 and cold.extra["kv_cache_bytes"] == nbytes_of(stage(lm, 8).specs(lm, n)) + local
    warm = answer(lm, KVStore.open(tmp_path), 8)
    assert warm.extra["cache"]["status"] == "hit" and warm.answer_ids == cold.answer_ids
    assert answer(lm, None, 8).answer_ids == cold.answer_ids  # read without a store: the same book
    assert answer(lm, KVStore.open(tmp_path), 16).extra["cache"]["status"] == "hit"


def test_an_entry_whose_facts_and_tensors_disagree_on_the_bits_is_refused(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    got = stage(lm, 4).read(engine, prompt.ids[: prompt.prefix_len])
    facts = got.facts()
    assert facts["bits"] == 4 and facts["dtype"] == "float16"
    for bad in ({k: v for k, v in facts.items() if k != "bits"}, {**facts, "bits": 8}, {**facts, "dtype": "int8"}):
        with pytest.raises(ValueError):
            BookCache.from_storage(got.storage, bad)
    sixteen = stage(lm, 16).read(engine, prompt.ids[: prompt.prefix_len])
    assert "bits" not in sixteen.facts()  # a 16-bit book's header as it was
    with pytest.raises(ValueError):
        BookCache.from_storage(sixteen.storage, {**sixteen.facts(), "bits": 8, "dtype": "float16"})


def test_by_default_a_book_and_full_attention_are_stored_in_8_bits_and_lazyllm_in_16(cli, tmp_path, tiny_dir):
    """--kv-bits auto, the default: the stored book's entry and the KV it answers from in 8 bits
    (InfLLM.auto_kv_bits), full attention's too, LazyLLM's (a layout not quantized) in 16, said
    by no warning; the JSON says which, and which bits decoding read."""
    import json

    doc = tmp_path / "d.txt"
    doc.write_text(DOC)
    got = {}
    for spec in (SPEC, "full", "lazyllm"):
        code, out, err = cli(
            "ask", doc, QUESTION, "-m", tiny_dir("llama"), "-c", spec, "--json", "--max-new-tokens", "3",
            "--cache-dir", tmp_path / "cache", "--no-sources",
        )  # fmt: skip
        assert code == 0, err
        got[spec] = json.loads(out)
        assert not any("--kv-bits" in w for w in got[spec]["warnings"]), got[spec]["warnings"]
    assert got[SPEC]["kv_bits"] == 8 and got["full"]["kv_bits"] == 8 and got["lazyllm"]["kv_bits"] == 16
    # decoding on this CPU: full attention's 8-bit KV turned back to 16, the book from its own bits
    assert [got[s]["decode_kv_bits"] for s in (SPEC, "full", "lazyllm")] == [8, 16, 16]
    code, out, err = cli(
        "ask", doc, QUESTION, "-m", tiny_dir("llama"), "-c", SPEC, "--json", "--max-new-tokens", "3",
        "--cache-dir", tmp_path / "cache", "--no-sources", "--kv-bits", "8",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["cache"] == "hit"  # the same entry as an explicit 8


def test_the_reading_message_and_the_key_say_the_bits(tiny_lm):
    lm = tiny_lm("llama")
    assert stage(lm, 16).storage_precision(lm) == "float16" and stage(lm, 8).storage_precision(lm) == "8-bit"
    assert stage(lm, 16).prefix_state(lm)["kv_codec"] == quant.CODECS[16]  # every key names its format
    assert stage(lm, 4).prefix_state(lm) == {**stage(lm, 16).prefix_state(lm), **quant.state(4)}


# --------------------------------------------------------------------------- a read that stops


def _stopped(monkeypatch, at: int) -> None:
    """The read stops (KeyboardInterrupt) at its chunk number ``at``."""
    original, calls = BookCache.end_chunk, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", interrupted)


@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_a_resumed_read_in_8_bits_is_the_uninterrupted_one(tiny_lm, tmp_path, monkeypatch, how):
    """Ctrl-C keeps the end of the last chunk; a kill keeps nothing when it stops the read, which
    resumes from the last point kept before (one after every chunk). Local, which the 8-bit storage
    holds rounded, comes back in 16 bits from the point: the resumed read starts where it stopped
    and gives the same entry and answer."""
    lm = tiny_lm("llama")
    want = answer(lm, KVStore.open(tmp_path / "ref"), 8)
    [ref_entry] = (tmp_path / "ref" / "kv").glob("*.safetensors")
    monkeypatch.setattr(book, "CHECKPOINT_EVERY_S", 0.0 if how == "killed" else 1e9)
    if how == "killed":
        monkeypatch.setattr(book.PartialRead, "interrupted", lambda self: None)
    stop_at = -(-want.prompt.prefix_len // CHUNK) // 2 + 1
    _stopped(monkeypatch, stop_at)
    with pytest.raises(KeyboardInterrupt):
        answer(lm, KVStore.open(tmp_path / "c"), 8)
    [partial] = (tmp_path / "c" / "kv").glob("*.partial.safetensors")
    storage, _ = FileStorage.open(partial)
    storage.close()
    assert storage.resume_size > 0
    monkeypatch.undo()
    read, original = [], BookCache.end_chunk

    def counted(self):
        read.append(self.n_tokens)
        return original(self)

    monkeypatch.setattr(BookCache, "end_chunk", counted)
    got = answer(lm, KVStore.open(tmp_path / "c"), 8)
    assert read[0] == stop_at * CHUNK  # resumed after the stop_at - 1 chunks kept, not read again from the start
    assert got.answer_ids == want.answer_ids and got.extra["cache"]["status"] == "miss"
    [entry] = [p for p in (tmp_path / "c" / "kv").glob("*.safetensors") if ".partial" not in p.name]
    mine, theirs = entry_tensors(entry), entry_tensors(ref_entry)
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
