// kvcli's decoding products for int8 weights (kvcli/model/int8_rows.py): exact activations below
// (product_exact), or 8-bit ones:
//
//   y[m, n] = scale[n] * sum_b xs[m, b] * sum_{k in block b} xq[m, k] * w[n, k]
//
// w: int8 (N, K), one scale per row, |w| <= 127, as kvcli.model.cpu_quant.quantize_int8 holds it,
// read as stored (no packing). x: (M, K) in any float dtype, quantised here per row and block of
// 64 inputs to int8 (the block's largest magnitude at 127, rounded half to even as torch.round).
// Each block's integer dot product is exact; the blocks are summed in float32. K % 64 == 0.
// Two paths, chosen by the CPU at run time: AVX-512 VNNI (vpdpbusd) and AVX2 (vpmaddubsw).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t BLOCK = 64;  // inputs per activation scale: one AVX-512 vector, two AVX2 ones
constexpr int64_t TILE = 4;  // weight rows multiplied together: each activation block loaded once for four

struct Args {
  const int8_t* xq;  // (M, K)
  const float* xs;   // (M, K / BLOCK)
  const int8_t* w;   // (N, K)
  const float* scale;  // (N)
  float* y;          // (M, N)
  int64_t M, N, K;
};

void quantise(const float* x, int64_t M, int64_t K, int8_t* q, float* s) {
  const int64_t B = K / BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * K + b * BLOCK;
      float amax = 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float sc = amax / 127.f;
      const float inv = sc > 0.f ? 1.f / sc : 0.f;
      s[m * B + b] = sc;
      for (int64_t i = 0; i < BLOCK; ++i) {
        const float v = std::nearbyint(xb[i] * inv);
        q[m * K + b * BLOCK + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
  }
}

// The same block of the next tile's rows is asked for ahead (prefetch below): a tile's rows are
// short streams (the 1.5B's 1,536 bytes) that the CPU's own prefetching may not follow in time.
// Written out in each path: as a function of its own it was called, not inlined, and the call
// spilled every register (measured: 1.3-1.6x slower).
#define PREFETCH_NEXT_TILE(a, n, R, offset)                                                                  \
  if ((n) + (R) + (R) <= (a).N)                                                                             \
    for (int r_ = 0; r_ < (R); ++r_)                                                                        \
      _mm_prefetch(reinterpret_cast<const char*>((a).w + ((n) + (R) + r_) * (a).K + (offset)), _MM_HINT_T0);

// AVX-512 VNNI: vpdpbusd multiplies unsigned bytes by signed ones, so the weights are read as
// w + 128 (a flipped top bit) and the 128 * sum(x) this adds to a block's sums is taken off before
// they are scaled, made once per activation row and block. One block is one vector of 64 bytes.
// Rows of activations are taken up to MB at a time, each weight vector loaded once for all of them.
template <int MB, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void tile_vnni(const Args& a, int64_t n, int64_t m0) {
  const int64_t B = a.K / BLOCK;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB][R];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i sums[MB][R], extra[MB];
    __m512i w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm512_xor_si512(_mm512_loadu_si512(a.w + (n + r) * a.K + b * BLOCK), flip);
    PREFETCH_NEXT_TILE(a, n, R, b * BLOCK)
    for (int mi = 0; mi < MB; ++mi) {
      const __m512i x = _mm512_loadu_si512(a.xq + (m0 + mi) * a.K + b * BLOCK);
      extra[mi] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, x);
      for (int r = 0; r < R; ++r) sums[mi][r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], x);
    }
    for (int mi = 0; mi < MB; ++mi) {
      const __m512 xs = _mm512_set1_ps(a.xs[(m0 + mi) * B + b]);
      for (int r = 0; r < R; ++r)
        acc[mi][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[mi][r], extra[mi])), xs, acc[mi][r]);
    }
  }
  for (int mi = 0; mi < MB; ++mi)
    for (int r = 0; r < R; ++r) a.y[(m0 + mi) * a.N + n + r] = _mm512_reduce_add_ps(acc[mi][r]) * a.scale[n + r];
}

