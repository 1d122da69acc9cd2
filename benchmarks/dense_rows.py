"""From how many rows is a pass faster on 8-bit weights made dense than on an int8 kernel?
(``Int8Linear.dense_rows``, docs/cpu.md "Prefill: 8-bit weights made dense for the call").

    .venv/bin/python benchmarks/dense_rows.py [--rows 16,32,48,64,80,96,128] [--layers 8]
    .venv/bin/python benchmarks/dense_rows.py --through qwen2.5-coder-1.5b --rows 32,48 --limits 64,32

For each embedded model's decoder matrices (their shapes; random int8 codes, one scale per row, as
``kvcli.model.cpu_quant.Int8Linear`` holds them), ``--layers`` layers' seven products in turn (a
pass of the model reads each layer's weights once), at each row count: PyTorch's int8 kernel and
kvcli's exact one (where it compiles) against the codes made dense for the call and oneDNN's
GEMM (what ``Int8Linear.forward`` runs from ``dense_rows`` rows on, its making included: by
PyTorch's ``torch.mul``, and by kvcli's kernel; in bfloat16 with AMX, else in float32 from
``FLOAT_ROWS`` rows on: ``native.fast_gemm``); the median of five passes each (eleven
for dense), milliseconds per layer. The process keeps freed memory as one that loads a model does.

``--through MODEL``: instead, the model loaded as kvcli loads it, a 600-token prefill, then a pass
of each row count through every layer (hidden states only) with ``dense_rows`` (and
``FLOAT_ROWS``) at each of ``--limits``, three rounds alternating: seconds. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_row_kernel import median_ms  # noqa: E402

from kvcli.model import cpu_quant, int8_rows  # noqa: E402
from kvcli.model.cpu_quant import Int8Linear  # noqa: E402
from kvcli.runtime import native  # noqa: E402
from kvcli.runtime.measure import keep_freed_memory  # noqa: E402

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


def through(model: str, counts: list[int], limits: list[int]) -> None:
    """Passes of ``counts`` rows through ``model`` with ``dense_rows`` at each of ``limits``."""
    import time

    from kvcli.model.load import load_model
    from kvcli.runtime.engine import Engine

    lm = load_model(model)
    engine = Engine(lm)
    layers = [m for m in lm.model.modules() if isinstance(m, Int8Linear)]
    ids = torch.randint(100, 20000, (600,), generator=torch.Generator().manual_seed(0))
    seconds: dict[tuple[int, int], list[float]] = {}
    for _ in range(3):
        for limit in limits:
            cpu_quant.FLOAT_ROWS = limit  # the limit where bfloat16 is not the faster (no AMX)
            for m in layers:  # as use_int8_rows sets them for a limit
                m.dense_rows = limit
                m.kernel_rows = limit - 1 if m.rows_kernel is not None else 0
            for rows in counts:
                cache, _ = engine.prefill(ids)
                x = torch.randint(100, 20000, (rows,))
                start = time.perf_counter()
                with torch.inference_mode():
                    engine.forward(x, torch.arange(600, 600 + rows), cache)
                seconds.setdefault((limit, rows), []).append(round(time.perf_counter() - start, 3))
    for (limit, rows), s in sorted(seconds.items()):
        print(f"{model}: dense_rows {limit}, a pass of {rows} rows: {sorted(s)} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,32,48,64,80,96,128,192")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--through", default=None, help="a model's name: passes through it (module docstring)")
    p.add_argument("--limits", default="64,32", help="--through: the dense_rows values side by side")
    args = p.parse_args()
    if args.through:
        return through(args.through, [int(r) for r in args.rows.split(",")], [int(x) for x in args.limits.split(",")])
    print(f"{platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, AMX {native.amx()}")
    keep_freed_memory()  # as a process that loads a model runs (kvcli.runtime.measure)
    path = int8_rows.load(chosen="exact")  # kvcli's kernels, where they compile: their columns too
    print(f"kvcli's kernels: {path or 'none here'}")
    # the dense columns multiply in the dtype Int8Linear.forward does: float32 where bfloat16 is not the faster
    gemm = torch.bfloat16 if native.fast_gemm(torch.bfloat16) else torch.float32
    print(f"dense products in {gemm}")
    for name in args.models.split(","):
        layers = [layer(*MODELS[name]) for _ in range(args.layers)]
        print(f"{name}: ms per layer, PyTorch's int8 kernel / kvcli's exact kernel / made dense by PyTorch / by kvcli")
        for rows in map(int, args.rows.split(",")):
            xs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in set(MODELS[name])}

            def per_layer(product, rounds: int = 5) -> float:
                return median_ms(lambda: [product(m) for lay in layers for m in lay], rounds) / len(layers)  # noqa: B023

            kernel = per_layer(lambda m: torch.ops.aten._weight_int8pack_mm(xs[m.in_features], m.codes, m.scale))  # noqa: B023
            # as Int8Linear.forward runs it: made dense (in pieces under glibc's mapping threshold)
            made = lambda m: m.dense_product(xs[m.in_features].to(gemm), gemm).to(torch.bfloat16)  # noqa: B023, E731
            Int8Linear.dense_kernel = None  # PyTorch's torch.mul
            dense = per_layer(made, 11)
            cols = [f"{kernel:7.2f}", "      -", f"{dense:7.2f}", "      -"]
            if path:
                cols[1] = f"{per_layer(lambda m: int8_rows.exact(xs[m.in_features], m.codes, m.scale)):7.2f}"  # noqa: B023
                Int8Linear.dense_kernel = staticmethod(int8_rows.dense)  # kvcli's, as use_int8_rows sets it
                cols[3] = f"{per_layer(made, 11):7.2f}"
                Int8Linear.dense_kernel = None
            print(f"  {rows:>4} rows: {' / '.join(cols)}")


if __name__ == "__main__":
    main()
