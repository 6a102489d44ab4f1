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

#include "bf16_tiles.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int NB = 32;     // output columns per block
constexpr int64_t ROWS = 256;  // rows of x a pass over the weight takes at most

// MT rows x 32 columns over the block's kp pairs; y rows of ldy, columns [n0, n0 + live). `next`: a
// block (kp x 128 bytes) to bring into L2 meanwhile, two lines a step, or null
template <int MT>
inline void tile(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t kp, const float* bias,
                 uint16_t* y, int64_t ldy, int live, const uint32_t* next) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    // 48 steps (6 KiB) ahead into L2, not L1: L1's few fill buffers capped the misses in flight, so a
    // block streaming from memory waited on it (the experts at a decode step's ~8 rows an expert: the
    // memory reads and the products overlapped barely; this took 10-15% off them, linears unchanged).
    // _mm_prefetch here, not csrc/prefetch.h's asm: the asm in this loop halved the tile's speed
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 48) * NB), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 48) * NB + 16), _MM_HINT_T1);
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NB), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * NB + 16), _MM_HINT_T1);
    }
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

using Tile = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, const float*, uint16_t*, int64_t, int,
                     const uint32_t*);
constexpr Tile TILES[9] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

void check(bool ok, const char* what) { TORCH_CHECK(ok, "vnni_linear: ", what); }

// the tiles of blocks [b0, b1) of `heads` products sharing M rows: head h reads x + h * xh (rows ldx
// pairs apart) against its `blocks` blocks and writes y + h * N (rows ldy apart). Past 8 rows a block
// is read once from memory and again from L2 for each further tile: the last tile brings the next
// block into L2, so the next block's first tile does not wait on memory (the lm_head at 32 rows, two
// threads: 7-16% less time)
void run(const uint32_t* x, int64_t ldx, int64_t xh, const uint32_t* w, int64_t blocks, int64_t kp, int64_t M,
         int64_t N, const float* bias, uint16_t* y, int64_t ldy, int64_t b0, int64_t b1) {
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t h = i / blocks, blk = i % blocks;
    const int live = (int)std::min<int64_t>(NB, N - blk * NB);
    const float* b = bias == nullptr ? nullptr : bias + blk * NB;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int mt = (int)std::min<int64_t>(8, M - m0);
      const bool ahead = M > 8 && m0 + 8 >= M && i + 1 < b1;
      TILES[mt](x + h * xh + m0 * ldx, ldx, w + i * kp * NB, kp, b, y + h * N + m0 * ldy + blk * NB, ldy, live,
                ahead ? w + (i + 1) * kp * NB : nullptr);
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
  // a few blocks a task: each is kp x 128 bytes read once for all rows; many rows go ROWS at a time
  // (their pairs stay in L2 while every block passes, instead of all rows streaming once a block)
  const int64_t ldx = x.stride(0) / 2;
  for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
    const int64_t mc = std::min<int64_t>(ROWS, M - m0);
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      run(pairs(x) + m0 * ldx, ldx, 0, pairs(packed), blocks, kp, mc, N, b, yp + m0 * N, N, b0, b1);
    });
  }
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


// ---- the routed and shared experts of one MoE block over packed weights (a decode step's few rows per
// expert: one call instead of a few small ops per expert) ----

// one block of one product over a chunk of its rows: rows [M] of x against one packed block into y
struct Product {
  const uint32_t* x;
  int64_t ldx;
  const uint32_t* w;
  int64_t kp, M;
  uint16_t* y;
  int64_t ldy;
  int live;
};

