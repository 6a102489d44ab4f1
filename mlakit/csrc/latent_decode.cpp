// Absorbed MLA decode core for CPUs with AVX512-BF16: bf16 products, fp32 scores, softmax and sums.
//
// One call attends every query row (S new tokens x H heads) of each sequence against that
// sequence's cached [c_kv | k_pe] rows, read in place (a strided tensor, or a pool of rows and a
// [B, T] table of row ids: the pages of a paged cache). All heads share the key rows (MLA is an
// MQA), so each block of keys is read once for all of them:
//   scores^T [t, r] = K[t, :] . Q[r, :]   queries packed once in pairs (VNNI), keys broadcast in place
//   online softmax over t in fp32 (running max, denominators), probabilities rounded to bf16
//   O^T [l, r]    += V[t, l] P[t, r]      two key rows interleaved per pair, accumulators in fp32
// The key range of a sequence is cut into `splits` parts (parallel work at small batch), each part
// returns (O, lse) and the parts are merged by log-sum-exp. The query rows are cut into groups of at
// most RG (a prefill chunk over a cached prefix has new tokens x heads of them: one slab of all would
// keep megabytes of accumulators out of cache). Two parallel regions per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "bf16_tiles.h"
#include "prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

using namespace mlakit_tiles;

constexpr int KB = 128;  // keys per block of the online softmax (a multiple of the 8-key tile)
// query rows per work item at most, a multiple of the 32-row score tile: 128 x 128 heads of
// DeepSeek-V3 over 1,152 keys (one thread, Zen 4) took 1,008 ms as one slab, 218-242 ms in groups of
// 128-256 rows; 128 x 16 heads 36 -> 27 ms
constexpr int RG = 256;

struct Problem {
  const uint16_t* ckv;  // c_kv rows (bf16 bits), row r of sequence b: see row()
  const uint16_t* kpe;
  int64_t ckv_b, ckv_t, kpe_b, kpe_t;  // strides in elements (batch, token); rows==nullptr
  const int64_t* rows;                 // [B, T] row ids into a pool, or nullptr
  int64_t rows_b;                      // stride of rows over the batch
  int64_t T;                           // keys addressable per sequence
  const int64_t* kv_lens;
  int64_t key_start;  // absolute position of key 0 of this call
  int S, H, L, R, NR, KP;
  int G, GR;  // groups of query rows per sequence, rows per group (a multiple of 16; the last padded)
  float scale;
  const uint32_t* qpack;  // [B][G][KP][GR] pairs: a group's slab is contiguous, padding rows zero
};

inline int64_t row_of(const Problem& p, int64_t b, int64_t t) {
  return p.rows ? p.rows[b * p.rows_b + t] : -1;
}

inline const uint16_t* ckv_row(const Problem& p, int64_t b, int64_t t) {
  const int64_t r = row_of(p, b, t);
  return r >= 0 ? p.ckv + r * p.ckv_t : p.ckv + b * p.ckv_b + t * p.ckv_t;
}

inline const uint16_t* kpe_row(const Problem& p, int64_t b, int64_t t) {
  const int64_t r = row_of(p, b, t);
  return r >= 0 ? p.kpe + r * p.kpe_t : p.kpe + b * p.kpe_b + t * p.kpe_t;
}

// the keys (relative to this call) row r of sequence b may see: [0, limit)
inline int64_t limit_of(const Problem& p, int64_t b, int r) {
  const int s = r / p.H;
  const int64_t lim = p.kv_lens[b] - p.S + s + 1 - p.key_start;
  return std::max<int64_t>(0, std::min<int64_t>(lim, p.T));
}

// one work item's state: rows [r0, r0 + nr) of a sequence, nrp = nr rounded up to 16
struct Scratch {
  std::vector<float> st, ot, m, d, dr, alpha;
  std::vector<uint32_t> pt, vp;
  std::vector<int64_t> lim;
  void fit(int nrp, int L) {
    st.resize((size_t)KB * nrp);
    pt.resize((size_t)(KB / 2) * nrp);
    vp.resize((size_t)(KB / 2) * L);
    ot.resize((size_t)L * nrp);
    m.resize(nrp);
    d.resize(nrp);
    dr.resize(nrp);
    alpha.resize(nrp);
    lim.resize(nrp);
  }
};

