"""How much of an embedded model's decoder is on 4-bit grids, and what ``--quant 4`` does to it.

    .venv/bin/python benchmarks/int4_grid.py -m qwen2.5-coder-1.5b [--out FILE.json]

Reads the model's converted float32 weights (the GGUF's blocks dequantised) and, per kind of matrix
(q/k/v/o, gate/up/down), counts the groups of 32 inputs that lie on a grid of at most 15 steps
(``kvcli.model.cpu_quant.grid_steps``: a Q4_1 or Q4_K block), and the error ``quantize_int4`` leaves,
in units of each group's step, against the rounding it replaced (15 steps over each group's range):
what share of a matrix ``--quant 4`` gives back as the GGUF stored it; and how many matrices it
keeps in int8 (``held_in_more_bits``: Q5_0, Q6_K, Q8_0). Only CPU work, no timing.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from kvcli.model.catalog import embedded, ensure_chunked_converted
from kvcli.model.cpu_quant import GROUP, grid_steps, held_in_more_bits, quantize_int4
from kvcli.model.embedded import ensure_converted


def errors(w: torch.Tensor) -> tuple[int, int, float, float]:
    """(groups, groups on a grid, largest error of quantize_int4, of 15 steps over the range), the
    errors in units of the group's range / 15."""
    groups = w.float().reshape(-1, w.shape[1] // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    on = grid_steps(groups, lo, hi)[1]
    q, scale, low = quantize_int4(w)
    unit = ((hi - lo) / 15).clamp(min=1e-12)[..., None]
    new = (q.view_as(groups).float() * scale[..., None] + low[..., None] - groups).abs() / unit
    old = (torch.round((groups - lo[..., None]) / unit) * unit + lo[..., None] - groups).abs() / unit
    return on.numel(), int(on.sum()), float(new.max()), float(old.max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="an embedded model's name (kvcli models)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = embedded(args.model)
    if model is None:
        raise SystemExit(f"int4_grid.py: {args.model!r} is not an embedded model (kvcli models)")
    folder = (ensure_chunked_converted(model, None) if model.parts else ensure_converted(None))[0]
    kinds: dict[str, list] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0, 0])
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            m = re.search(r"layers\.\d+\.\w+\.(\w+)_proj\.weight$", name)
            if not m:
                continue
            w = f.get_tensor(name)
            n, on, new, old = errors(w)
            k = kinds[m.group(1)]
            k[0], k[1], k[2], k[3], k[4] = k[0] + n, k[1] + on, max(k[2], new), max(k[3], old), k[4] + 1
            k[5] += held_in_more_bits(w)  # --quant 4 keeps it int8
    rows = {
        kind: {
            "matrices": v[4],
            "int8_under_quant_4": v[5],
            "groups": v[0],
            "on_4bit_grid": round(v[1] / v[0], 4),
            "max_error_steps": round(v[2], 4),
            "max_error_steps_before": round(v[3], 4),
        }
        for kind, v in sorted(kinds.items())
    }
    for kind, r in rows.items():
        print(
            f"{kind:>5}: {r['matrices']:3d} matrices ({r['int8_under_quant_4']} int8 under --quant 4), "
            f"{100 * r['on_4bit_grid']:6.2f}% of groups on a 4-bit grid, largest error "
            f"{r['max_error_steps']:.3f} steps (before: {r['max_error_steps_before']:.3f})"
        )
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "group": GROUP, "kinds": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
