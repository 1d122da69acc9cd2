"""The disk KV store: warm answers equal cold ones, damaged or foreign entries are recomputed,
concurrent processes agree, and an unusable cache directory only turns the cache off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcli import notices
from kvcli.api import AskOptions, Session
from kvcli.cache import KVCache
from kvcli.documents import document_from_text
from kvcli.engine import Engine
from kvcli.pipeline import Pipeline
from kvcli.prompt import build_prompt, load_template
from kvcli.store import FORMAT_VERSION, KVStore, make_key, parse_size

DOC = " ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships and {i * 5 % 11} storms." for i in range(30))
Q1, Q2 = "How many ships were logged?", "Which entry mentions storms first?"
SPECS = ["full", "gemfilter:layer=2,k=24"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh_notices():
    notices.reset()
    notices.set_sink(None)
    yield
    notices.reset()
    notices.set_sink(None)


def session_for(lm, cache_dir: Path | None, use_cache: bool = True) -> Session:
    options = AskOptions(max_new_tokens=8, cache_dir=cache_dir, use_cache=use_cache)
    store = KVStore.open(cache_dir) if use_cache else None
    return Session(lm=lm, engine=Engine(lm), options=options, template=load_template(), store=store)


def ask(session, spec, question=Q1, doc=DOC):
    return session.ask(document_from_text(doc), question, Pipeline.parse(spec))


def entry_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "kv").glob("*.safetensors"))


# --- warm == cold == no cache ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", SPECS)
def test_warm_answer_is_token_identical_to_cold_and_to_no_cache(tiny_lm, tmp_path, family, spec):
    lm = tiny_lm(family)
    session = session_for(lm, tmp_path)
    cold = ask(session, spec)
    warm = ask(session_for(lm, tmp_path), spec)  # a new session: nothing in memory, all from disk
    off = ask(session_for(lm, None, use_cache=False), spec)
    assert cold.extra["cache"]["status"] == "miss"
    assert warm.extra["cache"]["status"] == "hit"
    assert off.extra["cache"]["status"] == "off"
    assert len(cold.answer_ids) == 8
    assert cold.answer_ids == warm.answer_ids == off.answer_ids
    assert cold.selection.kept.tolist() == warm.selection.kept.tolist() == off.selection.kept.tolist()
    assert len(entry_files(tmp_path)) == 1
    # a different question reuses the same entry and answers as it would without the cache
    second = ask(session_for(lm, tmp_path), spec, Q2)
    assert second.extra["cache"]["status"] == "hit"
    assert second.answer_ids == ask(session_for(lm, None, use_cache=False), spec, Q2).answer_ids
    assert len(entry_files(tmp_path)) == 1


def test_split_prefill_matches_one_pass_logits(tiny_lm):
    """The prefix-then-question prefill every run now does equals one pass over the prompt."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt = build_prompt(lm.tokenizer, DOC, Q1)
    _, one_pass = engine.prefill(prompt.ids)
    prefix = engine.prefix_kv(prompt.ids[: prompt.prefix_len])
    _, split = engine.prefill(prompt.ids[prompt.prefix_len :], cache=prefix)
    torch.testing.assert_close(split, one_pass, atol=1e-4, rtol=1e-4)


