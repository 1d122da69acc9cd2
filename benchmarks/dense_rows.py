"""From how many rows is a pass faster on 8-bit weights made dense than on PyTorch's int8 kernel?
(``Int8Linear.dense_rows``, docs/cpu.md "Prefill: 8-bit weights made dense for the call").

    .venv/bin/python benchmarks/dense_rows.py [--rows 16,32,48,64,80,96,128] [--layers 8]

For each embedded model's decoder matrices (their shapes; random int8 codes, one scale per row, as
``kvcli.model.cpu_quant.Int8Linear`` holds them), ``--layers`` layers' seven products in turn (a
pass of the model reads each layer's weights once), at each row count: the int8 kernel
(``Int8Linear.product``) against the codes made dense in bfloat16 for the call and oneDNN's GEMM
(what ``Int8Linear.forward`` runs from ``dense_rows`` rows on, its making included); the median of
five passes each, milliseconds per layer, and the ratio. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_row_kernel import median_ms  # noqa: E402

from kvcli.model.cpu_quant import Int8Linear  # noqa: E402
from kvcli.runtime import native  # noqa: E402

# (hidden, KV width, MLP width) of each embedded model's decoder layers
MODELS = {
    "smollm2-135m": (576, 192, 1536),
    "qwen2.5-coder-0.5b": (896, 128, 4864),
    "qwen2.5-coder-1.5b": (1536, 256, 8960),
}


def layer(hidden: int, kv: int, mlp: int) -> list[Int8Linear]:
    shapes = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (mlp, hidden),
        (mlp, hidden),
        (hidden, mlp),
    ]
    return [Int8Linear(torch.randint(-127, 128, s, dtype=torch.int8), torch.rand(s[0]) / 100, None, torch.bfloat16) for s in shapes]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,32,48,64,80,96,128,192")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, AMX {native.amx()}")
    for name in args.models.split(","):
        layers = [layer(*MODELS[name]) for _ in range(args.layers)]
        print(f"{name}: ms per layer, int8 kernel / made dense (ratio; > 1: dense is faster)")
        for rows in map(int, args.rows.split(",")):
            xs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in set(MODELS[name])}
            kernel = median_ms(lambda: [m.product(xs[m.in_features]) for lay in layers for m in lay], 5) / len(layers)  # noqa: B023
            dense = median_ms(lambda: [torch.mm(xs[m.in_features], m.dense()) for lay in layers for m in lay]) / len(
                layers
            )  # noqa: B023
            print(f"  {rows:>4} rows: {kernel:7.2f} / {dense:7.2f} ({kernel / dense:.2f})")


if __name__ == "__main__":
    main()
