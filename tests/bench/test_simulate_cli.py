"""``kvcli bench memory --simulate`` end to end on a real config (Phi-3.5-mini, short lengths):
rows, table, plot, resume, and one-line errors; the targets table on synthetic rows."""

from __future__ import annotations

import json

from kvcli.bench.simulate.report import GIB, targets
from tests.helpers.cli_runner import assert_one_line_error, assert_png

FIELDS = (
    "config", "weights", "method", "tokens", "peak_bytes", "weights_bytes", "kv_bytes", "syncs_per_decode_step",
    "h2d_copies_per_decode_step", "syncs_per_prefill_layer", "error",
)  # fmt: skip


def test_memory_simulated_end_to_end(cli, tmp_path):
    # the grid in 16-bit KV (a third of the ops of 8-bit's quantize and dequantize); the default,
    # --kv-bits auto (8 bits for full attention), is the one cell --resume adds below
    args = ("bench", "memory", "--simulate", "--config", "phi-3.5-mini", "--weights", "nf4,bf16", "--lengths", "1024,2048",
            "--methods", "full;streamingllm:budget=256", "--kv-bits", "16", "--steps", "3", "--out", tmp_path, "-q")  # fmt: skip
    code, out, err = cli(*args)
    assert code == 0, err
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 and all(set(FIELDS) <= set(r) for r in rows)
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    by = {(r["weights"], r["method"], r["tokens"]): r for r in rows}
    full_bf16, full_nf4 = by[("bf16", "full", 2048)], by[("nf4", "full", 2048)]
    assert full_bf16["weights_bytes"] > 3 * full_nf4["weights_bytes"]  # 16 bits vs ~4.5 per weight
    assert full_nf4["peak_bytes"] > full_nf4["weights_bytes"] + full_nf4["kv_bytes"]
    # Phi-3.5-mini's KV in 16 bits: 32 layers x 32 KV heads x (K, V) x 96 two-byte channels per token,
    # in a buffer with room
    per_token = 32 * 32 * 2 * 96 * 2
    assert 2048 * per_token * 0.95 <= full_nf4["kv_bytes"] <= 2048 * per_token * 1.1
    assert by[("nf4", "streamingllm:budget=256", 2048)]["kv_bytes"] < full_nf4["kv_bytes"] / 4
    assert full_nf4["peak_bytes"] > by[("nf4", "full", 1024)]["peak_bytes"]
    assert "| phi-3.5-mini | nf4 | `full` | 2k |" in out and "kv_bits" not in full_nf4  # a 16-bit row, unlabelled
    assert (tmp_path / "memory_table.md").read_text().strip() == out.strip()
    assert_png(tmp_path / "memory.png")
    # --resume: nothing left to run; --plot-only redraws from the JSON
    code, out2, _ = cli(*args, "--resume")
    assert code == 0 and out2 == out
    # --kv-bits auto (the default, as kvcli ask) with --resume: full attention's 8-bit cell joins the 16-bit ones
    more = ("--weights", "nf4", "--lengths", "2048", "--methods", "full", "--steps", "3", "--resume")
    code, out3, err = cli("bench", "memory", "--simulate", "--config", "phi-3.5-mini", *more, "--out", tmp_path, "-q")
    assert code == 0, err
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    [full_8] = [r for r in rows if r.get("kv_bits") == 8]
    assert len(rows) == 2 * 2 * 2 + 1 and full_8["error"] is None and full_8["tokens"] == 2048
    # 8 bits: 32 layers x 32 KV heads x (K, V) x (96 one-byte codes + a float16 scale and zero per group
    # of 32 channels) per token
    per_token = 32 * 32 * 2 * (96 + 3 * 2 * 2)
    assert 2048 * per_token * 0.95 <= full_8["kv_bytes"] <= 2048 * per_token * 1.1
    assert "| phi-3.5-mini | nf4 | `full` (8-bit KV) | 2k |" in out3  # the row says the bits it held
    assert cli("bench", "memory", "--plot-only", "--out", tmp_path, "-q")[0] == 0


