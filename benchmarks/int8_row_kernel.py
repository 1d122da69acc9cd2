"""Does a hand-written AVX-512 kernel read 8-bit weight rows faster than PyTorch's? (docs/cpu.md,
"Decoding: what bounds it").

    pip install ninja && .venv/bin/python benchmarks/int8_row_kernel.py

A decoding step's products, ``y[n] = scale[n] * sum_k w[n, k] * x[k]`` with int8 weights as kvcli
holds them (one scale per row) and the activations in float32 (bfloat16's values, exactly), the
arithmetic of ``torch.ops.aten._weight_int8pack_mm``: each 16 weights widened to int32, converted
to float and multiplied-added, four rows at a time, the rows split over PyTorch's threads (OpenMP).
Compiled with ``torch.utils.cpp_extension.load_inline`` (g++ and ninja; ~25 s once). Each shape of
the Qwen 1.5B's step is timed against PyTorch's kernel, the weights of many copies read in turn
(cold, as in a step), with the largest difference from float64's product. Run it alone: the figures
are memory and instruction throughput. Needs a CPU with AVX-512 (F and BW).
"""

from __future__ import annotations

import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline __m512 widened(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// y[n] = scale[n] * sum_k w[n,k] * x[k]: w int8 (N, K) row-major, x and scale float32, K % 16 == 0
torch::Tensor int8_rows(torch::Tensor w, torch::Tensor x, torch::Tensor scale) {
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16");
  auto y = torch::empty({N}, x.options());
  const int8_t* W = w.data_ptr<int8_t>();
  const float* X = x.data_ptr<float>();
  const float* S = scale.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(X + k);
        for (int r = 0; r < 4; ++r) a[r] = _mm512_fmadd_ps(widened(W + (n + r) * K + k), xv, a[r]);
      }
      for (int r = 0; r < 4; ++r) Y[n + r] = _mm512_reduce_add_ps(a[r]) * S[n + r];
    }
    for (; n < n1; ++n) {
      __m512 a0 = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) a0 = _mm512_fmadd_ps(widened(W + n * K + k), _mm512_loadu_ps(X + k), a0);
      Y[n] = _mm512_reduce_add_ps(a0) * S[n];
    }
  });
  return y;
}
"""

SHAPES = [(1536, 8960), (8960, 1536), (1536, 1536), (1536, 256), (1536, 151936)]  # (in, out) of the 1.5B's step


def median_ms(f, n: int = 30) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[n // 2]


def main() -> None:
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-fopenmp"]
    t = time.perf_counter()
    kernel = load_inline("kvcli_int8_rows", cpp_sources=[SOURCE], functions=["int8_rows"], extra_cflags=flags, extra_ldflags=["-fopenmp"])  # fmt: skip
    print(f"threads: {torch.get_num_threads()}; compiled in {time.perf_counter() - t:.0f} s (cached after)")
    for k, n in SHAPES:
        copies = max(1, int(400e6 // (k * n)))
        ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        scale = torch.rand(n, dtype=torch.bfloat16) / 100
        x = torch.randn(1, k, dtype=torch.bfloat16)
        turn = iter(range(10**9))
        pytorch = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, ws[next(turn) % copies], scale))
        xf, sf = x.float()[0], scale.float()
        own = median_ms(lambda: kernel.int8_rows(ws[next(turn) % copies], xf, sf).to(torch.bfloat16))
        exact = (x.double() @ ws[0].double().t() * scale.double())[0]
        err_pt = (torch.ops.aten._weight_int8pack_mm(x, ws[0], scale)[0].double() - exact).abs().max().item()
        err_own = (kernel.int8_rows(ws[0], xf, sf).double() - exact).abs().max().item()
        print(
            f"{k} x {n}: PyTorch {pytorch:.3f} ms ({k * n / pytorch / 1e6:.1f} GB/s), largest error {err_pt:.3g} (its bfloat16 output); "
            f"AVX-512 {own:.3f} ms ({k * n / own / 1e6:.1f} GB/s), largest error {err_own:.3g}"
        )


if __name__ == "__main__":
    main()
