"""What bounds a decoding step on the CPU (docs/cpu.md, "Decoding: what bounds it").

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_decode_bounds.py      # one thread
    .venv/bin/python benchmarks/cpu_decode_bounds.py                        # all threads
    .venv/bin/python benchmarks/cpu_decode_bounds.py --products [--rows 1,4,16,48]

1. Memory read speed (a float32 sum over 64 MB) against oneDNN's bfloat16 matrix-vector products
   of a decoding query over keys: q·Kᵀ with the queries as rows, K·qᵀ with the keys as rows.
2. One decoding query's attention per layer (the embedded model's shape: 9 query heads over 3 KV
   heads of 64), the KV of 30 different layers read in turn (cold, as in a step), for the layouts
   tried: ``kernels.grouped`` on a cache's view with room (what runs), the same on buffers with no
   room between heads (contiguous), a bare batched product on those, and K·qᵀ per head.
3. The 8-bit weight products of a Qwen2.5-Coder-1.5B decoding step (``--products``: PyTorch's
   ``_weight_int8pack_mm``, what ``kvcli ask -m qwen2.5-coder-1.5b`` ran on a CPU before kvcli's own
   kernel): the 28 layers' seven matrices read once each in turn (cold, as in a step), one layer's
   read again and again (hot: from the caches), and the LM head (151,936 x 1,536), each as GB/s of
   weights read, beside the float32 sum of 1; the LM head in 4 bits as ``--quant 4`` holds a layer
   (groups of 32); and kvcli's kernels (``kvcli.model.int8_rows``, where they compile), exact
   activations (the default) and 8-bit ones, on the same layers and head; on a CPU with AVX-512,
   the exact kernel's AVX2 path too (forced: the code an AVX2-only CPU runs, on this CPU's memory).
4. ``--dynamic``: the same 28 layers through PyTorch's int8 products that quantise the activations
   too (``torch.ops.quantized.linear_dynamic``: one scale for the row, int8 weights packed by
   ``linear_prepack``, for the x86/fbgemm and oneDNN engines), and what packing the weights costs,
   once per process (the packed layout cannot be saved: its serialised form is the unpacked one).

Time it alone on the machine: the figures are bandwidth and call overheads.
"""

from __future__ import annotations

import time

import torch

from kvcli.model import int8_rows
from kvcli.model.cpu_quant import GROUP, pack_int4
from kvcli.runtime import kernels
from kvcli.runtime.buffers import made_finite as _made

DT = torch.bfloat16
H, G, D, LAYERS = 3, 3, 64, 30  # KV heads, query heads per KV head, head size, layers


def per_call(f, n: int) -> float:
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def bandwidth() -> None:
    x = torch.randn(16 * 2**20)  # 64 MB of float32
    keys = x.to(DT).view(-1, D)  # 32 MB of bfloat16 keys
    q = torch.randn(3, D, dtype=DT)
    gb = lambda nbytes, s: f"{nbytes / s / 1e9:.1f} GB/s"  # noqa: E731
    print("read (float32 sum)", gb(x.numel() * 4, per_call(x.sum, 5)))
    print("q·Kᵀ  (3 x 64)·(64 x n) bf16", gb(keys.numel() * 2, per_call(lambda: torch.mm(q, keys.t()), 5)))
    print("K·qᵀ  (n x 64)·(64 x 3) bf16", gb(keys.numel() * 2, per_call(lambda: torch.mm(keys, q.t()), 5)))


