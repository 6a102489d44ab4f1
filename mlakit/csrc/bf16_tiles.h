// The AVX512-BF16 tiles both bf16 attention cores share (latent_decode.cpp, prefill_attention.cpp):
// transposed scores (keys x query rows) from key rows read in place against queries packed in pairs,
// the online softmax of one block of keys, value rows interleaved in pairs, and the weighted sum.
// Layouts: a block's scores st [nn][ld] (key t, query row r), its bf16 probabilities pt [nn/2][ld]
// (pairs of keys), values vp [nn/2][width] (pairs of keys), the output ot [width][ld] in fp32.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace mlakit_tiles {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// lanes [0, min(left, 16)) of a 16-lane mask: the tail of a row
inline __mmask16 tail(int64_t left) { return (__mmask16)(left >= 16 ? 0xFFFF : (1u << left) - 1); }

// 16 bf16 values (the lanes of m) widened to fp32 exactly; lanes outside m read as 0
inline __m512 load_bf16(const uint16_t* p, __mmask16 m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// x rounded to bf16 (nearest even) and widened back to fp32: what a bf16 op's result holds
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

inline __m512 exp512(__m512 x) {
  // exp to ~2 ulp: 2^n * p(r), r = x - n ln2; exactly 0 below -87 (and for -inf)
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

inline __m512 dp(__m512 acc, uint32_t pair, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair), (__m512bh)b);
}

// scores^T of 8 keys x NV*16 query rows over kpn pairs of one part of the row (latent, then rope):
// `first` starts from zero, else from st; `scale` (when not 1) multiplies the sums at the end. The
// parts run as two calls so that only 8 row pointers are live (16 spill the accumulators)
template <int NV>
inline void score_part(const uint32_t* const* rows, int kpn, const uint32_t* qp, int64_t ldq, float* st,
                       int64_t lds, bool first, float scale) {
  const uint32_t* k[8];
  for (int m = 0; m < 8; ++m) k[m] = rows[m];
  __m512 acc[8][NV];
  for (int m = 0; m < 8; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(st + m * lds + 16 * v);
  for (int kp = 0; kp < kpn; ++kp) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(qp + kp * ldq + 16 * v);
    for (int m = 0; m < 8; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = dp(acc[m][v], k[m][kp], b[v]);
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int m = 0; m < 8; ++m)
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(st + m * lds + 16 * v, scale == 1.0f ? acc[m][v] : _mm512_mul_ps(acc[m][v], s));
}

template <int NV>
inline void score_tile(const uint32_t* const* kc, const uint32_t* const* kr, int kpl, int kpr,
                       const uint32_t* qp, int64_t ldq, float* st, int64_t lds, float scale) {
  score_part<NV>(kc, kpl, qp, ldq, st, lds, true, 1.0f);
  score_part<NV>(kr, kpr, qp + kpl * ldq, ldq, st, lds, false, scale);
}

// O^T of 8 value columns x NV*16 query rows: rescaled by alpha, plus the block's pairs of keys
template <int NV>
inline void pv_tile(const uint32_t* vp, int64_t ldv, int tp_count, const uint32_t* pt, int64_t ldp,
                    float* ot, int64_t ldo, const float* alpha) {
  __m512 acc[8][NV];
  __m512 a[NV];
  for (int v = 0; v < NV; ++v) a[v] = _mm512_loadu_ps(alpha + 16 * v);
  for (int m = 0; m < 8; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + m * ldo + 16 * v), a[v]);
  for (int tp = 0; tp < tp_count; ++tp) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(pt + tp * ldp + 16 * v);
    const uint32_t* row = vp + tp * ldv;
    for (int m = 0; m < 8; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = dp(acc[m][v], row[m], b[v]);
  }
  for (int m = 0; m < 8; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + m * ldo + 16 * v, acc[m][v]);
}