// MB activation rows times R weight rows, both known when compiled: the sums stay in registers
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void rows_of_vnni(const Args& a, int64_t n, int64_t rows,
                                                                                int64_t m0) {
  switch (rows) {
    case 4: return tile_vnni<MB, 4>(a, n, m0);
    case 3: return tile_vnni<MB, 3>(a, n, m0);
    case 2: return tile_vnni<MB, 2>(a, n, m0);
    default: return tile_vnni<MB, 1>(a, n, m0);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_vnni(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) rows_of_vnni<4>(a, n, rows, m);
    for (; m + 2 <= a.M; m += 2) rows_of_vnni<2>(a, n, rows, m);
    for (; m < a.M; ++m) rows_of_vnni<1>(a, n, rows, m);
  }
}

// AVX2: vpmaddubsw's pairs would saturate 16 bits with w + 128, so the activation's magnitude is
// multiplied by the weight carrying its sign instead (as llama.cpp's q8 dot products do): pairs of
// at most 2 * 127 * 127, then summed to 32 bits.
__attribute__((target("avx2,fma"))) inline __m256i dot_avx2(__m256i x, __m256i w) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

__attribute__((target("avx2,fma"))) inline float sum_avx2(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// one activation row at a time: sixteen registers hold no more
template <int R>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const Args& a, int64_t n, int64_t m) {
  const int64_t B = a.K / BLOCK;
  __m256 acc[R];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m256i w0[R], w1[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* wb = a.w + (n + r) * a.K + b * BLOCK;
      w0[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
      w1[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32));
    }
    PREFETCH_NEXT_TILE(a, n, R, b * BLOCK)
    const int8_t* xb = a.xq + m * a.K + b * BLOCK;
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32));
    const __m256 xs = _mm256_set1_ps(a.xs[m * B + b]);
    for (int r = 0; r < R; ++r) {
      const __m256i sums = _mm256_add_epi32(dot_avx2(x0, w0[r]), dot_avx2(x1, w1[r]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), xs, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) a.y[m * a.N + n + r] = sum_avx2(acc[r]) * a.scale[n + r];
}

__attribute__((target("avx2,fma"))) void rows_avx2(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    for (int64_t m = 0; m < a.M; ++m) {
      switch (rows) {  // R known when compiled: the sums stay in registers
        case 4: tile_avx2<4>(a, n, m); break;
        case 3: tile_avx2<3>(a, n, m); break;
        case 2: tile_avx2<2>(a, n, m); break;
        default: tile_avx2<1>(a, n, m);
      }
    }
  }
}

// Exact activations: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] in float32, the activations as
// they come (bfloat16 widens to float32 exactly) and each weight widened to float32 (exact: |w| <=
// 127): the products PyTorch's kernel computes, summed in another order (float32 rounding apart).
// The CPU widens 16 weights a vector (vpmovsxbd, vcvtdq2ps), so the work per weight is larger than
// vpdpbusd's; the tiles, the prefetch and the sums kept in registers are the paths' above. U: sums
// kept per product (two where few activation rows leave the multiply-adds waiting on each other).
struct Exact {
  const float* x;  // (M, K)
  const int8_t* w;  // (N, K)
  const float* scale;  // (N)
  float* y;  // (M, N)
  int64_t M, N, K;
};

constexpr int64_t EXACT_STEP = 32;  // inputs an iteration: two vectors of 16 (AVX-512), four of 8 (AVX2)

