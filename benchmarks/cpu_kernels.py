"""The CPU kernel measurements behind docs/cpu.md's choices (one run; read ratios):

    .venv/bin/python benchmarks/cpu_kernels.py [--part products|attention|growing]

1. matrix products of the embedded model's shapes, for decoding (1 row) and prefill (512, 2,048
   rows): float32 and bfloat16 ``F.linear``, PyTorch's int8 (``_weight_int8pack_mm``) and int4
   (``_weight_int4pack_mm_for_cpu``) CPU kernels with float32 and with bfloat16 activations;
   The int8 layer runs its kernel below ``Int8Linear.dense_rows`` rows and its weights made dense
   from there (``int8 layer``); ``int8 kernel`` is the kernel at every row count;
2. attention of one decoding query over 30 layers' own KV (read from memory, not cache): SDPA in
   float32 and bfloat16, ``kvcli.runtime.kernels.grouped``'s own matrix products in the KV's dtype
   and in float32 on the KV made float32 for the call (what a step with a mask, or over a float16
   KV, runs, in the dtype ``native.native_gemm`` picks), and ``kernels.group_rows`` (PyTorch's fused attention, the query
   heads of a KV head as its rows: what a bfloat16 KV's step runs on every CPU,
   ``native.fused_decoding``), on buffer views as kvcli's caches hold them;
   ``--part attention --shape LAYERS,HEADS,KV_HEADS,HEAD_DIM --keys 4700`` for another model's shape;
3. decoding steps whose key count grows by one a step (as an answer's): resident memory and time
   per step of ``kernels.grouped`` on buffers a cache made (key counts bucketed) and on buffers it
   did not (every step a new matrix shape for oneDNN, which compiles and keeps a primitive for each).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from kvcli.model.cpu_quant import Int4Linear, Int8Linear, quantize_int8
from kvcli.runtime import kernels, native

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out), SmolLM2-135M
LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64


def bench(fn) -> float:
    """Milliseconds per call: one warm-up, then as many calls as fit in 0.3 s."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def products() -> None:
    torch.manual_seed(0)
    for rows in (1, 512, 2048):
        for k, n in SHAPES:
            w = torch.randn(n, k) * 0.05
            x = torch.randn(rows, k)
            xb, wb = x.bfloat16(), w.bfloat16()
            i8 = Int8Linear(*quantize_int8(w), None, torch.bfloat16)
            i4 = Int4Linear(w, None, torch.bfloat16)
            i8_32 = Int8Linear(*quantize_int8(w), None, torch.float32)
            i4_32 = Int4Linear(w, None, torch.float32)
            cells = {
                "float32": bench(lambda: F.linear(x, w)),
                "bfloat16": bench(lambda: F.linear(xb, wb)),
                "int8/f32": bench(lambda: i8_32(x)),
                "int8 kernel/bf16": bench(lambda: i8.product(xb)),
                "int8 layer/bf16": bench(lambda: i8(xb)),
                "int4/f32": bench(lambda: i4_32(x)),
                "int4/bf16": bench(lambda: i4(xb)),
            }
            print(f"rows {rows:5d} {k:5d}x{n:<6d} " + "  ".join(f"{c} {v:8.3f}" for c, v in cells.items()), flush=True)


def attention(shape=(LAYERS, HEADS, KV_HEADS, HEAD_DIM), keys=(1024, 4096, 8192)) -> None:
    torch.manual_seed(0)
    layers, heads, kv_heads, head_dim = shape
    fused, gemm = native.fused_decoding, native.native_gemm
    for n in keys:
        for dtype in (torch.float32, torch.bfloat16):
            # each layer's KV a view of the first n entries of a buffer with room, as caches hold it
            kv = [
                (
                    torch.randn(1, kv_heads, n + 300, head_dim).to(dtype)[:, :, :n],
                    torch.randn(1, kv_heads, n + 300, head_dim).to(dtype)[:, :, :n],
                )
                for _ in range(layers)
            ]
            q = torch.randn(1, heads, 1, head_dim).to(dtype)
            scale = 1 / math.sqrt(head_dim)
            sdpa = bench(lambda: [F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True) for k, v in kv])
            native.fused_decoding = lambda dtype: False  # grouped's own products, whatever this CPU
            grouped = bench(lambda: [kernels.grouped(q, k, v, None, scale) for k, v in kv])
            native.native_gemm = lambda dtype: dtype == torch.float32  # its products on the KV made float32
            as_float = bench(lambda: [kernels.grouped(q, k, v, None, scale) for k, v in kv])
            native.fused_decoding, native.native_gemm = fused, gemm
            rows = bench(lambda: [kernels.group_rows(q, k, v, scale) for k, v in kv])
            print(
                f"keys {n:5d} {str(dtype):15s} SDPA {sdpa:7.2f}  grouped {grouped:7.2f}  grouped in float32 "
                f"{as_float:7.2f}  group_rows {rows:7.2f}  ms per {layers} layers",
                flush=True,
            )


def _growing(n: int, made: bool, steps: int) -> str:
    import psutil

    from kvcli.runtime.buffers import made_finite

    torch.manual_seed(0)
    bufs = [
        (
            torch.randn(1, KV_HEADS, n + steps + 64, HEAD_DIM).bfloat16(),
            torch.randn(1, KV_HEADS, n + steps + 64, HEAD_DIM).bfloat16(),
        )
        for _ in range(LAYERS)
    ]
    if made:
        bufs = [(made_finite(k, n + steps), made_finite(v, n + steps)) for k, v in bufs]
    q = torch.randn(1, HEADS, 1, HEAD_DIM).bfloat16()
    rss0, t0 = psutil.Process().memory_info().rss, time.perf_counter()
    for step in range(steps):
        for k, v in bufs:
            kernels.grouped(q, k[:, :, : n + step], v[:, :, : n + step], None, 0.125)
    ms = (time.perf_counter() - t0) / steps * 1e3
    grown = (psutil.Process().memory_info().rss - rss0) / 2**20
    label = "a cache's buffers (bucketed)" if made else "other buffers (a shape a step)"
    return f"keys {n:5d}+{steps} {label:31s} {ms:6.2f} ms/step  resident +{grown:5.0f} MiB"


def growing_steps(steps: int = 300) -> None:
    """Each case in a fresh process: oneDNN's primitive cache and the heap start empty."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for n in (1024, 4096):
        for made in (True, False):
            with ctx.Pool(1) as pool:
                print(pool.apply(_growing, (n, made, steps)), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("products", "attention", "growing"), help="one part (default: all three)")
    p.add_argument("--shape", help="--part attention: LAYERS,HEADS,KV_HEADS,HEAD_DIM (default SmolLM2's 30,9,3,64)")
    p.add_argument("--keys", default="1024,4096,8192", help="--part attention: key counts")
    args = p.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
        f"AMX {native.amx()}"
    )
    if args.part in (None, "products"):
        products()
    if args.part in (None, "attention"):
        shape = tuple(map(int, args.shape.split(","))) if args.shape else (LAYERS, HEADS, KV_HEADS, HEAD_DIM)
        attention(shape, tuple(map(int, args.keys.split(","))))
    if args.part in (None, "growing"):
        growing_steps()
