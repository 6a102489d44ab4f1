// Absorbed MLA decode core for x86 CPUs with AVX2 and FMA, in fp32 (queries, cache, scores, sums).
//
// The fp32 twin of latent_decode.cpp (the AVX512-BF16 core), for CPUs without native bf16, where
// mlakit keeps fp32 caches. One call attends every query row (S new tokens x H heads) of each sequence
// against that sequence's cached [c_kv | k_pe] rows, read in place (a strided tensor, or a pool of
// rows and a [B, T] table of row ids: the pages of a paged cache). All heads share the key rows (MLA
// is an MQA), so each key row is read once per block for all query rows:
//   scores^T [t, r] = K[t, :] . Q[r, :]   queries packed once, transposed; key values broadcast in place
//   online softmax over t in fp32 (running max and denominator per row)
//   O [r, l]       += P[t, r] V[t, l]     probabilities broadcast, value rows read in place
// Work items are (sequence, part of its key range, group of query rows); the parts of a sequence are
// merged by log-sum-exp. Two parallel regions per call.
//
// argmax_rows: torch.argmax(x, -1) of fp32 logits (the sampler's greedy rows on these CPUs), the same
// answer (the first index of the row's largest value; a NaN counts as the largest, the first NaN wins),
// one row per work item: ATen's fp32 argmax took 3.4 ms for 32 rows of 129,280 on one core of an AMD
// EPYC Zen 4 (csrc/rows.cpp has the AVX-512 twin, for fp32 and bf16).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int KB = 96;   // keys per block of the online softmax: a multiple of both key tiles (6 and 8)
constexpr int RG = 64;  // query rows per work item at most (a prefill chunk's rows are cut in groups)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline __m256 exp256(__m256 x) {
  // exp to ~2 ulp: 2^n * p(r), r = x - n ln2; exactly 0 below -87 (and for -inf)
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n built in the exponent bits: n in [-126, 127] after the clamp above
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), live);
}

// acc[m][v] += sum over k < kn of x[m][k] * y[k][8v .. 8v + 8): MT broadcast rows (key rows in place,
// or probabilities) against NV vectors of a packed operand with leading dimension ldy
template <int MT, int NV>
inline void tile_sum(const float* const* x, int64_t kn, const float* y, int64_t ldy, __m256 (&acc)[MT][NV]) {
  for (int64_t k = 0; k < kn; ++k) {
    __m256 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm256_loadu_ps(y + k * ldy + 8 * v);
    for (int m = 0; m < MT; ++m) {
      const __m256 a = _mm256_broadcast_ss(x[m] + k);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(a, b[v], acc[m][v]);
    }
  }
}

struct Problem {
  const float* ckv;  // c_kv rows, row t of sequence b: see ckv_row()
  const float* kpe;
  int64_t ckv_b, ckv_t, kpe_b, kpe_t;  // strides in elements (batch, token); rows == nullptr
  const int64_t* rows;                 // [B, T] row ids into a pool, or nullptr
  int64_t rows_b;                      // stride of rows over the batch
  int64_t T;                           // keys addressable per sequence
  const int64_t* kv_lens;
  int64_t key_start;  // absolute position of key 0 of this call
  int S, H, L, R, NR, KP;
  int G, GR;  // groups of query rows per sequence, rows per group (a multiple of 16; the last padded)
  float scale;
  const float* qpack;  // [B][G][KP][GR]: q_lat then q_pe columns, transposed, padding rows zero
};

inline const float* ckv_row(const Problem& p, int64_t b, int64_t t) {
  return p.rows ? p.ckv + p.rows[b * p.rows_b + t] * p.ckv_t : p.ckv + b * p.ckv_b + t * p.ckv_t;
}

inline const float* kpe_row(const Problem& p, int64_t b, int64_t t) {
  return p.rows ? p.kpe + p.rows[b * p.rows_b + t] * p.kpe_t : p.kpe + b * p.kpe_b + t * p.kpe_t;
}

// the keys (relative to this call) row r of sequence b may see: [0, limit)
inline int64_t limit_of(const Problem& p, int64_t b, int r) {
  const int64_t lim = p.kv_lens[b] - p.S + r / p.H + 1 - p.key_start;
  return std::max<int64_t>(0, std::min<int64_t>(lim, p.T));
}

// one work item's state: rows [r0, r0 + nr) of a sequence, nrp = nr rounded up to 16
struct Scratch {
  std::vector<float> st, ot, m, d, alpha;
  std::vector<int64_t> lim;
  void fit(int nrp, int L) {
    st.resize((size_t)KB * nrp);
    ot.resize((size_t)nrp * L);
    m.resize(nrp);
    d.resize(nrp);
    alpha.resize(nrp);
    lim.resize(nrp);
  }
};

