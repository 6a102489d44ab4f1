// Per-row ops of an engine step (AVX-512): the sampler's draw and argmax, RMSNorm and rope.
//
// argmax_rows: torch.argmax(x, -1) of fp32 or bf16 logits, the same answer (the first index of the
// row's largest value; a NaN counts as the largest, the first NaN wins), one row per work item. ATen's
// bf16 argmax runs a scalar loop: 7.4 ms for 32 rows of 129,280 on 2 cores of an AMD EPYC Zen 4,
// where reading them takes ~0.3 ms (and its fp32 argmax 1.7 ms).
//
// inverse_cdf_logits: one draw per row from softmax(x * inv_temp) by its inverse CDF, straight from the logits (AVX-512):
// the sampler's two-level running sum (mlakit/engine/sampler.py: inverse_cdf) without the softmax
// and its copies. Per row: the max; exp((x - max) * inv_temp) summed in fp32 per block of 1,024
// tokens, the block sums' running sum in fp64; the target u x total (kept below the total); the
// block it falls in, rescanned with an fp64 running sum against the target's share of that block.
// A token of weight 0 (a logit of -inf) is never drawn; a row whose weights are all 0 gives V - 1,
// as the torch path's clamp does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 1024;  // mlakit/engine/sampler.py: CDF_BLOCK

using mlakit_tiles::load_bf16;
using mlakit_tiles::tail;

// 16 logits from i (lanes past the mask -inf), fp32 or bf16 (widened exactly: the fp32 path's values)
template <class T>
inline __m512 logits16(const T* x, int64_t i, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_mask_loadu_ps(_mm512_set1_ps(mlakit_tiles::NEG_INF), m, x + i);
  else
    return _mm512_mask_mov_ps(_mm512_set1_ps(mlakit_tiles::NEG_INF), m, load_bf16(x + i, m));
}

template <class T>
inline __m512 weights(const T* x, int64_t i, __mmask16 m, __m512 top, __m512 it) {
  const __m512 v = logits16(x, i, m);
  return _mm512_maskz_mov_ps(m, mlakit_tiles::exp512(_mm512_mul_ps(_mm512_sub_ps(v, top), it)));
}

template <class T>
int64_t draw(const T* x, int64_t V, float it, double u, std::vector<double>& cdf) {
  __m512 mx = _mm512_set1_ps(mlakit_tiles::NEG_INF);
  for (int64_t i = 0; i < V; i += 16) mx = _mm512_max_ps(mx, logits16(x, i, tail(V - i)));
  const float top = _mm512_reduce_max_ps(mx);
  if (!(top > mlakit_tiles::NEG_INF)) return V - 1;  // no token has weight (or NaN)
  const __m512 vt = _mm512_set1_ps(top), vi = _mm512_set1_ps(it);
  const int64_t blocks = (V + BLOCK - 1) / BLOCK;
  cdf.resize(blocks);
  double run = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = b * BLOCK; i < std::min(V, (b + 1) * BLOCK); i += 16)
      s = _mm512_add_ps(s, weights(x, i, tail(std::min(V, (b + 1) * BLOCK) - i), vt, vi));
    run += (double)_mm512_reduce_add_ps(s);
    cdf[b] = run;
  }
  const double target = std::min(u * run, std::nextafter(run, 0.0));
  const int64_t b = std::min<int64_t>(blocks - 1, std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin());
  const double before = b ? cdf[b - 1] : 0.0, mass = cdf[b] - before;
  const double share = mass > 0 ? std::min(1.0, std::max(0.0, (target - before) / mass)) : 0.0;
  // the block in fp64: its own total, the target at its share
  const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
  alignas(64) float w[BLOCK];
  for (int64_t i = lo; i < hi; i += 16) _mm512_storeu_ps(w + (i - lo), weights(x, i, tail(hi - i), vt, vi));
  double total = 0.0;
  for (int64_t i = 0; i < hi - lo; ++i) total += (double)w[i];
  const double inner = std::min(share * total, std::nextafter(total, 0.0));
  double acc = 0.0;
  for (int64_t i = 0; i < hi - lo; ++i) {
    acc += (double)w[i];
    if (acc > inner) return lo + i;
  }
  return hi - 1;
}

// x [R, V] fp32 or bf16 logits (rows contiguous), inv_temp [R] fp32, u [R] fp64 uniforms in [0, 1) ->
// [R] int64; bf16 logits draw exactly what their fp32 widening would
at::Tensor inverse_cdf_logits(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1,
              "inverse_cdf_logits: x [R, V] fp32 or bf16");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && inv_temp.scalar_type() == at::kFloat && inv_temp.is_contiguous() && inv_temp.numel() == R,
              "inverse_cdf_logits: inv_temp [R] fp32");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == R, "inverse_cdf_logits: u [R] fp64");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* it = inv_temp.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ld = x.stride(0);
  auto rows = [&](const auto* xp) {
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      std::vector<double> cdf;
      for (int64_t r = r0; r < r1; ++r) op[r] = draw(xp + r * ld, V, it[r], up[r], cdf);
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()));
  else
    rows(x.data_ptr<float>());
  return out;
}

