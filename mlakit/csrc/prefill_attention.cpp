// Materialized MLA attention for CPUs with AVX512-BF16: the core of `materialize` once the latents
// are expanded into per-head keys and values (a prefill, or a chunk over a cached prefix).
//
// Each work item is one head of one sequence and a block of QB queries. Keys are that head's
// expanded rows [k_nope | k_pe], k_pe shared by every head and read in place (never expanded per
// head), values the head's rows of v; both strided views of the caller's tensors (no copies):
//   scores^T [t, r] = K[t, :] . Q[r, :]   queries packed once in pairs (VNNI), key pairs broadcast
//   online softmax over t in fp32, probabilities rounded to bf16 (normalized by their rounded sum)
//   O^T [l, r]    += V[t, l] P[t, r]      value rows interleaved in pairs, accumulators in fp32
// Query s of sequence b sits at position kv_lens[b] - S + s and sees keys up to it (causal; keys
// of this call start at position key_start): key blocks past a block's last visible key are never
// read, so rows past a sequence's length may hold anything. One parallel region per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace mlakit_tiles;

constexpr int QB = 32;   // queries of one head per work item (the 2 x 16 rows of the widest tile)
constexpr int KB = 128;  // keys per block of the online softmax (a multiple of the 8-key tile)

struct Prefill {
  const uint16_t *qn, *qr, *kn, *kr, *v;  // bf16 bits
  int64_t qn_b, qn_s, qn_h, qr_b, qr_s, qr_h;  // strides in elements
  int64_t kn_b, kn_t, kn_h, kr_b, kr_t, v_b, v_t, v_h;
  int64_t T, key_start;
  const int64_t* kv_lens;
  int S, H, DN, DR, DV, KP;
  float scale;
};

struct Scratch {
  std::vector<float> st, ot, m, d, dr, alpha;
  std::vector<uint32_t> qp, pt, vp;
  std::vector<int64_t> lim;
  void fit(const Prefill& p) {
    st.resize((size_t)KB * QB);
    pt.resize((size_t)(KB / 2) * QB);
    vp.resize((size_t)(KB / 2) * p.DV);
    ot.resize((size_t)p.DV * QB);
    qp.resize((size_t)p.KP * QB);
    for (auto* x : {&m, &d, &dr, &alpha}) x->resize(QB);
    lim.resize(QB);
  }
};

// queries q0 .. q0 + nq of head h in pairs: qp[kp][r] (q_nope's pairs, then q_pe's), padding rows zero
void pack_block(const Prefill& p, Scratch& s, int64_t b, int64_t h, int q0, int nq) {
  const int kpn = p.DN / 2;
  const uint16_t* qn = p.qn + b * p.qn_b + h * p.qn_h;
  const uint16_t* qr = p.qr + b * p.qr_b + h * p.qr_h;
  transpose_pairs([&](int r) { return reinterpret_cast<const uint32_t*>(qn + (q0 + r) * p.qn_s); }, nq, QB, kpn,
                  s.qp.data(), QB);
  transpose_pairs([&](int r) { return reinterpret_cast<const uint32_t*>(qr + (q0 + r) * p.qr_s); }, nq, QB,
                  p.DR / 2, s.qp.data() + (size_t)kpn * QB, QB);
}

// scores of keys [k0, k0 + n) against the block's rows, masked past each row's limit, into s.st
void block_scores(const Prefill& p, Scratch& s, int64_t b, int64_t h, int64_t k0, int n, int nq) {
  const int nn = (n + 7) / 8 * 8;
  const uint32_t* kc[8];
  const uint32_t* kr[8];
  for (int t0 = 0; t0 < nn; t0 += 8) {
    for (int m = 0; m < 8; ++m) {
      const int64_t t = k0 + std::min(t0 + m, n - 1);  // padding keys repeat the last one (masked below)
      kc[m] = reinterpret_cast<const uint32_t*>(p.kn + b * p.kn_b + t * p.kn_t + h * p.kn_h);
      kr[m] = reinterpret_cast<const uint32_t*>(p.kr + b * p.kr_b + t * p.kr_t);
    }
    score_tile<2>(kc, kr, p.DN / 2, p.DR / 2, s.qp.data(), QB, s.st.data() + t0 * QB, QB, p.scale);
  }
  int64_t lo = p.T;
  for (int r = 0; r < nq; ++r) lo = std::min(lo, s.lim[r]);
  for (int t = 0; t < nn; ++t) {
    const int64_t key = k0 + t;
    float* row = s.st.data() + t * QB;
    if (t >= n) {
      std::fill(row, row + QB, NEG_INF);
    } else if (key >= lo) {
      for (int r = 0; r < QB; ++r)
        if (key >= s.lim[r]) row[r] = NEG_INF;
    }
  }
}