// every thread of the pool claims the next run of items from one counter until none is left: experts'
// row counts differ from step to step, so fixed shares leave one thread waiting on the other; each item
// writes its own rows and columns, so the result does not depend on who took what. A run is up to 8
// consecutive items (an expert's blocks are one stream in memory, and a tile's prefetches run on past
// its block into the next: claimed one by one, that next block was often the other core's; 7 demo
// MoE blocks at 32 decode rows, Zen 4, two threads: 10.9 -> 9.3 ms), shorter where there are fewer
// than 8 runs a thread
void products(const std::vector<Product>& items) {
  const int64_t n = (int64_t)items.size(), threads = std::min<int64_t>(at::get_num_threads(), n);
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(8, n / std::max<int64_t>(1, threads * 8)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(run, std::memory_order_relaxed)) < n;)
      for (int64_t i = i0; i < std::min(n, i0 + run); ++i) {
        const Product& q = items[i];
        for (int64_t m0 = 0; m0 < q.M; m0 += 8) {
          const int mt = (int)std::min<int64_t>(8, q.M - m0);
          TILES[mt](q.x + m0 * q.ldx, q.ldx, q.w, q.kp, nullptr, q.y + m0 * q.ldy, q.ldy, q.live, nullptr);
        }
      }
  });
}

// the items of y [M, N] = x [M, K] . W^T (packed [ceil(N/32), K/2, 64]) appended: rows in chunks of at
// most ROWS, each chunk's blocks in order (a prefill's rows: the chunk stays in L2 while its blocks
// pass, where all of an expert's rows would stream from L3 once a block)
void add_blocks(std::vector<Product>& items, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                int64_t N, uint16_t* y) {
  const int64_t kp = K / 2, blocks = (N + NB - 1) / NB;
  for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
    const int64_t mc = std::min<int64_t>(ROWS, M - m0);
    for (int64_t b = 0; b < blocks; ++b)
      items.push_back({reinterpret_cast<const uint32_t*>(x + m0 * K), kp, reinterpret_cast<const uint32_t*>(w) + b * kp * NB,
                       kp, mc, y + m0 * N + b * NB, N, (int)std::min<int64_t>(NB, N - b * NB)});
  }
}

using mlakit_tiles::load_bf16;
using mlakit_tiles::round_bf16;
using mlakit_tiles::tail;

// act [rows, I] = silu(gate) * up of h [rows, 2I] (gate first), each rounded to bf16 as torch's bf16 ops
void silu_gate(const uint16_t* h, int64_t rows, int64_t I, uint16_t* act) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 m = tail(I - j);
        const __m512 g = load_bf16(h + r * 2 * I + j, m), u = load_bf16(h + r * 2 * I + I + j, m);
        const __m512 e = mlakit_tiles::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        _mm256_mask_storeu_epi16(act + r * I + j, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
      }
  });
}