template <int MB, int R>
__attribute__((target("avx512f"))) inline void tile_exact512(const Exact& a, int64_t n, int64_t m0) {
  constexpr int U = MB <= 2 ? 2 : 1;
  __m512 acc[U][MB][R];
  for (auto& set : acc)
    for (auto& row : set)
      for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; k += EXACT_STEP) {
    if ((k & 63) == 0 && n + R + R <= a.N)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(a.w + (n + R + r) * a.K + k), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const int u = U == 2 ? h : 0;
      __m512 w[R];
      for (int r = 0; r < R; ++r)
        w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.w + (n + r) * a.K + k + 16 * h))));
      for (int mi = 0; mi < MB; ++mi) {
        const __m512 x = _mm512_loadu_ps(a.x + (m0 + mi) * a.K + k + 16 * h);
        for (int r = 0; r < R; ++r) acc[u][mi][r] = _mm512_fmadd_ps(w[r], x, acc[u][mi][r]);
      }
    }
  }
  for (int mi = 0; mi < MB; ++mi)
    for (int r = 0; r < R; ++r) {
      const __m512 sum = U == 2 ? _mm512_add_ps(acc[0][mi][r], acc[U - 1][mi][r]) : acc[0][mi][r];
      a.y[(m0 + mi) * a.N + n + r] = _mm512_reduce_add_ps(sum) * a.scale[n + r];
    }
}

template <int MB>
__attribute__((target("avx512f"))) inline void rows_of_exact512(const Exact& a, int64_t n, int64_t rows, int64_t m0) {
  switch (rows) {
    case 4: return tile_exact512<MB, 4>(a, n, m0);
    case 3: return tile_exact512<MB, 3>(a, n, m0);
    case 2: return tile_exact512<MB, 2>(a, n, m0);
    default: return tile_exact512<MB, 1>(a, n, m0);
  }
}

__attribute__((target("avx512f"))) void rows_exact512(const Exact& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) rows_of_exact512<4>(a, n, rows, m);
    for (; m + 2 <= a.M; m += 2) rows_of_exact512<2>(a, n, rows, m);
    for (; m < a.M; ++m) rows_of_exact512<1>(a, n, rows, m);
  }
}

// AVX2: up to two activation rows at a time (sixteen registers), two sums per product for one row
template <int MB, int R>
__attribute__((target("avx2,fma"))) inline void tile_exact256(const Exact& a, int64_t n, int64_t m0) {
  constexpr int U = MB == 1 ? 2 : 1;
  __m256 acc[U][MB][R];
  for (auto& set : acc)
    for (auto& row : set)
      for (auto& v : row) v = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.K; k += EXACT_STEP) {
    if ((k & 63) == 0 && n + R + R <= a.N)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(a.w + (n + R + r) * a.K + k), _MM_HINT_T0);
    for (int q = 0; q < 4; ++q) {
      const int u = U == 2 ? (q & 1) : 0;
      __m256 x[MB];
      for (int mi = 0; mi < MB; ++mi) x[mi] = _mm256_loadu_ps(a.x + (m0 + mi) * a.K + k + 8 * q);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.w + (n + r) * a.K + k + 8 * q))));
        for (int mi = 0; mi < MB; ++mi) acc[u][mi][r] = _mm256_fmadd_ps(w, x[mi], acc[u][mi][r]);
      }
    }
  }
  for (int mi = 0; mi < MB; ++mi)
    for (int r = 0; r < R; ++r) {
      const __m256 sum = U == 2 ? _mm256_add_ps(acc[0][mi][r], acc[U - 1][mi][r]) : acc[0][mi][r];
      a.y[(m0 + mi) * a.N + n + r] = sum_avx2(sum) * a.scale[n + r];
    }
}

template <int MB>
__attribute__((target("avx2,fma"))) inline void rows_of_exact256(const Exact& a, int64_t n, int64_t rows, int64_t m0) {
  switch (rows) {
    case 4: return tile_exact256<MB, 4>(a, n, m0);
    case 3: return tile_exact256<MB, 3>(a, n, m0);
    case 2: return tile_exact256<MB, 2>(a, n, m0);
    default: return tile_exact256<MB, 1>(a, n, m0);
  }
}