inline void store16(float* o, __m512 x) { _mm512_storeu_ps(o, x); }

inline void store16(at::BFloat16* o, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(x));  // nearest even
}

// one work item: head h of sequence b, queries [q0, q0 + nq); out rows normalized, lse per row
template <class Out>
void attend_block(const Prefill& p, int64_t b, int64_t h, int q0, int nq, Out* out, float* lse) {
  thread_local Scratch s;
  s.fit(p);
  pack_block(p, s, b, h, q0, nq);
  int64_t hi = 0;
  for (int r = 0; r < QB; ++r) {
    const int64_t lim = p.kv_lens[b] - p.S + q0 + r + 1 - p.key_start;
    s.lim[r] = r < nq ? std::max<int64_t>(0, std::min<int64_t>(lim, p.T)) : 0;
    hi = std::max(hi, s.lim[r]);
  }
  std::fill(s.m.begin(), s.m.end(), NEG_INF);
  std::fill(s.d.begin(), s.d.end(), 0.0f);
  std::fill(s.dr.begin(), s.dr.end(), 0.0f);
  std::fill(s.ot.begin(), s.ot.end(), 0.0f);
  const uint16_t* vh = p.v + b * p.v_b + h * p.v_h;
  for (int64_t kb = 0; kb < hi; kb += KB) {
    const int n = (int)std::min<int64_t>(KB, hi - kb);
    const int nn = (n + 7) / 8 * 8;
    block_scores(p, s, b, h, kb, n, nq);
    softmax_block(s.st.data(), QB, QB, nn, s.m.data(), s.d.data(), s.dr.data(), s.alpha.data(), s.pt.data());
    pair_rows([&](int t) { return vh + (kb + t) * p.v_t; }, n, nn, p.DV, s.vp.data());
    mix_block(s.vp.data(), p.DV, nn, s.pt.data(), QB, QB, s.ot.data(), s.alpha.data());
  }
  for (int r = 0; r < nq; ++r) {
    const bool none = !(s.d[r] > 0.0f);
    if (lse != nullptr) lse[(int64_t)r * p.H] = none ? NEG_INF : s.m[r] + std::log(s.d[r]);
    s.alpha[r] = none ? 0.0f : 1.0f / s.dr[r];  // alpha's last use was the last block: the row scales
  }
  untranspose(s.ot.data(), QB, nq, p.DV, s.alpha.data(),
              [&](int r, int l0, __m512 x) { store16(out + (int64_t)r * p.H * p.DV + l0, x); });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "prefill_attention: ", what); }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// q_nope [B,S,H,dn], q_pe [B,S,H,dr], k_nope [B,T,H,dn], k_pe [B,T,dr], v [B,T,H,dv] (bf16, rows