def test_gemfilter_stores_only_layers_1_to_r_and_k_does_not_change_the_entry(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    first = ask(session, "gemfilter:layer=1,k=24")
    other_k = ask(session_for(lm, tmp_path), "gemfilter:layer=1,k=30,kernel=3")
    assert (first.extra["cache"]["status"], other_k.extra["cache"]["status"]) == ("miss", "hit")
    [path] = entry_files(tmp_path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        meta = json.loads(f.metadata()["kvcli"])
    assert names == {"positions", "k.0", "v.0", "k.1", "v.1"}  # layers 0..r=1 (r + 1 = 2) of 4
    assert meta["fields"]["state"] == {"kind": "kv", "layers": 2}
    assert meta["format"] == FORMAT_VERSION
    # another filter layer is another state
    assert ask(session_for(lm, tmp_path), "gemfilter:layer=2,k=24").extra["cache"]["status"] == "miss"
    assert len(entry_files(tmp_path)) == 2


def test_key_hashes_what_changes_the_state(tiny_lm):
    lm, other = tiny_lm("llama"), tiny_lm("qwen2")
    ids = torch.arange(40)
    base = make_key(lm, ids, {"kind": "kv", "layers": 4})
    assert make_key(lm, ids, {"kind": "kv", "layers": 4}) == base
    assert make_key(other, ids, {"kind": "kv", "layers": 4}).digest != base.digest  # model
    assert make_key(lm, ids + 1, {"kind": "kv", "layers": 4}).digest != base.digest  # document / template
    assert make_key(lm, ids, {"kind": "kv", "layers": 2}).digest != base.digest  # method state
    assert make_key(lm, ids, {"kind": "kv", "layers": 4}, question_ids=ids[:3]).digest != base.digest
    assert base.fields["format"] == FORMAT_VERSION


# --- damaged and foreign entries are recomputed ------------------------------------------------


def _damage_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the tensor data: only the checksum can tell
    path.write_bytes(bytes(data))


def _damage_header(path: Path) -> None:
    path.write_bytes(b"\x00" * 64)


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_header])
def test_damaged_entry_is_detected_and_recomputed(tiny_lm, tmp_path, damage):
    lm = tiny_lm("llama")
    cold = ask(session_for(lm, tmp_path), "full")
    [path] = entry_files(tmp_path)
    damage(path)
    again = ask(session_for(lm, tmp_path), "full")
    assert again.extra["cache"]["status"] == "miss"
    assert again.answer_ids == cold.answer_ids
    [warning] = notices.collected()
    assert "is damaged" in warning and "recomputing" in warning
    # and the entry was rewritten, valid
    assert ask(session_for(lm, tmp_path), "full").extra["cache"]["status"] == "hit"


def test_entry_of_another_model_is_not_used(tiny_lm, tmp_path):
    lm, other = tiny_lm("llama"), tiny_lm("llama", hidden_act="gelu")  # same shapes, other weights
    ask(session_for(other, tmp_path), "full")
    [foreign] = entry_files(tmp_path)
    prompt = build_prompt(lm.tokenizer, DOC, Q1)
    key = make_key(lm, prompt.ids[: prompt.prefix_len], {"kind": "kv", "layers": lm.n_layers})
    target = tmp_path / "kv" / f"{key.digest}.safetensors"
    target.write_bytes(foreign.read_bytes())  # the other model's KV under this model's key
    result = ask(session_for(lm, tmp_path), "full")
    assert result.extra["cache"]["status"] == "miss"
    assert result.answer_ids == ask(session_for(lm, None, use_cache=False), "full").answer_ids
    assert any("another key" in w for w in notices.collected())


# --- an unusable cache directory ----------------------------------------------------------------


def test_unwritable_cache_dir_degrades_with_one_warning(tiny_lm, tmp_path):
    lm = tiny_lm("llama")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    session = session_for(lm, blocker)
    results = [ask(session, spec) for spec in SPECS]
    assert [r.extra["cache"]["status"] for r in results] == ["off", "off"]
    assert results[0].answer_ids == ask(session_for(lm, None, use_cache=False), "full").answer_ids
    [warning] = notices.collected()  # one warning, however many questions
    assert "running without the disk cache" in warning and str(blocker) in warning


def test_full_disk_degrades_with_one_warning(tiny_lm, tmp_path, monkeypatch):
    import safetensors.torch

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    lm = tiny_lm("llama")
    session = session_for(lm, tmp_path)
    first, second = ask(session, "full"), ask(session, "full", Q2)
    assert first.extra["cache"]["status"] == "off" and second.extra["cache"]["status"] == "off"
    assert len(notices.collected()) == 1 and "No space left" in notices.collected()[0]
    assert not list((tmp_path / "kv").glob("*.tmp")) and not list((tmp_path / "kv").glob(".*.tmp"))


# --- cache objects --------------------------------------------------------------------------------


def test_kvcache_round_trip_and_shape_checks(tiny_lm):
    lm = tiny_lm("qwen2")
    cache = Engine(lm).prefix_kv(torch.arange(10), n_layers=3)
    assert cache.n_layers == 3 and cache.n_tokens == 10
    assert cache.keys[0].shape == (1, lm.n_kv_heads, 10, lm.head_dim)  # GQA: never expanded
    tensors, facts = cache.to_tensors()
    back = KVCache.from_tensors(tensors, facts)
    for a, b in zip(cache.keys + cache.values, back.keys + back.values):
        assert torch.equal(a, b)
    assert torch.equal(back.positions, torch.arange(10))
    with pytest.raises(ValueError):
        KVCache.from_tensors({**tensors, "k.1": tensors["k.1"][:, :, :5]}, facts)
    with pytest.raises(ValueError):
        KVCache.from_tensors(tensors, {**facts, "n_layers": 4})