__attribute__((target("avx2,fma"))) void rows_exact256(const Exact& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += TILE) {
    const int64_t rows = std::min(TILE, n1 - n);
    int64_t m = 0;
    for (; m + 2 <= a.M; m += 2) rows_of_exact256<2>(a, n, rows, m);
    for (; m < a.M; ++m) rows_of_exact256<1>(a, n, rows, m);
  }
}

enum Path { NONE = 0, AVX2 = 1, VNNI = 2 };

Path path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
    return VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return NONE;
}

int64_t cpu_path() { return path(); }

at::Tensor product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, Path chosen) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_rows: x (M, K), w (N, K)");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_rows: w contiguous int8");
  TORCH_CHECK(w.size(1) % BLOCK == 0, "int8_rows: K a multiple of 64");
  TORCH_CHECK(scale.numel() == w.size(0), "int8_rows: one scale per row of w");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({M, K / BLOCK}, x.options().dtype(at::kFloat));
  quantise(xf.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Args a{xq.data_ptr<int8_t>(), xs.data_ptr<float>(), w.data_ptr<int8_t>(), sf.data_ptr<float>(),
               y.data_ptr<float>(), M, N, K};
  // tiles of TILE rows never split between threads
  at::parallel_for(0, (N + TILE - 1) / TILE, 16, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * TILE, n1 = std::min(N, t1 * TILE);
    if (chosen == VNNI)
      rows_vnni(a, n0, n1);
    else
      rows_avx2(a, n0, n1);
  });
  return y;
}

bool has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

int64_t exact_cpu_path() { return has_avx512f() ? 2 : (path() != NONE ? 1 : 0); }

at::Tensor product_exact(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool wide) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_rows_exact: x (M, K), w (N, K)");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous(), "int8_rows_exact: w contiguous int8");
  TORCH_CHECK(w.size(1) % EXACT_STEP == 0, "int8_rows_exact: K a multiple of 32");
  TORCH_CHECK(scale.numel() == w.size(0), "int8_rows_exact: one scale per row of w");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Exact a{xf.data_ptr<float>(), w.data_ptr<int8_t>(), sf.data_ptr<float>(), y.data_ptr<float>(), M, N, K};
  at::parallel_for(0, (N + TILE - 1) / TILE, 16, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * TILE, n1 = std::min(N, t1 * TILE);
    if (wide)
      rows_exact512(a, n0, n1);
    else
      rows_exact256(a, n0, n1);
  });
  return y;
}

at::Tensor int8_rows_exact(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  static const Path chosen = path();
  static const bool wide = has_avx512f();
  TORCH_CHECK(chosen != NONE, "int8_rows_exact: this CPU has neither AVX-512 nor AVX2 with FMA");
  return product_exact(x, w, scale, wide);
}

at::Tensor int8_rows_exact_path(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t forced) {
  // 1: AVX2, 2: AVX-512 (tests run each path this CPU has)
  TORCH_CHECK(forced == 1 || forced == 2, "int8_rows_exact_path: 1 (AVX2) or 2 (AVX-512)");
  TORCH_CHECK(forced == 1 ? path() != NONE : has_avx512f(), "int8_rows_exact_path: this CPU lacks that path");
  return product_exact(x, w, scale, forced == 2);
}

// The weights made dense for a prefill's GEMM (kvcli.model.cpu_quant.Int8Linear.dense): w[n, k] *
// scale[n] in float32, kept so or rounded to bfloat16 to nearest even as PyTorch rounds, so the bits
// are those of torch.mul(w, scale[:, None]) with the scale in that dtype. One pass over the codes
// (PyTorch's widens them to a temporary first), the loops vectorised by the compiler per path.
template <bool BF16>
__attribute__((always_inline)) inline void dense_rows_of(const int8_t* w, const float* scale, void* out, int64_t n0,
                                                          int64_t n1, int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const float s = scale[n];
    const int8_t* wr = w + n * K;
    if constexpr (BF16) {
      uint16_t* o = static_cast<uint16_t*>(out) + n * K;
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(wr[k]) * s;
        uint32_t u;
        std::memcpy(&u, &v, sizeof u);
        o[k] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // finite: no NaN to keep
      }
    } else {
      float* o = static_cast<float*>(out) + n * K;
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(wr[k]) * s;
    }
  }
}