// keys read this far ahead of the score tiles are asked of memory into L2: at a decode step a paged
// cache's rows come from memory, and hardware prefetchers stop at each 4 KiB page (every 3.6 rows of
// DeepSeek-V3's 1,152 bytes). 8 layers of 32 sequences x 150 keys, caches evicted, Zen 4: two threads
// 8.05 -> 7.03 ms, one thread 13.2 -> 11.3 ms
constexpr int AHEAD = 32;

// keys [t0, t1) of sequence b into L2 (csrc/prefetch.h: as instructions the compiler keeps)
inline void prefetch_keys(const Problem& p, int64_t b, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    mlakit_prefetch::span_l2(ckv_row(p, b, t), p.L * 2);
    mlakit_prefetch::span_l2(kpe_row(p, b, t), p.R * 2);
  }
}

// scores of one block of keys [k0, k0 + n) against the item's rows (packed at qp, ld GR), masked,
// into s.st [KB][nrp]; the keys AHEAD on (up to kend, the item's last) asked for meanwhile
void block_scores(const Problem& p, Scratch& s, int64_t b, int64_t k0, int n, const uint32_t* qp, int nr,
                  int nrp, int64_t kend) {
  const int nn = (n + 7) / 8 * 8;
  const uint32_t* kc[8];
  const uint32_t* kr[8];
  for (int t0 = 0; t0 < nn; t0 += 8) {
    prefetch_keys(p, b, k0 + t0 + AHEAD, std::min<int64_t>(k0 + t0 + AHEAD + 8, kend));
    for (int m = 0; m < 8; ++m) {
      const int64_t t = k0 + std::min(t0 + m, n - 1);  // padding keys repeat the last one (masked below)
      kc[m] = reinterpret_cast<const uint32_t*>(ckv_row(p, b, t));
      kr[m] = reinterpret_cast<const uint32_t*>(kpe_row(p, b, t));
    }
    int r0 = 0;
    for (; r0 + 32 <= nrp; r0 += 32)
      score_tile<2>(kc, kr, p.L / 2, p.R / 2, qp + r0, p.GR, s.st.data() + t0 * nrp + r0, nrp, p.scale);
    if (r0 < nrp)
      score_tile<1>(kc, kr, p.L / 2, p.R / 2, qp + r0, p.GR, s.st.data() + t0 * nrp + r0, nrp, p.scale);
  }
  int64_t lo = p.T, hi = 0;
  for (int r = 0; r < nr; ++r) {
    lo = std::min(lo, s.lim[r]);
    hi = std::max(hi, s.lim[r]);
  }
  for (int t = 0; t < nn; ++t) {
    const int64_t key = k0 + t;
    float* row = s.st.data() + t * nrp;
    if (t >= n || key >= hi) {
      std::fill(row, row + nrp, NEG_INF);
    } else if (key >= lo) {
      for (int r = 0; r < nr; ++r)
        if (key >= s.lim[r]) row[r] = NEG_INF;
    }
  }
}

// the block's c_kv rows interleaved in pairs: vp[tp][l] = (V[2tp][l], V[2tp+1][l])
void block_values(const Problem& p, Scratch& s, int64_t b, int64_t k0, int n, int nn) {
  pair_rows([&](int t) { return ckv_row(p, b, k0 + t); }, n, nn, p.L, s.vp.data());
}

