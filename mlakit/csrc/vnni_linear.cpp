// A linear layer's product at a few rows (decode) for CPUs with AVX512-BF16, on a weight kept in
// blocks of 32 output columns with pairs of inputs interleaved (VNNI):
//   packed [N/32][K/2][32 columns][2 inputs]  (N and K padded with zeros to 32 and 2)
// y [M, N] = x [M, K] . W^T: each block is one sequential stream of K/2 x 128 bytes, read once for
// every row of x (row pairs broadcast from x, 8 rows x 32 columns of fp32 sums per tile); the sums
// are rounded to bf16 once, as F.linear's bf16 result is.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int NB = 32;  // output columns per block

// MT rows x 32 columns over the block's kp pairs; y rows of ldy, columns [n0, n0 + live)
template <int MT>
inline void tile(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t kp, const float* bias,
                 uint16_t* y, int64_t ldy, int live) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * NB + 16), _MM_HINT_T0);
    const __m512i b0 = _mm512_loadu_si512(w + k * NB), b1 = _mm512_loadu_si512(w + k * NB + 16);
    for (int m = 0; m < MT; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[m * ldx + k]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, (__m512bh)b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, (__m512bh)b1);
    }
  }
  const __mmask16 lo = (__mmask16)(live >= 16 ? 0xFFFF : (1u << live) - 1);
  const __mmask16 hi = (__mmask16)(live >= 32 ? 0xFFFF : live <= 16 ? 0 : (1u << (live - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(lo, bias);
    b1 = _mm512_maskz_loadu_ps(hi, bias + 16);
  }
  for (int m = 0; m < MT; ++m) {
    const __m256i r0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][0], b0));
    const __m256i r1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][1], b1));
    _mm256_mask_storeu_epi16(y + m * ldy, lo, r0);
    _mm256_mask_storeu_epi16(y + m * ldy + 16, hi, r1);
  }
}

using Tile = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const float*, uint16_t*, int64_t, int);
constexpr Tile TILES[9] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

void check(bool ok, const char* what) { TORCH_CHECK(ok, "vnni_linear: ", what); }

// the tiles of blocks [b0, b1) of `heads` products sharing M rows: head h reads x + h * xh (rows ldx
// pairs apart) against its `blocks` blocks and writes y + h * N (rows ldy apart)
void run(const uint32_t* x, int64_t ldx, int64_t xh, const uint32_t* w, int64_t blocks, int64_t kp, int64_t M,
         int64_t N, const float* bias, uint16_t* y, int64_t ldy, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t h = i / blocks, blk = i % blocks;
    const int live = (int)std::min<int64_t>(NB, N - blk * NB);
    const float* b = bias == nullptr ? nullptr : bias + blk * NB;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int mt = (int)std::min<int64_t>(8, M - m0);
      TILES[mt](x + h * xh + m0 * ldx, ldx, w + i * kp * NB, kp, b, y + h * N + m0 * ldy + blk * NB, ldy, live);
    }
  }
}

const uint32_t* pairs(const at::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr<at::BFloat16>()); }

// x [M, K] bf16 (rows contiguous), packed [ceil(N/32), K/2, 64] bf16, bias [N] fp32 or none
at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  check(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x [M, K] bf16, rows contiguous");
  check(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(2) == 2 * NB,
        "packed [N/32, K/2, 64] bf16 contiguous");
  const int64_t M = x.size(0), K = x.size(1), kp = packed.size(1), blocks = packed.size(0);
  check(K % 2 == 0 && x.stride(0) % 2 == 0, "K and x's row stride must be even");
  check(kp == K / 2 && blocks == (N + NB - 1) / NB, "packed weight does not match x's width or N");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias [N] fp32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // a few blocks a task: each is kp x 128 bytes read once
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    run(pairs(x), x.stride(0) / 2, 0, pairs(packed), blocks, kp, M, N, b, yp, N, b0, b1);
  });
  return y;
}

// per head: y [M, H, N] = x [M, H, K] . W_h^T, packed [H, ceil(N/32), K/2, 64] (x rows and heads any
// even strides, the last dim contiguous): the absorbed path's folds and unfolds of a few rows
at::Tensor vnni_heads(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1, "x [M, H, K] bf16, rows contiguous");
  check(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.size(3) == 2 * NB,
        "packed [H, N/32, K/2, 64] bf16 contiguous");
  const int64_t M = x.size(0), H = x.size(1), K = x.size(2), blocks = packed.size(1), kp = packed.size(2);
  check(K % 2 == 0 && x.stride(0) % 2 == 0 && x.stride(1) % 2 == 0, "K and x's strides must be even");
  check(packed.size(0) == H && kp == K / 2 && blocks == (N + NB - 1) / NB, "packed weight does not match x or N");
  at::Tensor y = at::empty({M, H, N}, x.options());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, H * blocks, 2, [&](int64_t b0, int64_t b1) {
    run(pairs(x), x.stride(0) / 2, x.stride(1) / 2, pairs(packed), blocks, kp, M, N, nullptr, yp, H * N, b0, b1);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlakit_cpu, m) {
  m.def("vnni_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.impl("vnni_linear", c10::DispatchKey::CPU, TORCH_FN(vnni_linear));
  m.def("vnni_heads(Tensor x, Tensor packed, int N) -> Tensor");
  m.impl("vnni_heads", c10::DispatchKey::CPU, TORCH_FN(vnni_heads));
}
