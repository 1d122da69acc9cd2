"""``kvcli ask --low-memory`` (item 6 of issue 31): the flag reaches the prompt phase — every large
allocation of the prompt phase mapped on its own (glibc's mmap threshold lowered to 1 MiB while the
prompt is read, back to its dynamic maximum after) — and changes no answer."""

from __future__ import annotations

import json

from kvcli.runtime import measure

DOC = " ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships." for i in range(40))


def test_low_memory_maps_the_prompt_phase_and_gives_the_same_answer(cli, model, tmp_path, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    calls: list[int] = []
    real = measure._set_mmap_threshold
    monkeypatch.setattr(measure, "_set_mmap_threshold", lambda n: calls.append(int(n)) or real(n))
    args = [
        "ask",
        doc,
        "How many ships?",
        "-m",
        model,
        "--max-new-tokens",
        "6",
        "--json",
        "--no-cache",
        "--no-answer-guard",
        "--device",
        "cpu",  # the mmap threshold is the host allocator's: a CPU run
    ]
    code, out, err = cli(*args)
    assert code == 0, err
    plain = json.loads(out)
    assert measure._MAPPED_MIN not in calls  # a tiny model's KV is under 1 MiB: nothing is mapped by default
    calls.clear()
    code, out, err = cli(*args, "--low-memory")
    assert code == 0, err
    low = json.loads(out)
    assert calls[:1] == [measure._MAPPED_MIN] and calls[-1] == measure._DYNAMIC_MAX
    assert low["answer"] == plain["answer"]