def test_parse_size():
    assert parse_size("500M") == 500 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5k") == 1536
    assert parse_size("123") == 123
    from kvcli.errors import UsageError

    with pytest.raises(UsageError):
        parse_size("lots")


# --- kvcli cache ls | info | rm | prune | path ----------------------------------------------------


def _cli(args, capsys, monkeypatch):
    from kvcli.cli import main

    monkeypatch.setattr(sys, "argv", ["kvcli", *map(str, args)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return (code, *capsys.readouterr())


def test_cache_commands(tiny_lm, tiny_dir, tmp_path, capsys, monkeypatch):
    lm = tiny_lm("llama")
    doc_a, doc_b = tmp_path / "a.txt", tmp_path / "b.txt"
    doc_a.write_text(DOC)
    doc_b.write_text(DOC.replace("ships", "boats"))
    cache = tmp_path / "cache"
    model = str(tiny_dir("llama", num_hidden_layers=4))
    for doc in (doc_a, doc_b):
        code, out, err = _cli(["ask", doc, Q1, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "-q"], capsys, monkeypatch)
        assert code == 0, err
        record = json.loads(out)
        assert record["cache"] == "miss" and record["cache_entry_bytes"] > 0
    code, out, err = _cli(["ask", doc_a, Q2, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "-q"], capsys, monkeypatch)
    record = json.loads(out)
    assert record["cache"] == "hit" and record["cache_saved_s"] >= 0 and err == ""
    code, out, _ = _cli(["ask", doc_a, Q2, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "--no-cache"], capsys, monkeypatch)
    assert json.loads(out)["cache"] == "off"

    code, out, _ = _cli(["cache", "path", "--cache-dir", cache], capsys, monkeypatch)
    assert (code, out.strip()) == (0, str(cache / "kv"))
    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache, "--json"], capsys, monkeypatch)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 2
    assert rows[0]["document"] == str(doc_a)  # most recently used first (the hit touched it)
    assert {r["method"] for r in rows} == {"full"} and all(r["size_bytes"] > 0 for r in rows)
    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and "a.txt" in out and "2 entries" in out
    code, out, _ = _cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["entries"] == 2
    code, out, _ = _cli(["cache", "info", rows[1]["key"][:10], "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["metadata"]["fields"]["n_tokens"] == rows[1]["n_tokens"]

    # prune to a size that fits one entry: the least recently used (b) goes
    code, out, _ = _cli(["cache", "prune", "--max-size", str(rows[0]["size_bytes"]), "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 1 entries")
    remaining = KVStore.open(cache).entries()
    assert [e.meta["document"] for e in remaining] == [str(doc_a)]
    # rm by document (matched by path, or by text when the file moved)
    moved = tmp_path / "moved.txt"
    doc_a.rename(moved)
    code, out, _ = _cli(["cache", "rm", moved, "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 1 entries")
    assert KVStore.open(cache).entries() == []
    code, out, _ = _cli(["cache", "rm", "--all", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and list((cache / "kv" / "locks").glob("*.lock")) == []  # unheld locks cleaned
    code, _, err = _cli(["cache", "rm", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 2 and err.startswith("kvcli: error:") and len(err.strip().splitlines()) == 1


# --- concurrent processes -------------------------------------------------------------------------


def test_four_concurrent_processes_share_one_valid_entry(tiny_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    model = str(tiny_dir("llama", num_hidden_layers=4))
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVCLI_CACHE_DIR": str(cache)}
    args = [sys.executable, "-m", "kvcli", "ask", str(doc), Q1, "-m", model, "-c", "full", "--json", "-q", "--max-new-tokens", "8"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1] for o in outputs]
    records = [json.loads(out) for out, _ in outputs]
    expected = subprocess.run([*args, "--no-cache"], capture_output=True, text=True, env=env, check=True)
    assert len({r["answer"] for r in records}) == 1 and records[0]["answer"] == json.loads(expected.stdout)["answer"]
    # the per-key lock: one process computed the entry, the three others waited and loaded it
    assert sorted(r["cache"] for r in records) == ["hit", "hit", "hit", "miss"]
    entries = KVStore.open(cache).entries()
    assert len(entries) == 1 and entries[0].error is None
    assert not list((cache / "kv").glob(".*.tmp"))
