"""Every byte under the store's folder is an entry, a write in progress, or reclaimed: what a
``kill -9`` during an entry's write leaves, and files the store did not name (issue 27, item 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvcli.files import write_safetensors
from kvcli.store import KVStore
from kvcli.store.keys import TEMP_NAME
from tests.helpers.cli_runner import run_cli

REPO = Path(__file__).resolve().parent.parent


def test_write_safetensors_is_read_back_by_the_safetensors_library(tmp_path):
    from safetensors import safe_open

    tensors = {
        "k.0": torch.randn(2, 3, 5),
        "v.0": torch.randn(2, 3, 5).to(torch.bfloat16),
        "half": torch.randn(3).half(),
        "mask": torch.rand(7) > 0.5,
        "ids": torch.arange(9),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6)[:, ::2],  # not contiguous
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"kvcli": '{"a": 1}'})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"kvcli": '{"a": 1}'}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
    # the library's own writer makes a file of the same length (same header fields, same padding)
    from safetensors.torch import save

    assert path.stat().st_size == len(
        save({k: v.contiguous() for k, v in tensors.items()}, metadata={"kvcli": '{"a": 1}'})
    )


# A process that writes one big entry through the store, as `kvcli ask` does on a miss
WRITER = r"""
import sys, torch
from kvcli.store import KVStore, StoreKey
class Big:
    kind = "kv"
    def to_tensors(self):
        return {"k": torch.ones(int(sys.argv[2]))}, {}
store = KVStore.open(sys.argv[1])
key = StoreKey("d" * 64, {"n_tokens": 1})
store.fetch(key, Big, {"document": "big"})
"""


@pytest.mark.e2e
def test_kill_9_during_an_entry_write_leaves_only_what_the_store_reclaims(tmp_path):
    """A real SIGKILL while the entry's bytes are being written: every file left under kv/ is the
    store's own temporary file of that key, reclaimed by the next open (the safetensors library's
    ``save_file`` left a ``.tmpXXXXXX`` of the whole entry that nothing counted or removed)."""
    cache = tmp_path / "cache"
    kv = cache / "kv"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for n_floats in (75_000_000, 150_000_000):  # 300 MB, then 600 MB if the first finished too fast
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(cache), str(n_floats)], env=env)
        deadline = time.monotonic() + 120
        written = []
        while proc.poll() is None and time.monotonic() < deadline:
            written = [p for p in kv.glob(".*") if p.is_file() and p.stat().st_size > 0] if kv.is_dir() else []
            if written:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        proc.wait(timeout=60)
        if proc.returncode == -signal.SIGKILL:
            break
        assert proc.returncode == 0, "the writer failed"
        for p in kv.iterdir():  # it finished before the kill: try a bigger entry
            if p.is_file():
                p.unlink()
    assert proc.returncode == -signal.SIGKILL, "the writer was never caught writing"
    left = [p for p in kv.iterdir() if p.is_file()]
    assert left and all(TEMP_NAME.match(p.name) for p in left), [p.name for p in left]
    assert sum(p.stat().st_size for p in left) > 0
    assert KVStore(kv).leftovers().temp_bytes == sum(p.stat().st_size for p in left)
    store = KVStore.open(cache)  # the next run
    assert store.reclaimed.temp_files == len(left)
    assert [p for p in kv.rglob("*") if p.is_file()] == []


def _stray(kv: Path, name: str, size: int, idle_s: float) -> Path:
    path = kv / name
    path.write_bytes(b"\0" * size)
    t = time.time() - idle_s
    os.utime(path, (t, t))
    return path


@pytest.mark.parametrize("command", [["prune", "--cache-max", "1G"], ["rm", "--all"]])
def test_files_that_are_not_entries_are_counted_and_reclaimed(tmp_path, capsys, monkeypatch, command):
    """A file under kv/ that is not an entry (a ``.tmpXXXXXX`` a killed run left, a stray copy)
    is counted by `cache info`'s disk_bytes; a run's open removes it once an hour idle, `cache
    prune` and `cache rm --all` once a minute idle; one being written (fresh) is kept by all."""
    cache = tmp_path / "cache"
    kv = cache / "kv"
    kv.mkdir(parents=True)
    fresh = _stray(kv, ".tmpEo9GoG", 1000, idle_s=0)
    minutes = _stray(kv, ".tmpsyMiuk", 300, idle_s=120)
    hours = _stray(kv, "notes.txt", 20, idle_s=7200)
    code, out, err = run_cli(["cache", "info", "--cache-dir", cache], capsys, monkeypatch)
    info = json.loads(out)
    assert code == 0 and (info["reclaimed_temp_files"], info["reclaimed_bytes"]) == (1, 20)  # the open
    assert not hours.exists() and fresh.exists() and minutes.exists()
    assert (info["entries"], info["writes_in_progress"], info["disk_bytes"]) == (0, 2, 1300)
    code, out, err = run_cli(["cache", *command, "--cache-dir", cache], capsys, monkeypatch)
    assert code == 0 and "reclaimed 1 temporary file of killed runs, 300 B" in out, (out, err)
    assert fresh.exists() and not minutes.exists()
    assert sorted(p.name for p in kv.iterdir()) == [".tmpEo9GoG"]