// rows [r0, r0 + nr) of sequence b, keys [k0, k1): o [nr, L] (normalized) and lse [nr]
void attend_part(const Problem& p, int64_t b, int64_t k0, int64_t k1, int r0, int nr, float* o, float* lse) {
  thread_local Scratch s;
  const int nrp = (nr + 15) / 16 * 16;
  s.fit(nrp, p.L);
  for (int r = 0; r < nrp; ++r) s.lim[r] = r < nr ? std::min(limit_of(p, b, r0 + r), k1) : 0;
  std::fill(s.m.begin(), s.m.begin() + nrp, NEG_INF);
  std::fill(s.d.begin(), s.d.begin() + nrp, 0.0f);
  std::fill(s.dr.begin(), s.dr.begin() + nrp, 0.0f);
  std::fill(s.ot.begin(), s.ot.begin() + (size_t)nrp * p.L, 0.0f);
  int64_t hi = 0;
  for (int r = 0; r < nr; ++r) hi = std::max(hi, s.lim[r]);
  const uint32_t* qp = p.qpack + ((size_t)b * p.G + r0 / p.GR) * p.KP * p.GR;
  const int64_t kend = std::min(k1, hi);
  prefetch_keys(p, b, k0, std::min<int64_t>(k0 + AHEAD, kend));
  for (int64_t kb = k0; kb < kend; kb += KB) {
    const int n = (int)std::min<int64_t>(KB, kend - kb);
    const int nn = (n + 7) / 8 * 8;
    block_scores(p, s, b, kb, n, qp, nr, nrp, kend);
    // online softmax over the block's nn keys: running max, both denominators, bf16 pairs in s.pt
    softmax_block(s.st.data(), nrp, nrp, nn, s.m.data(), s.d.data(), s.dr.data(), s.alpha.data(), s.pt.data());
    block_values(p, s, b, kb, n, nn);
    mix_block(s.vp.data(), p.L, nn, s.pt.data(), nrp, nrp, s.ot.data(), s.alpha.data());
  }
  for (int r = 0; r < nr; ++r) {
    const bool none = !(s.d[r] > 0.0f);
    lse[r] = none ? NEG_INF : s.m[r] + std::log(s.d[r]);
    s.alpha[r] = none ? 0.0f : 1.0f / s.dr[r];  // alpha's last use was the last block: the row scales
  }
  untranspose(s.ot.data(), nrp, nr, p.L, s.alpha.data(),
              [&](int r, int l0, __m512 x) { _mm512_storeu_ps(o + (int64_t)r * p.L + l0, x); });
}

// a buffer of n entries, not zeroed: a thread keeps one of up to KEEP_QUERIES entries for its next
// call (a decode step's: 32 rows x 16 heads of the demo model are 590 KB, allocated and zeroed at
// every layer before, on the calling thread alone), a larger one lives in `own` for this call
constexpr size_t KEEP_QUERIES = (size_t)1 << 20;

uint32_t* query_buffer(size_t n, std::unique_ptr<uint32_t[]>& own) {
  thread_local std::unique_ptr<uint32_t[]> kept;
  thread_local size_t capacity = 0;
  if (n > KEEP_QUERIES) {
    own.reset(new uint32_t[n]);
    return own.get();
  }
  if (capacity < n) {
    kept.reset(new uint32_t[n]);
    capacity = n;
  }
  return kept.get();
}

// q_lat [B, NR, L], q_pe [B, NR, R] (bf16) -> [B][G][KP][GR] pairs, padding rows zero
void pack_queries(const at::Tensor& q_lat, const at::Tensor& q_pe, Problem& p, std::unique_ptr<uint32_t[]>& own) {
  const int64_t B = q_lat.size(0);
  // every entry read is written below (padding rows zero)
  uint32_t* const buf = query_buffer((size_t)B * p.G * p.KP * p.GR, own);
  const auto* ql = reinterpret_cast<const uint32_t*>(q_lat.data_ptr<at::BFloat16>());
  const auto* qr = reinterpret_cast<const uint32_t*>(q_pe.data_ptr<at::BFloat16>());
  const int kpl = p.L / 2, kpr = p.R / 2;
  at::parallel_for(0, B * p.G, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / p.G;
      const int r0 = (int)(i % p.G) * p.GR, nr = std::min(p.GR, p.NR - r0), nrp = (nr + 15) / 16 * 16;
      uint32_t* out = buf + (size_t)i * p.KP * p.GR;
      const size_t first = (size_t)b * p.NR + r0;
      transpose_pairs([&](int r) { return ql + (first + r) * kpl; }, nr, nrp, kpl, out, p.GR);
      transpose_pairs([&](int r) { return qr + (first + r) * kpr; }, nr, nrp, kpr, out + (size_t)kpl * p.GR, p.GR);
    }
  });
  p.qpack = buf;
}