// the first index of the row's largest value (NaN the largest): per lane, its largest value so far and
// where it was first seen (strictly greater replaces), then the smallest index among the lanes that hold
// the row's largest; lanes past V hold -inf at an index past V, which only an all -inf row reaches, and
// there lane 0 (index 0) ties with them and is smaller
template <class T>
int64_t row_argmax(const T* x, int64_t V) {
  __m512 mx = _mm512_set1_ps(mlakit_tiles::NEG_INF);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i at = lanes, cur = lanes;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __m512 v = logits16(x, i, tail(V - i));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);
    mx = _mm512_mask_mov_ps(mx, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, cur);
    cur = _mm512_add_epi32(cur, step);
  }
  if (nan) {
    for (int64_t i = 0; i < V; ++i) {
      float v;
      if constexpr (std::is_same_v<T, float>) {
        v = x[i];
      } else {
        const uint32_t bits = (uint32_t)x[i] << 16;
        std::memcpy(&v, &bits, sizeof v);
      }
      if (std::isnan(v)) return i;
    }
  }
  const __mmask16 top = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(_mm512_reduce_max_ps(mx)), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, at);
}

// x [R, V] fp32 or bf16 (rows contiguous, V < 2^31 - 16) -> [R] int64: torch.argmax(x, -1)
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1,
              "argmax_rows: x [R, V] fp32 or bf16, rows contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V < INT32_MAX - 16, "argmax_rows: 0 < V < 2^31 - 16");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ld = x.stride(0);
  auto rows = [&](const auto* xp) {
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * ld, V);
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()));
  else
    rows(x.data_ptr<float>());
  return out;
}

// transformers' RMSNorm in one pass per row: y = round(x * rsqrt(mean(x^2) + eps)) in fp32, then
// round(weight * y) (x, weight bf16; the sum of squares in fp32, in another order than torch's mean)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "rms_norm: x [M, D] bf16");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == D,
              "rms_norm: weight [D] bf16");
  at::Tensor out = at::empty({M, D}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ld = x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* row = xp + r * ld;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = load_bf16(row + d, tail(D - d));
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)D + (float)eps);
      const __m512 vs = _mm512_set1_ps(scale);
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = tail(D - d);
        const __m512 y = _mm512_mul_ps(load_bf16(row + d, m), vs);
        const __m512 yr = mlakit_tiles::round_bf16(y);
        _mm256_mask_storeu_epi16(op + r * D + d, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(yr, load_bf16(wp + d, m))));
      }
    }
  });
  return out;
}

// mlakit.rope.apply_tables in one pass (layouts "interleave" and "half", dr a multiple of 32):
// x [N, H, dr] (bf16 or fp32, any strides but the last), cos/sin [N, dr] fp32 contiguous in the
// full-width form rope_tables builds -> [N, H, dr] contiguous in x's dtype. Output j < dr/2 is
// a[j]·cos[j] + b[j]·sin[j] and output dr/2 + j is b[j]·cos[dr/2 + j] + a[j]·sin[dr/2 + j], with
// (a, b) = (x[2j], x[2j + 1]) interleaved or (x[j], x[dr/2 + j]) half-split: each product and the sum
// rounded in fp32 as torch's ops round them (no FMA), then rounded to x's dtype: bit for bit the same.
template <bool BF16>
inline __m512 load16(const void* p, int64_t i) {
  if constexpr (BF16)
    return load_bf16(static_cast<const uint16_t*>(p) + i);
  else
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

template <bool BF16>
inline void store16(void* p, int64_t i, __m512 v) {
  if constexpr (BF16)
    _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(p) + i), (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_storeu_ps(static_cast<float*>(p) + i, v);
}

inline __m512 rotate(__m512 a, __m512 c, __m512 b, __m512 s) {
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // no contraction into an FMA
  return _mm512_add_round_ps(_mm512_mul_round_ps(a, c, R), _mm512_mul_round_ps(b, s, R), R);
}

template <bool BF16>
void rope_rows_impl(const at::Tensor& x, const float* cp, const float* sp, bool interleave, at::Tensor& out) {
  const int64_t N = x.size(0), H = x.size(1), dr = x.size(2), half = dr / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1), esize = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  at::parallel_for(0, N * H, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = r / H, h = r % H;
      const void* row = xp + (n * s0 + h * s1) * esize;
      void* dst = op + r * dr * esize;
      const float* c = cp + n * dr;
      const float* s = sp + n * dr;
      for (int64_t j = 0; j < half; j += 16) {
        __m512 a, b;
        if (interleave) {
          const __m512 v0 = load16<BF16>(row, 2 * j), v1 = load16<BF16>(row, 2 * j + 16);
          a = _mm512_permutex2var_ps(v0, even, v1);
          b = _mm512_permutex2var_ps(v0, odd, v1);
        } else {
          a = load16<BF16>(row, j);
          b = load16<BF16>(row, half + j);
        }
        store16<BF16>(dst, j, rotate(a, _mm512_loadu_ps(c + j), b, _mm512_loadu_ps(s + j)));
        store16<BF16>(dst, half + j, rotate(b, _mm512_loadu_ps(c + half + j), a, _mm512_loadu_ps(s + half + j)));
      }
    }
  });
}

at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 32 == 0 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "rope_rows: x [N, H, dr] bf16 or fp32, dr a multiple of 32, last dim contiguous");
  const int64_t N = x.size(0), dr = x.size(2);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == dr,
                "rope_rows: cos/sin [N, dr] fp32 contiguous");
  at::Tensor out = at::empty({N, x.size(1), dr}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    rope_rows_impl<true>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), interleave, out);
  else
    rope_rows_impl<false>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), interleave, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlakit_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rope_rows(Tensor x, Tensor cos, Tensor sin, bool interleave) -> Tensor");
  m.impl("rope_rows", c10::DispatchKey::CPU, TORCH_FN(rope_rows));
  m.def("inverse_cdf_logits(Tensor x, Tensor inv_temp, Tensor u) -> Tensor");
  m.impl("inverse_cdf_logits", c10::DispatchKey::CPU, TORCH_FN(inverse_cdf_logits));
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