def test_memory_errors_are_one_line(cli, tmp_path):
    assert_one_line_error(cli("bench", "memory", "--out", tmp_path), 2, "--simulate")
    assert_one_line_error(cli("bench", "memory", "--simulate", "--config", "gpt-5", "--out", tmp_path), 2, "gpt-5")
    assert_one_line_error(cli("bench", "memory", "--simulate", "--weights", "int3", "--out", tmp_path), 2, "--weights")
    assert_one_line_error(cli("bench", "memory", "--simulate", "--methods", "nosuch", "--out", tmp_path), 2, "nosuch")
    assert not (tmp_path / "memory.json").exists()


def _row(method, tokens, peak_gib, syncs=1, h2d=0, error=None, offload="none"):
    return {
        "config": "llama-3.1-8b",
        "weights": "nf4",
        "method": method,
        "tokens": tokens,
        "kv_offload": offload,
        "peak_bytes": peak_gib * GIB,
        "syncs_per_decode_step": syncs,
        "h2d_copies_per_decode_step": h2d,
        "error": error,
    }


def test_targets_read_the_rows():
    rows = [_row("full", 131072, 22.5), _row("gemfilter", 131072, 14.5), _row("finch:target=4096", 131072, 8.0, h2d=3),
            _row("full", 32768, 11.0), _row("snapkv", 32768, 12.5, syncs=2)]  # fmt: skip
    checks = {c["target"].split(",")[0]: c for c in targets(rows)}
    assert checks["full attention"]["met"] and not checks["GemFilter"]["met"]
    assert checks["Finch target=4096"]["met"] and checks["block-sparse + --kv-offload cpu"]["measured"] == "not run"
    assert not checks["every method"]["met"] and "snapkv" in checks["every method"]["measured"]
    assert checks["full: decode syncs <= 1"]["met"] and not checks["finch: decode syncs <= 1"]["met"]
    assert not checks["snapkv: decode syncs <= 1"]["met"] and not checks["razor: decode syncs <= 1"]["met"]


def test_targets_take_each_method_at_its_default_bits():
    """A method's row at the bits --kv-bits auto gives it (full: 8), or at 16 where it has none."""
    rows = [_row("full", 32768, 11.0, syncs=2), {**_row("full", 32768, 9.0), "kv_bits": 8}, _row("adakv", 32768, 11.5)]
    checks = {c["target"].split(",")[0]: c for c in targets(rows)}
    assert checks["full: decode syncs <= 1"]["met"] and checks["every method"]["measured"] == "2/2 methods within"
    rows[1]["kv_bits"] = 4  # not full's default: its 16-bit row stands
    checks = {c["target"].split(",")[0]: c for c in targets(rows)}
    assert not checks["full: decode syncs <= 1"]["met"]


def test_failed_rows_are_results_kept_across_grids(cli, tmp_path):
    base = ("bench", "memory", "--simulate", "--config", "phi-3.5-mini", "--steps", "2", "--out", tmp_path, "-q")
    # a prompt over the model's window cannot run: the row says why (and holds no peak)
    code, out, _ = cli(*base, "--methods", "full", "--lengths", "140000")
    assert code == 0 and "window" in out
    assert cli(*base, "--methods", "full", "--lengths", "1024", "--resume")[0] == 0
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    by = {r["tokens"]: r for r in rows}
    assert (
        sorted(by) == [1024, 140000]
        and by[140000]["error"]
        and by[140000]["peak_bytes"] is None
        and not by[1024]["error"]
    )
    code, out, _ = cli("bench", "memory", "--plot-only", "--out", tmp_path, "-q")
    assert code == 0 and "check_window" in out and "| 1k | none | " in out


def test_a_run_of_one_grid_reports_the_targets_of_every_row(cli, tmp_path):
    """targets.md covers the whole file: a later run of another grid does not report the targets
    an earlier run measured as not run."""
    base = (
        "bench",
        "memory",
        "--simulate",
        "--config",
        "llama-3.1-8b",
        "--lengths",
        "1024",
        "--steps",
        "2",
        "--out",
        tmp_path,
        "-q",
    )
    assert cli(*base, "--methods", "full")[0] == 0
    assert cli(*base, "--methods", "snapkv", "--resume")[0] == 0
    targets_md = (tmp_path / "targets.md").read_text()
    full = next(line for line in targets_md.splitlines() if line.startswith("| full: decode"))
    snapkv = next(line for line in targets_md.splitlines() if line.startswith("| snapkv: decode"))
    assert "not run" not in full and "not run" not in snapkv and "(1k)" in full