void merge_parts(const Problem& p, int64_t B, int64_t splits, const float* po, const float* pl, float* o,
                 float* lse) {
  at::parallel_for(0, B * p.NR, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / p.NR, r = i % p.NR;
      float top = NEG_INF;
      for (int64_t k = 0; k < splits; ++k) top = std::max(top, pl[(b * splits + k) * p.NR + r]);
      float* out = o + i * p.L;
      std::fill(out, out + p.L, 0.0f);
      if (top == NEG_INF) {
        lse[i] = NEG_INF;
        continue;
      }
      float total = 0.0f;
      for (int64_t k = 0; k < splits; ++k) total += std::exp(pl[(b * splits + k) * p.NR + r] - top);
      for (int64_t k = 0; k < splits; ++k) {
        const float w = std::exp(pl[(b * splits + k) * p.NR + r] - top) / total;
        if (w == 0.0f) continue;
        const float* part = po + ((b * splits + k) * p.NR + r) * p.L;
        for (int l = 0; l < p.L; ++l) out[l] += w * part[l];
      }
      lse[i] = top + std::log(total);
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "latent_decode: ", what); }

std::tuple<at::Tensor, at::Tensor> latent_decode(const at::Tensor& q_lat, const at::Tensor& q_pe,
                                                 const at::Tensor& c_kv, const at::Tensor& k_pe,
                                                 const c10::optional<at::Tensor>& rows, const at::Tensor& kv_lens,
                                                 int64_t new_tokens, int64_t key_start, double scale,
                                                 int64_t splits) {
  check(q_lat.dim() == 3 && q_pe.dim() == 3 && q_lat.is_contiguous() && q_pe.is_contiguous(),
        "q_lat [B, S*H, L] and q_pe [B, S*H, R] must be contiguous");
  check(q_lat.scalar_type() == at::kBFloat16 && q_pe.scalar_type() == at::kBFloat16, "queries must be bf16");
  check(c_kv.scalar_type() == at::kBFloat16 && k_pe.scalar_type() == at::kBFloat16, "cache must be bf16");
  check(c_kv.stride(-1) == 1 && k_pe.stride(-1) == 1, "cache rows must be contiguous");
  check(kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous(), "kv_lens must be contiguous int64");
  Problem p{};
  const int64_t B = q_lat.size(0);
  p.NR = (int)q_lat.size(1);
  p.L = (int)q_lat.size(2);
  p.R = (int)q_pe.size(2);
  p.S = (int)new_tokens;
  check(p.S > 0 && p.NR % p.S == 0, "rows must be new_tokens x heads");
  p.H = p.NR / p.S;
  check(p.L % 32 == 0 && p.R % 2 == 0 && p.R > 0, "latent width must be a multiple of 32, rope width even");
  p.GR = std::min(RG, (p.NR + 15) / 16 * 16);
  p.G = (p.NR + p.GR - 1) / p.GR;
  p.KP = p.L / 2 + p.R / 2;
  p.scale = (float)scale;
  p.kv_lens = kv_lens.data_ptr<int64_t>();
  p.key_start = key_start;
  p.ckv = reinterpret_cast<const uint16_t*>(c_kv.data_ptr<at::BFloat16>());
  p.kpe = reinterpret_cast<const uint16_t*>(k_pe.data_ptr<at::BFloat16>());
  if (rows.has_value() && rows->defined()) {
    check(rows->dim() == 2 && rows->scalar_type() == at::kLong && rows->stride(1) == 1, "rows [B, T] int64");
    check(c_kv.dim() == 2 && k_pe.dim() == 2, "with rows, c_kv and k_pe are pools [N, width]");
    p.rows = rows->data_ptr<int64_t>();
    p.rows_b = rows->stride(0);
    p.T = rows->size(1);
    p.ckv_t = c_kv.stride(0);
    p.kpe_t = k_pe.stride(0);
  } else {
    check(c_kv.dim() == 3 && k_pe.dim() == 3, "c_kv [B, T, L] and k_pe [B, T, R]");
    p.T = c_kv.size(1);
    p.ckv_b = c_kv.stride(0);
    p.ckv_t = c_kv.stride(1);
    p.kpe_b = k_pe.stride(0);
    p.kpe_t = k_pe.stride(1);
  }
  check(c_kv.size(-1) == p.L && k_pe.size(-1) == p.R && kv_lens.size(0) == B, "widths or batch differ");
  std::unique_ptr<uint32_t[]> qbuf;
  pack_queries(q_lat, q_pe, p, qbuf);
  const auto f32 = q_lat.options().dtype(at::kFloat);
  at::Tensor o = at::empty({B, p.NR, p.L}, f32), lse = at::empty({B, p.NR}, f32);
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, (p.T + KB - 1) / KB));
  const int64_t span = ((p.T + splits - 1) / splits + KB - 1) / KB * KB;
  at::Tensor po = splits == 1 ? o : at::empty({B * splits, p.NR, p.L}, f32);
  at::Tensor pl = splits == 1 ? lse : at::empty({B * splits, p.NR}, f32);
  float* po_ = po.data_ptr<float>();
  float* pl_ = pl.data_ptr<float>();
  at::parallel_for(0, B * splits * p.G, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t part = i / p.G, g = i % p.G;
      const int64_t b = part / splits, k0 = (part % splits) * span, k1 = std::min(p.T, k0 + span);
      const int r0 = (int)(g * p.GR), nr = std::min(p.GR, p.NR - r0);
      attend_part(p, b, std::min(k0, k1), k1, r0, nr, po_ + (part * p.NR + r0) * p.L, pl_ + part * p.NR + r0);
    }
  });
  if (splits > 1) merge_parts(p, B, splits, po_, pl_, o.data_ptr<float>(), lse.data_ptr<float>());
  return {o, lse};
}