// the online softmax update over a block of nn keys (even) for rows [0, nrp) (a multiple of 16):
// running max m, denominators of the exact (d) and of the bf16-rounded probabilities (dr), the
// rescale factor alpha of the rows' earlier sums, and the probabilities as bf16 pairs of keys in pt
inline void softmax_block(const float* st, int64_t ld, int nrp, int nn, float* m, float* d, float* dr,
                          float* alpha, uint32_t* pt) {
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int r = 0; r < nrp; r += 16) {
    __m512 bm = _mm512_set1_ps(NEG_INF);
    for (int t = 0; t < nn; ++t) bm = _mm512_max_ps(bm, _mm512_loadu_ps(st + t * ld + r));
    const __m512 m_old = _mm512_loadu_ps(m + r);
    const __m512 m_new = _mm512_max_ps(m_old, bm);
    const __mmask16 dead = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(NEG_INF), _CMP_EQ_OQ);
    const __m512 safe = _mm512_mask_mov_ps(m_new, dead, _mm512_setzero_ps());
    const __m512 a = _mm512_mask_mov_ps(exp512(_mm512_sub_ps(m_old, safe)), dead, _mm512_set1_ps(1.0f));
    __m512 sum = _mm512_setzero_ps(), sum_r = _mm512_setzero_ps();
    for (int t = 0; t < nn; t += 2) {
      const __m512 e0 = exp512(_mm512_sub_ps(_mm512_loadu_ps(st + t * ld + r), safe));
      const __m512 e1 = exp512(_mm512_sub_ps(_mm512_loadu_ps(st + (t + 1) * ld + r), safe));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0's 16 bf16, then e1's
      _mm512_storeu_si512(pt + (t / 2) * ld + r, _mm512_permutexvar_epi16(inter, both));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      const __m512i lo16 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(both));
      const __m512i hi16 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1));
      sum_r = _mm512_add_ps(sum_r, _mm512_castsi512_ps(_mm512_slli_epi32(lo16, 16)));
      sum_r = _mm512_add_ps(sum_r, _mm512_castsi512_ps(_mm512_slli_epi32(hi16, 16)));
    }
    _mm512_storeu_ps(m + r, m_new);
    _mm512_storeu_ps(alpha + r, a);
    _mm512_storeu_ps(d + r, _mm512_fmadd_ps(_mm512_loadu_ps(d + r), a, sum));
    _mm512_storeu_ps(dr + r, _mm512_fmadd_ps(_mm512_loadu_ps(dr + r), a, sum_r));
  }
}

// value rows interleaved in pairs: vp[tp][l] = (V[2tp][l], V[2tp+1][l]) for l < width (a multiple of
// 32); row(t) gives key t's row of bf16 bits, rows past n - 1 repeat row n - 1 (their weight is 0)
template <class Row>
inline void pair_rows(Row row, int n, int nn, int width, uint32_t* vp) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                      6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                      54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int t = 0; t < nn; t += 2) {
    const uint16_t* a = row(std::min(t, n - 1));
    const uint16_t* c = row(std::min(t + 1, n - 1));
    uint32_t* out = vp + (t / 2) * width;
    for (int l = 0; l < width; l += 32) {
      const __m512i x = _mm512_loadu_si512(a + l), y = _mm512_loadu_si512(c + l);
      _mm512_storeu_si512(out + l, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + l + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// ot [width][ld] = alpha * ot + V^T P over the block's nn keys, rows [0, nrp)
inline void mix_block(const uint32_t* vp, int width, int nn, const uint32_t* pt, int64_t ld, int nrp, float* ot,
                      const float* alpha) {
  for (int l0 = 0; l0 < width; l0 += 8) {
    int r0 = 0;
    for (; r0 + 32 <= nrp; r0 += 32)
      pv_tile<2>(vp + l0, width, nn / 2, pt + r0, ld, ot + l0 * ld + r0, ld, alpha + r0);
    if (r0 < nrp) pv_tile<1>(vp + l0, width, nn / 2, pt + r0, ld, ot + l0 * ld + r0, ld, alpha + r0);
  }
}


// 16 x 16 32-bit elements transposed in registers: r[i][j] -> r[j][i]
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 4; ++i) {
      v[8 * g + i] = _mm512_shuffle_i32x4(u[8 * g + i], u[8 * g + 4 + i], 0x88);
      v[8 * g + 4 + i] = _mm512_shuffle_i32x4(u[8 * g + i], u[8 * g + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(v[i], v[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(v[i], v[8 + i], 0xdd);
  }
}

// qp[k][r] = row(r)[k] (32-bit pairs) for k < kn and r < nr; rows nr .. nrp (a multiple of 16) zero
template <class Row>
inline void transpose_pairs(Row row, int nr, int nrp, int kn, uint32_t* qp, int64_t ld) {
  __m512i r[16];
  for (int r0 = 0; r0 < nrp; r0 += 16)
    for (int k0 = 0; k0 < kn; k0 += 16) {
      const int kc = std::min(16, kn - k0);
      const __mmask16 live = (__mmask16)(kc == 16 ? 0xFFFF : (1u << kc) - 1);
      for (int i = 0; i < 16; ++i)
        r[i] = r0 + i < nr ? _mm512_maskz_loadu_epi32(live, row(r0 + i) + k0) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < kc; ++j) _mm512_storeu_si512(qp + (int64_t)(k0 + j) * ld + r0, r[j]);
    }
}

// out(r) [width] = scale[r] * ot[:, r] for r < nr: ot [width][ld] (width a multiple of 16) read back
// as rows, 16 x 16 blocks transposed in registers; store(r, l0, x) writes 16 values of row r
template <class Store>
inline void untranspose(const float* ot, int64_t ld, int nr, int width, const float* scale, Store store) {
  __m512i r[16];
  for (int r0 = 0; r0 < nr; r0 += 16)
    for (int l0 = 0; l0 < width; l0 += 16) {
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(ot + (int64_t)(l0 + i) * ld + r0);
      transpose16(r);
      for (int j = 0; j < 16 && r0 + j < nr; ++j)
        store(r0 + j, l0, _mm512_mul_ps(_mm512_castsi512_ps(r[j]), _mm512_set1_ps(scale[r0 + j])));
    }
}

}  // namespace mlakit_tiles