// scores^T of MT keys (k0 + t0 ..) against the item's rows, scaled, into st [KB][nrp]
template <int MT>
void key_tile(const Problem& p, Scratch& s, int64_t b, int64_t k0, int t0, int n, const float* qp, int nrp) {
  const float* kc[MT];
  const float* kr[MT];
  for (int m = 0; m < MT; ++m) {
    const int64_t t = k0 + std::min(t0 + m, n - 1);  // padding keys repeat the last one (masked later)
    kc[m] = ckv_row(p, b, t);
    kr[m] = kpe_row(p, b, t);
  }
  const __m256 sc = _mm256_set1_ps(p.scale);
  int c = 0;
  for (; c + 16 <= nrp; c += 16) {
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    tile_sum<MT, 2>(kc, p.L, qp + c, p.GR, acc);
    tile_sum<MT, 2>(kr, p.R, qp + (int64_t)p.L * p.GR + c, p.GR, acc);
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(s.st.data() + (t0 + m) * nrp + c + 8 * v, _mm256_mul_ps(acc[m][v], sc));
  }
}

// keys read this far ahead of the score tiles are asked of memory into L2 (as the bf16 core's
// prefetch_keys: hardware prefetchers stop at each 4 KiB page, two fp32 rows of DeepSeek-V3's latent)
constexpr int AHEAD = 24;

// keys [t0, t1) of sequence b into L2
inline void prefetch_keys(const Problem& p, int64_t b, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    mlakit_prefetch::span_l2(ckv_row(p, b, t), p.L * 4);
    mlakit_prefetch::span_l2(kpe_row(p, b, t), p.R * 4);
  }
}

// scores of keys [k0, k0 + n) into s.st, masked; the keys AHEAD on (up to kend, the item's last)
// asked for meanwhile
void block_scores(const Problem& p, Scratch& s, int64_t b, int64_t k0, int n, const float* qp, int nr, int nrp,
                  int64_t kend) {
  const int nn = (n + 7) / 8 * 8;
  int t0 = 0;
  for (; t0 + 6 <= nn; t0 += 6) {
    prefetch_keys(p, b, k0 + t0 + AHEAD, std::min<int64_t>(k0 + t0 + AHEAD + 6, kend));
    key_tile<6>(p, s, b, k0, t0, n, qp, nrp);
  }
  for (; t0 < nn; t0 += 2) key_tile<2>(p, s, b, k0, t0, n, qp, nrp);
  int64_t lo = p.T, hi = 0;
  for (int r = 0; r < nr; ++r) {
    lo = std::min(lo, s.lim[r]);
    hi = std::max(hi, s.lim[r]);
  }
  if (nr < nrp) lo = 0;
  for (int t = 0; t < nn; ++t) {
    const int64_t key = k0 + t;
    float* row = s.st.data() + (size_t)t * nrp;
    if (t >= n || key >= hi) {
      std::fill(row, row + nrp, NEG_INF);
    } else if (key >= lo) {
      for (int r = 0; r < nrp; ++r)  // padding rows see no key (lim 0)
        if (key >= s.lim[r]) row[r] = NEG_INF;
    }
  }
}

// online softmax over the block's nn keys: running max and denominator; st becomes the probabilities
void block_softmax(Scratch& s, int nn, int nrp) {
  for (int r = 0; r < nrp; r += 8) {
    __m256 bm = _mm256_set1_ps(NEG_INF);
    for (int t = 0; t < nn; ++t) bm = _mm256_max_ps(bm, _mm256_loadu_ps(s.st.data() + (size_t)t * nrp + r));
    const __m256 m_old = _mm256_loadu_ps(s.m.data() + r);
    const __m256 m_new = _mm256_max_ps(m_old, bm);
    const __m256 dead = _mm256_cmp_ps(m_new, _mm256_set1_ps(NEG_INF), _CMP_EQ_OQ);
    const __m256 safe = _mm256_andnot_ps(dead, m_new);  // 0 where no key is seen yet
    const __m256 alpha = _mm256_blendv_ps(exp256(_mm256_sub_ps(m_old, safe)), _mm256_set1_ps(1.0f), dead);
    __m256 sum = _mm256_setzero_ps();
    for (int t = 0; t < nn; ++t) {
      float* at = s.st.data() + (size_t)t * nrp + r;
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(at), safe));
      _mm256_storeu_ps(at, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(s.m.data() + r, m_new);
    _mm256_storeu_ps(s.alpha.data() + r, alpha);
    _mm256_storeu_ps(s.d.data() + r, _mm256_fmadd_ps(_mm256_loadu_ps(s.d.data() + r), alpha, sum));
  }
}