template <bool BF16>
__attribute__((target("avx512f"))) void dense512(const int8_t* w, const float* s, void* o, int64_t n0, int64_t n1,
                                                 int64_t K) {
  dense_rows_of<BF16>(w, s, o, n0, n1, K);
}

template <bool BF16>
__attribute__((target("avx2"))) void dense256(const int8_t* w, const float* s, void* o, int64_t n0, int64_t n1,
                                              int64_t K) {
  dense_rows_of<BF16>(w, s, o, n0, n1, K);
}

at::Tensor int8_rows_dense(const at::Tensor& w, const at::Tensor& scale, bool bf16, int64_t forced) {
  // forced: 0 this CPU's path, 1 AVX2, 2 AVX-512 (tests run each path this CPU has)
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "int8_rows_dense: w contiguous int8");
  TORCH_CHECK(scale.numel() == w.size(0), "int8_rows_dense: one scale per row of w");
  TORCH_CHECK(forced >= 0 && forced <= 2, "int8_rows_dense: path 0 (this CPU's), 1 (AVX2) or 2 (AVX-512)");
  const bool wide = forced == 0 ? has_avx512f() : forced == 2;
  TORCH_CHECK(wide ? has_avx512f() : path() != NONE, "int8_rows_dense: this CPU lacks that path");
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor sf = scale.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({N, K}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  void* op = out.data_ptr();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    if (wide)
      bf16 ? dense512<true>(wp, sp, op, n0, n1, K) : dense512<false>(wp, sp, op, n0, n1, K);
    else
      bf16 ? dense256<true>(wp, sp, op, n0, n1, K) : dense256<false>(wp, sp, op, n0, n1, K);
  });
  return out;
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  static const Path chosen = path();
  TORCH_CHECK(chosen != NONE, "int8_rows: this CPU has neither AVX-512 VNNI nor AVX2 with FMA");
  return product(x, w, scale, chosen);
}

at::Tensor int8_rows_path(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t forced) {
  // the same product on a named path (tests run each path this CPU has)
  TORCH_CHECK(forced == VNNI || forced == AVX2, "int8_rows_path: 1 (AVX2) or 2 (AVX-512 VNNI)");
  TORCH_CHECK(forced <= path(), "int8_rows_path: this CPU lacks that path");
  return product(x, w, scale, static_cast<Path>(forced));
}

}  // namespace

TORCH_LIBRARY(kvcli, m) {
  m.def("int8_rows(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_rows_path(Tensor x, Tensor w, Tensor scale, int path) -> Tensor");
  m.def("int8_rows_cpu_path() -> int");
  m.def("int8_rows_exact(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int8_rows_exact_path(Tensor x, Tensor w, Tensor scale, int path) -> Tensor");
  m.def("int8_rows_exact_cpu_path() -> int");
  m.def("int8_rows_dense(Tensor w, Tensor scale, bool bf16, int path) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcli, CPU, m) {
  m.impl("int8_rows", int8_rows);
  m.impl("int8_rows_path", int8_rows_path);
  m.impl("int8_rows_exact", int8_rows_exact);
  m.impl("int8_rows_exact_path", int8_rows_exact_path);
  m.impl("int8_rows_dense", int8_rows_dense);
}

TORCH_LIBRARY_IMPL(kvcli, CompositeExplicitAutograd, m) {
  m.impl("int8_rows_cpu_path", cpu_path);
  m.impl("int8_rows_exact_cpu_path", exact_cpu_path);
}