// y [M, N] = x [M, K] . w [N, K]^T for a few rows M: each weight row read once, M x NB dot products
// at a time in fp32 (a decode step's projections are a read of their weights)
template <int MB, int NB>
void small_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, int64_t n0,
                int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; n += NB) {
    const int nb = (int)std::min<int64_t>(NB, n1 - n);
    __m512 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 live = K - k >= 32 ? ~0u : ((1u << (K - k)) - 1);
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm512_maskz_loadu_epi16(live, w + (n + std::min(j, nb - 1)) * ldw + k);
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_maskz_loadu_epi16(live, x + m * ldx + k);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)xv, (__m512bh)wv[j]);
      }
    }
    float sums[MB][NB];  // every accumulator reduced (a loop to nb would keep them in memory)
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) sums[m][j] = _mm512_reduce_add_ps(acc[m][j]);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < nb; ++j) y[m * ldy + n + j] = sums[m][j];
  }
}

template <int MB, int NB>
void small_rows_all(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K, int64_t N,
                    float* y, int64_t ldy) {
  // grains of 64 output columns: a few hundred KB of weights per task
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t g0, int64_t g1) {
    small_rows<MB, NB>(x, ldx, w, ldw, K, g0 * 64, std::min(N, g1 * 64), y, ldy);
  });
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w) {
  check(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
  check(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "x and w must be bf16");
  check(x.stride(1) == 1 && w.stride(1) == 1, "rows must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  check(M <= 16, "at most 16 rows");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mb = std::min<int64_t>(8, M - m0);
    const uint16_t* xm = xp + m0 * x.stride(0);
    float* ym = yp + m0 * N;
    switch (mb) {
      case 1: small_rows_all<1, 8>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      case 2: small_rows_all<2, 6>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      case 3: small_rows_all<3, 4>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      case 4: small_rows_all<4, 4>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      case 5: small_rows_all<5, 3>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      case 6: small_rows_all<6, 3>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      case 7: small_rows_all<7, 2>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
      default: small_rows_all<8, 2>(xm, x.stride(0), wp, w.stride(0), K, N, ym, N); break;
    }
  }
  return y.to(at::kBFloat16);
}


// NV x 16 columns of one query row of one head: sum over d of q[d] * w[d, l0 .. l0 + 16 NV) in fp32
template <int NV>
inline void fold_cols(const uint16_t* q, const uint16_t* w, int64_t ldw, int64_t dn, uint16_t* dst) {
  __m512 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dn; ++d) {
    const uint32_t bits = (uint32_t)q[d] << 16;
    float qd;
    std::memcpy(&qd, &bits, 4);
    const __m512 b = _mm512_set1_ps(qd);
    const uint16_t* row = w + d * ldw;
    for (int j = 0; j < NV; ++j) {
      const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 16 * j)));
      acc[j] = _mm512_fmadd_ps(b, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_si256((__m256i*)(dst + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[j]));
}