// O [MT rows][NV*8 latent columns from l0] = alpha * O + P^T V over the block's nn keys
template <int MT, int NV>
inline void value_tile(const Problem& p, Scratch& s, const float* const* vrow, int nn, int r0, int l0, int nrp) {
  __m256 acc[MT][NV];
  for (int m = 0; m < MT; ++m) {
    const __m256 a = _mm256_broadcast_ss(s.alpha.data() + r0 + m);
    for (int v = 0; v < NV; ++v)
      acc[m][v] = _mm256_mul_ps(_mm256_loadu_ps(s.ot.data() + (size_t)(r0 + m) * p.L + l0 + 8 * v), a);
  }
  for (int t = 0; t < nn; ++t) {
    __m256 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm256_loadu_ps(vrow[t] + l0 + 8 * v);
    const float* pt = s.st.data() + (size_t)t * nrp + r0;
    for (int m = 0; m < MT; ++m) {
      const __m256 a = _mm256_broadcast_ss(pt + m);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(a, b[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(s.ot.data() + (size_t)(r0 + m) * p.L + l0 + 8 * v, acc[m][v]);
}

void block_mix(const Problem& p, Scratch& s, int64_t b, int64_t k0, int n, int nn, int nrp) {
  const float* vrow[KB];
  for (int t = 0; t < nn; ++t) vrow[t] = ckv_row(p, b, k0 + std::min(t, n - 1));  // padding: P is 0 there
  // columns outside, rows inside: the block's slab of value columns stays in L1 for every row tile
  int l0 = 0;
  for (; l0 + 16 <= p.L; l0 += 16)
    for (int r0 = 0; r0 < nrp; r0 += 4) value_tile<4, 2>(p, s, vrow, nn, r0, l0, nrp);
  if (l0 < p.L)
    for (int r0 = 0; r0 < nrp; r0 += 4) value_tile<4, 1>(p, s, vrow, nn, r0, l0, nrp);
}

// rows [r0, r0 + nr) of sequence b over keys [k0, k1): o [nr, L] (normalized) and lse [nr], row strides
// of the caller's output
// this thread's scratch, behind a call: inlined, a thread_local is re-addressed (a __tls_get_addr call
// under -fPIC) inside the inner loops, which spills every accumulator
__attribute__((noinline)) Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

void attend_part(const Problem& p, int64_t b, int64_t k0, int64_t k1, int r0, int nr, float* o, float* lse) {
  Scratch& s = scratch();
  const int nrp = (nr + 15) / 16 * 16;
  s.fit(nrp, p.L);
  for (int r = 0; r < nrp; ++r) s.lim[r] = r < nr ? std::min(limit_of(p, b, r0 + r), k1) : 0;
  std::fill(s.m.begin(), s.m.begin() + nrp, NEG_INF);
  std::fill(s.d.begin(), s.d.begin() + nrp, 0.0f);
  std::fill(s.ot.begin(), s.ot.begin() + (size_t)nrp * p.L, 0.0f);
  int64_t hi = 0;
  for (int r = 0; r < nr; ++r) hi = std::max(hi, s.lim[r]);
  const float* qp = p.qpack + ((size_t)b * p.G + r0 / p.GR) * p.KP * p.GR;
  const int64_t kend = std::min(k1, hi);
  prefetch_keys(p, b, k0, std::min<int64_t>(k0 + AHEAD, kend));
  for (int64_t kb = k0; kb < kend; kb += KB) {
    const int n = (int)std::min<int64_t>(KB, kend - kb);
    const int nn = (n + 7) / 8 * 8;
    block_scores(p, s, b, kb, n, qp, nr, nrp, kend);
    block_softmax(s, nn, nrp);
    block_mix(p, s, b, kb, n, nn, nrp);
  }
  for (int r = 0; r < nr; ++r) {
    const bool none = !(s.d[r] > 0.0f);
    lse[r] = none ? NEG_INF : s.m[r] + std::log(s.d[r]);
    const float inv = none ? 0.0f : 1.0f / s.d[r];
    const float* src = s.ot.data() + (size_t)r * p.L;
    float* dst = o + (int64_t)r * p.L;
    for (int l = 0; l < p.L; ++l) dst[l] = src[l] * inv;
  }
}

// q_lat [B, NR, L], q_pe [B, NR, R] -> [B][G][KP][GR], padding rows zero: a group's slab is contiguous
// (one [KP][NR] slab would put the rows of a long prefill chunk pages apart)
void pack_queries(const at::Tensor& q_lat, const at::Tensor& q_pe, Problem& p, std::vector<float>& buf) {
  const int64_t B = q_lat.size(0);
  buf.assign((size_t)B * p.G * p.KP * p.GR, 0.0f);
  const float* ql = q_lat.data_ptr<float>();
  const float* qr = q_pe.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int r = 0; r < p.NR; ++r) {
        float* out = buf.data() + ((size_t)b * p.G + r / p.GR) * p.KP * p.GR + r % p.GR;
        const float* a = ql + ((size_t)b * p.NR + r) * p.L;
        const float* c = qr + ((size_t)b * p.NR + r) * p.R;
        for (int k = 0; k < p.L; ++k) out[(size_t)k * p.GR] = a[k];
        for (int k = 0; k < p.R; ++k) out[(size_t)(p.L + k) * p.GR] = c[k];
      }
    }
  });
  p.qpack = buf.data();
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

void check(bool ok, const char* what) { TORCH_CHECK(ok, "latent_decode (fp32): ", what); }

std::tuple<at::Tensor, at::Tensor> latent_decode(const at::Tensor& q_lat, const at::Tensor& q_pe,
                                                 const at::Tensor& c_kv, const at::Tensor& k_pe,
                                                 const c10::optional<at::Tensor>& rows, const at::Tensor& kv_lens,
                                                 int64_t new_tokens, int64_t key_start, double scale,
                                                 int64_t splits) {
  check(q_lat.dim() == 3 && q_pe.dim() == 3 && q_lat.is_contiguous() && q_pe.is_contiguous(),
        "q_lat [B, S*H, L] and q_pe [B, S*H, R] must be contiguous");
  check(q_lat.scalar_type() == at::kFloat && q_pe.scalar_type() == at::kFloat, "queries must be fp32");
  check(c_kv.scalar_type() == at::kFloat && k_pe.scalar_type() == at::kFloat, "cache must be fp32");
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
  check(p.L % 8 == 0 && p.L > 0 && p.R > 0, "latent width must be a multiple of 8, rope width > 0");
  p.GR = std::min(RG, (p.NR + 15) / 16 * 16);
  p.G = (p.NR + p.GR - 1) / p.GR;
  p.KP = p.L + p.R;
  p.scale = (float)scale;
  p.kv_lens = kv_lens.data_ptr<int64_t>();
  p.key_start = key_start;
  p.ckv = c_kv.data_ptr<float>();
  p.kpe = k_pe.data_ptr<float>();
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
  std::vector<float> qbuf;
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

// the first index of the row's largest value (NaN the largest): per lane, its largest value so far and
// where it was first seen (strictly greater replaces); the smallest index among the lanes that hold the
// largest, then the tail past the last 8 (later indices: only a strictly greater value wins). A row of
// all -inf gives 0: lane 0 holds index 0, the smallest of the lanes tied at -inf
int64_t row_argmax(const float* x, int64_t V) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 mx = _mm256_set1_ps(NEG_INF), nan = _mm256_setzero_ps();
  __m256i at = lanes, cur = lanes;
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, mx, _CMP_GT_OQ);
    mx = _mm256_blendv_ps(mx, v, gt);
    at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(cur), gt));
    cur = _mm256_add_epi32(cur, step);
  }
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < V && !any_nan; ++j) any_nan = std::isnan(x[j]);
  if (any_nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  alignas(32) float m[8];
  alignas(32) int32_t a[8];
  _mm256_store_ps(m, mx);
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), at);
  float best = m[0];
  int64_t idx = a[0];
  for (int l = 1; l < 8; ++l)
    if (m[l] > best || (m[l] == best && a[l] < idx)) best = m[l], idx = a[l];
  for (; i < V; ++i)
    if (x[i] > best) best = x[i], idx = i;
  return idx;
}

// x [R, V] fp32 (rows contiguous, V < 2^31 - 8) -> [R] int64: torch.argmax(x, -1)
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: x [R, V] fp32, rows contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V < INT32_MAX - 8, "argmax_rows: 0 < V < 2^31 - 8");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * ld, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mlakit_cpu_f32, m) {
  m.def(
      "latent_decode(Tensor q_lat, Tensor q_pe, Tensor c_kv, Tensor k_pe, Tensor? rows, Tensor kv_lens, "
      "int new_tokens, int key_start, float scale, int splits) -> (Tensor, Tensor)");
  m.impl("latent_decode", c10::DispatchKey::CPU, TORCH_FN(latent_decode));
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
}