// x [n, D] bf16; index [n, k] int64 and weights [n, k] fp32 (the family's routing); gate_up [E,
// ceil(2I/32), D/2, 64] and down [E, ceil(D/32), I/2, 64] packed per expert; the shared experts' MLP
// (gate and up rows stacked) packed the same way, or undefined. Returns shared + sum over a token's
// pairs of weight x expert output, summed in fp32 in the order of the pairs sorted by expert (each
// product rounded to bf16 first, as the unfused path's bf16 GEMMs are)
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, const c10::optional<at::Tensor>& shared_gate_up,
                       const c10::optional<at::Tensor>& shared_down, int64_t I, int64_t Is) {
  check(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x [n, D] bf16 contiguous");
  check(index.dim() == 2 && index.scalar_type() == at::kLong && index.is_contiguous() && index.size(0) == x.size(0),
        "index [n, k] int64 contiguous");
  check(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == index.sizes(),
        "weights [n, k] fp32 contiguous");
  const int64_t n = x.size(0), D = x.size(1), k = index.size(1), E = gate_up.size(0), S = n * k;
  check(D % 2 == 0 && I % 2 == 0 && I > 0, "hidden and intermediate widths must be even");
  check(gate_up.dim() == 4 && gate_up.is_contiguous() && gate_up.size(1) == (2 * I + NB - 1) / NB &&
            gate_up.size(2) == D / 2 && gate_up.scalar_type() == at::kBFloat16,
        "gate_up [E, ceil(2I/32), D/2, 64] bf16");
  check(down.dim() == 4 && down.is_contiguous() && down.size(0) == E && down.size(1) == (D + NB - 1) / NB &&
            down.size(2) == I / 2 && down.scalar_type() == at::kBFloat16,
        "down [E, ceil(D/32), I/2, 64] bf16");
  const bool shared = shared_gate_up.has_value() && shared_gate_up->defined();
  if (shared) {
    check(Is % 2 == 0 && Is > 0 && shared_gate_up->is_contiguous() && shared_gate_up->size(0) == (2 * Is + NB - 1) / NB &&
              shared_gate_up->size(1) == D / 2,
          "shared gate_up [ceil(2Is/32), D/2, 64]");
    check(shared_down.has_value() && shared_down->is_contiguous() && shared_down->size(0) == (D + NB - 1) / NB &&
              shared_down->size(1) == Is / 2,
          "shared down [ceil(D/32), Is/2, 64]");
  }
  const int64_t* idx = index.data_ptr<int64_t>();
  const float* wts = weights.data_ptr<float>();
  // pairs sorted by expert, stable: pos[p] is pair p's place, order[i] the pair at place i
  std::vector<int64_t> count(E + 1, 0), order(S), pos(S);
  for (int64_t p = 0; p < S; ++p) {
    check(idx[p] >= 0 && idx[p] < E, "an expert index is out of range");
    ++count[idx[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < S; ++p) {
      pos[p] = next[idx[p]]++;
      order[pos[p]] = p;
    }
  }
  const auto opts = x.options();
  at::Tensor xs = at::empty({S, D}, opts), h = at::empty({S, 2 * I}, opts), act = at::empty({S, I}, opts);
  at::Tensor yr = at::empty({S, D}, opts);
  at::Tensor hs, acts, ys;
  if (shared) hs = at::empty({n, 2 * Is}, opts), acts = at::empty({n, Is}, opts), ys = at::empty({n, D}, opts);
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const uint16_t* xp = bits(x);
  uint16_t* xsp = bits(xs);
  at::parallel_for(0, S, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) std::memcpy(xsp + i * D, xp + (order[i] / k) * D, D * 2);
  });
  const uint16_t* gu = bits(gate_up);
  const uint16_t* dn = bits(down);
  const int64_t gu_e = gate_up.stride(0), dn_e = down.stride(0);
  std::vector<Product> items;
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e])
      add_blocks(items, xsp + count[e] * D, count[e + 1] - count[e], D, gu + e * gu_e, 2 * I, bits(h) + count[e] * 2 * I);
  if (shared) add_blocks(items, xp, n, D, bits(*shared_gate_up), 2 * Is, bits(hs));
  products(items);
  silu_gate(bits(h), S, I, bits(act));
  if (shared) silu_gate(bits(hs), n, Is, bits(acts));
  items.clear();
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e])
      add_blocks(items, bits(act) + count[e] * I, count[e + 1] - count[e], I, dn + e * dn_e, D, bits(yr) + count[e] * D);
  if (shared) add_blocks(items, bits(acts), n, Is, bits(*shared_down), D, bits(ys));
  products(items);
  at::Tensor out = at::empty({n, D}, opts);
  uint16_t* op = bits(out);
  const uint16_t* yrp = bits(yr);
  const uint16_t* ysp = shared ? bits(ys) : nullptr;
  at::parallel_for(0, n, 4, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> at(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) at[j] = pos[t * k + j];
      std::sort(at.begin(), at.end());
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = tail(D - d);
        __m512 a = ysp ? load_bf16(ysp + t * D + d, m) : _mm512_setzero_ps();
        for (int64_t i : at)  // each product exact in fp32, then one add: index_add_'s arithmetic
          a = _mm512_add_ps(a, _mm512_mul_ps(load_bf16(yrp + i * D + d, m), _mm512_set1_ps(wts[order[i]])));
        _mm256_mask_storeu_epi16(op + t * D + d, m, (__m256i)_mm512_cvtneps_pbh(a));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlakit_cpu, m) {
  m.def("vnni_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.impl("vnni_linear", c10::DispatchKey::CPU, TORCH_FN(vnni_linear));
  m.def("vnni_heads(Tensor x, Tensor packed, int N) -> Tensor");
  m.def(
      "moe_experts(Tensor x, Tensor index, Tensor weights, Tensor gate_up, Tensor down, Tensor? shared_gate_up, "
      "Tensor? shared_down, int I, int Is) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, TORCH_FN(moe_experts));
  m.impl("vnni_heads", c10::DispatchKey::CPU, TORCH_FN(vnni_heads));
}