// q_lat [M, H, L] = q [M, H, dn] . w_uk [H, dn, L] per head, fp32 sums, rounded to bf16: each weight
// row read once for every query row (a bmm over a strided weight view copies the weight first)
at::Tensor fold_heads(const at::Tensor& q, const at::Tensor& w) {
  check(q.dim() == 3 && w.dim() == 3 && q.size(1) == w.size(0) && q.size(2) == w.size(1), "q [M,H,dn], w [H,dn,L]");
  check(q.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "q and w must be bf16");
  check(q.stride(2) == 1 && w.stride(2) == 1 && w.size(2) % 16 == 0, "rows contiguous, L a multiple of 16");
  const int64_t M = q.size(0), H = q.size(1), dn = q.size(2), L = w.size(2);
  check(M <= 16, "at most 16 rows");
  at::Tensor out = at::empty({M, H, L}, q.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* qm = qp + m * q.stride(0) + h * q.stride(1);
        const uint16_t* wh = wp + h * w.stride(0);
        uint16_t* dst = op + (m * H + h) * L;
        int64_t l0 = 0;
        for (; l0 + 256 <= L; l0 += 256) fold_cols<16>(qm, wh + l0, w.stride(1), dn, dst + l0);
        for (; l0 < L; l0 += 16) fold_cols<1>(qm, wh + l0, w.stride(1), dn, dst + l0);
      }
  });
  return out;
}

// out [M, H, dv] = o [M, H, L] . w_uv[h]^T per head (w_uv [H, dv, L]): dot products along L
at::Tensor unfold_heads(const at::Tensor& o, const at::Tensor& w) {
  check(o.dim() == 3 && w.dim() == 3 && o.size(1) == w.size(0) && o.size(2) == w.size(2), "o [M,H,L], w [H,dv,L]");
  check(o.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "o and w must be bf16");
  check(o.stride(2) == 1 && w.stride(2) == 1, "rows must be contiguous");
  const int64_t M = o.size(0), H = o.size(1), L = o.size(2), dv = w.size(1);
  check(M <= 8, "at most 8 rows");
  at::Tensor y = at::empty({M, H, dv}, o.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(o.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const uint16_t* x = xp + h * o.stride(1);
      const uint16_t* wh = wp + h * w.stride(0);
      float* yh = yp + h * dv;
      switch (M) {
        case 1: small_rows<1, 8>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        case 2: small_rows<2, 6>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        case 3: small_rows<3, 4>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        case 4: small_rows<4, 4>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        case 5: small_rows<5, 3>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        case 6: small_rows<6, 3>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        case 7: small_rows<7, 2>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
        default: small_rows<8, 2>(x, o.stride(0), wh, w.stride(1), L, 0, dv, yh, H * dv); break;
      }
    }
  });
  return y.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY(mlakit_cpu, m) {
  m.def(
      "latent_decode(Tensor q_lat, Tensor q_pe, Tensor c_kv, Tensor k_pe, Tensor? rows, Tensor kv_lens, "
      "int new_tokens, int key_start, float scale, int splits) -> (Tensor, Tensor)");
  m.impl("latent_decode", c10::DispatchKey::CPU, TORCH_FN(latent_decode));
  m.def("small_linear(Tensor x, Tensor w) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(small_linear));
  m.def("fold_heads(Tensor q, Tensor w) -> Tensor");
  m.impl("fold_heads", c10::DispatchKey::CPU, TORCH_FN(fold_heads));
  m.def("unfold_heads(Tensor o, Tensor w) -> Tensor");
  m.impl("unfold_heads", c10::DispatchKey::CPU, TORCH_FN(unfold_heads));
}