def attention(n_keys: int) -> dict[str, float]:
    pad = -(-n_keys // kernels.KEY_BUCKET) * kernels.KEY_BUCKET
    room = [
        (
            _made(torch.randn(1, H, n_keys + 100, D).to(DT), n_keys),
            _made(torch.randn(1, H, n_keys + 100, D).to(DT), n_keys),
        )
        for _ in range(LAYERS)
    ]
    tight = [
        (_made(torch.randn(1, H, pad, D).to(DT), n_keys), _made(torch.randn(1, H, pad, D).to(DT), n_keys))
        for _ in range(LAYERS)
    ]
    q = torch.randn(1, H * G, 1, D).to(DT)

    def grouped(bufs):
        for k, v in bufs:
            kernels.grouped(q, k[:, :, :n_keys], v[:, :, :n_keys], None, 0.125)

    def bare():
        for k, v in tight:
            s = torch.matmul((q * 0.125).view(1, H, G, D), k.transpose(-1, -2)).float()
            s[..., n_keys:] = float("-inf")
            torch.matmul(torch.softmax(s, -1).to(DT), v)

    def keys_as_rows():
        for k, v in room:
            s = q.new_empty(H, n_keys, G)
            qs = (q * 0.125).view(H, G, D)
            for h in range(H):
                torch.mm(k[0, h, :n_keys], qs[h].t(), out=s[h])
            torch.matmul(torch.softmax(s.transpose(1, 2).float(), -1).to(DT), v[0, :, :n_keys])

    us = lambda f: round(per_call(f, 20) / LAYERS * 1e6, 1)  # noqa: E731
    return {
        "grouped, cache view with room": us(lambda: grouped(room)),
        "grouped, heads contiguous": us(lambda: grouped(tight)),
        "bare batched product, heads contiguous": us(bare),
        "K·qᵀ per head": us(keys_as_rows),
    }


QWEN_15B = {"layers": 28, "hidden": 1536, "kv": 256, "mlp": 8960, "vocab": 151936}


def int8_products(rows: int = 1) -> dict[str, str]:
    """GB/s of 8-bit weights a pass of ``rows`` tokens reads (module docstring, 3)."""
    c = QWEN_15B
    h, kv, mlp = c["hidden"], c["kv"], c["mlp"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (mlp, h), (mlp, h), (h, mlp)]  # q k v o gate up down: (out, in)

    def weights(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(-127, 128, (out, inp), dtype=torch.int8), torch.rand(out, dtype=DT) / 100

    layers = [[weights(*shape) for shape in shapes] for _ in range(c["layers"])]
    xs = {n: torch.randn(rows, n, dtype=DT) for n in (h, mlp)}

    def pytorch(w, scales):
        return torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]], w, scales)

    def forced_avx2(w, scales):  # the exact kernel's AVX2 path, forced (what a CPU without AVX-512 runs)
        return torch.ops.kvcli.int8_rows_exact_path(xs[w.shape[1]], w, scales, 1).to(DT)

    def step(which, product=pytorch):
        for layer in which:
            for w, scales in layer:
                product(w, scales)

    head = weights(c["vocab"], h)
    per_layer = sum(w.numel() for w, _ in layers[0])
    gb = lambda nbytes, s: f"{nbytes / s / 1e9:.1f} GB/s ({s * 1e3:.1f} ms)"  # noqa: E731
    # the LM head in 4 bits as --quant 4 holds a layer (groups of 32, kvcli.model.cpu_quant), for its time
    packed, scale_zero = pack_int4(torch.randn(c["vocab"], h), GROUP, DT)
    int4_head = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xs[h], packed, GROUP, scale_zero)  # noqa: E731
    out = {
        "28 layers, cold": gb(per_layer * len(layers), per_call(lambda: step(layers), 5)),
        "one layer, hot": gb(per_layer, per_call(lambda: step(layers[:1]), 50)),
        "LM head": gb(head[0].numel(), per_call(lambda: pytorch(*head), 5)),
        "LM head in 4 bits": gb(packed.numel() * packed.element_size(), per_call(int4_head, 5)),
    }
    for mode, kernel in (("exact", int8_rows.exact), ("8bit", int8_rows.product)):
        path = int8_rows.load(chosen=mode)  # where it compiles and loads: its path on this CPU
        if path is None or (mode == "8bit" and rows > int8_rows.ROWS):  # 8bit: decoding's passes only
            continue
        run = lambda w, scales, kernel=kernel: kernel(xs[w.shape[1]], w, scales)  # noqa: E731
        out[f"kvcli's {mode} kernel ({path}): 28 layers, cold"] = gb(
            per_layer * len(layers), per_call(lambda: step(layers, run), 5)
        )
        out[f"kvcli's {mode} kernel ({path}): LM head"] = gb(head[0].numel(), per_call(lambda: run(*head), 5))
        if mode == "exact" and path == "AVX-512":  # its AVX2 path too, on this CPU's memory
            out["kvcli's exact kernel, AVX2 path forced: 28 layers, cold"] = gb(
                per_layer * len(layers), per_call(lambda: step(layers, forced_avx2), 5)
            )
    return out


def dynamic_products() -> dict[str, str]:
    """The 28 layers' products with int8 activations (module docstring, 4): GB/s, and the seconds
    packing the 1.5B's weights (all its matrices' weights, at this measured pace) would take."""
    import warnings

    warnings.filterwarnings("ignore", message=".*quantize.* deprecated")  # PyTorch's note on the API
    c = QWEN_15B
    h, kv, mlp = c["hidden"], c["kv"], c["mlp"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (mlp, h), (mlp, h), (h, mlp)]
    n_weights = c["layers"] * sum(o * i for o, i in shapes) + c["vocab"] * h
    out = {}
    for engine in ("x86", "onednn"):
        torch.backends.quantized.engine = engine
        t, layers = time.perf_counter(), []
        for _ in range(c["layers"]):
            layer = []
            for o, i in shapes:
                codes = torch.randint(-127, 128, (o, i), dtype=torch.int8)
                q = torch._make_per_channel_quantized_tensor(codes, torch.rand(o, dtype=torch.float64) / 100, torch.zeros(o, dtype=torch.long), 0)  # fmt: skip
                layer.append((torch.ops.quantized.linear_prepack(q, None), i))
            layers.append(layer)
        packing = (time.perf_counter() - t) / (c["layers"] * sum(o * i for o, i in shapes))
        xs = {n: torch.randn(1, n) for n in (h, mlp)}

        def step(layers=layers):
            for layer in layers:
                for packed, i in layer:
                    torch.ops.quantized.linear_dynamic(xs[i], packed, False)

        s = per_call(step, 5)
        per_layer = sum(o * i for o, i in shapes)
        out[engine] = (
            f"{per_layer * c['layers'] / s / 1e9:.1f} GB/s ({s * 1e3:.1f} ms); packing the 1.5B {packing * n_weights:.1f} s"
        )
    return out


if __name__ == "__main__":
    import sys

    print(f"threads: {torch.get_num_threads()}")
    bandwidth()
    if "--products" in sys.argv:
        # --rows 1,4,16,48: the passes timed (default 1 and 4: a step, a draft of three checked)
        counts = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else "1,4"
        for rows in map(int, counts.split(",")):
            print(f"8-bit weight products of Qwen2.5-Coder-1.5B, a pass of {rows} row(s):", int8_products(rows))
        raise SystemExit
    if "--dynamic" in sys.argv:
        print("int8 activations and weights, Qwen2.5-Coder-1.5B's 28 layers, one row:", dynamic_products())
        raise SystemExit
    print("attention of one decoding query, µs per layer (30 layers' KV read in turn):")
    for n in (1000, 4000, 8000):
        print(f"  {n:>5} keys", attention(n))