// contiguous in their last dim, any other strides) -> out [B,S,H,dv] (bf16, or fp32 with need_lse)
// and lse [B,S,H] fp32 (empty without need_lse)
std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q_nope, const at::Tensor& q_pe,
                                                     const at::Tensor& k_nope, const at::Tensor& k_pe,
                                                     const at::Tensor& v, const at::Tensor& kv_lens,
                                                     int64_t key_start, double scale, bool need_lse) {
  for (const auto* t : {&q_nope, &q_pe, &k_nope, &v})
    check(t->dim() == 4 && t->scalar_type() == at::kBFloat16 && t->stride(3) == 1,
          "q_nope, q_pe, k_nope and v must be 4-d bf16 with contiguous rows");
  check(k_pe.dim() == 3 && k_pe.scalar_type() == at::kBFloat16 && k_pe.stride(2) == 1,
        "k_pe must be [B, T, dr] bf16 with contiguous rows");
  check(kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous() && kv_lens.device().is_cpu(),
        "kv_lens must be contiguous int64 on the CPU");
  Prefill p{};
  const int64_t B = q_nope.size(0);
  p.S = (int)q_nope.size(1);
  p.H = (int)q_nope.size(2);
  p.DN = (int)q_nope.size(3);
  p.DR = (int)q_pe.size(3);
  p.DV = (int)v.size(3);
  p.T = k_nope.size(1);
  check(q_pe.size(0) == B && q_pe.size(1) == p.S && q_pe.size(2) == p.H, "q_pe [B, S, H, dr]");
  check(k_nope.size(0) == B && k_nope.size(2) == p.H && k_nope.size(3) == p.DN, "k_nope [B, T, H, dn]");
  check(k_pe.size(0) == B && k_pe.size(1) == p.T && k_pe.size(2) == p.DR, "k_pe [B, T, dr]");
  check(v.size(0) == B && v.size(1) == p.T && v.size(2) == p.H, "v [B, T, H, dv]");
  check(kv_lens.dim() == 1 && kv_lens.size(0) == B, "kv_lens [B]");
  check(p.DN % 2 == 0 && p.DR % 2 == 0 && p.DV % 32 == 0, "dn and dr even, dv a multiple of 32");
  check(p.DN > 0 && p.DR > 0, "dn and dr must be positive");
  p.KP = p.DN / 2 + p.DR / 2;
  p.qn = bits(q_nope), p.qr = bits(q_pe), p.kn = bits(k_nope), p.kr = bits(k_pe), p.v = bits(v);
  p.qn_b = q_nope.stride(0), p.qn_s = q_nope.stride(1), p.qn_h = q_nope.stride(2);
  p.qr_b = q_pe.stride(0), p.qr_s = q_pe.stride(1), p.qr_h = q_pe.stride(2);
  p.kn_b = k_nope.stride(0), p.kn_t = k_nope.stride(1), p.kn_h = k_nope.stride(2);
  p.kr_b = k_pe.stride(0), p.kr_t = k_pe.stride(1);
  p.v_b = v.stride(0), p.v_t = v.stride(1), p.v_h = v.stride(2);
  p.kv_lens = kv_lens.data_ptr<int64_t>();
  p.key_start = key_start;
  p.scale = (float)scale;
  const auto opts = q_nope.options();
  at::Tensor out = at::empty({B, p.S, p.H, p.DV}, need_lse ? opts.dtype(at::kFloat) : opts);
  at::Tensor lse = need_lse ? at::empty({B, p.S, p.H}, opts.dtype(at::kFloat)) : at::empty({0}, opts.dtype(at::kFloat));
  const int64_t blocks = (p.S + QB - 1) / QB;
  // items ordered (sequence, head, query block): each thread's share is whole heads, so the
  // causal blocks' growing work evens out
  at::parallel_for(0, B * p.H * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (p.H * blocks), h = (i / blocks) % p.H;
      const int q0 = (int)(i % blocks) * QB, nq = std::min(QB, p.S - q0);
      const int64_t at = ((b * p.S + q0) * p.H + h);
      float* l = need_lse ? lse.data_ptr<float>() + at : nullptr;
      if (need_lse)
        attend_block(p, b, h, q0, nq, out.data_ptr<float>() + at * p.DV, l);
      else
        attend_block(p, b, h, q0, nq, out.data_ptr<at::BFloat16>() + at * p.DV, l);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlakit_cpu, m) {
  m.def(
      "prefill_attention(Tensor q_nope, Tensor q_pe, Tensor k_nope, Tensor k_pe, Tensor v, Tensor kv_lens, "
      "int key_start, float scale, bool need_lse) -> (Tensor, Tensor)");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
