// The attention half of one MLA decoder layer at a decode step, in one call (AVX512-BF16): what
// mlakit/engine/decode.py runs op by op from Python, with the same kernels in the same order, so the
// same bits, without a Python frame or a tensor wrapper between them (a decode step of the demo model
// makes ~25 such calls a layer: ~1,300 a step):
//   x = rms(h); q = q_b(rms_q(q_a(x))); kv = kv_a(x); c_kv = rms_kv(kv[:, :L]); k_pe = kv[:, L:]
//   q_pe, k_pe rotated by the step's tables; q_lat = q_nope . w_uk per head (the fold)
//   c_kv and k_pe written at the step's rows of the layer's pools (the paged cache, in place)
//   o_lat = the latent core over each sequence's rows; o = o_proj(unfold(bf16(o_lat)))
//   returns h + o and rms_post(h + o) (the MLP's input)
// and `moe_decode_block`: h + the MoE block of that input (the router's small ops and the experts).
// The kernels are the registered ops (csrc/rows.cpp, vnni_linear.cpp, latent_decode.cpp) called
// through the dispatcher; the two casts between them are torch's (round to nearest even, as
// Tensor.to(bfloat16) and a bf16 add round). Every check runs before the cache is written: a refused
// call changes nothing.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "bf16_tiles.h"

namespace {

using at::Tensor;
using mlakit_tiles::load_bf16;
using mlakit_tiles::tail;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "mla_decode_layer: ", what); }

template <class F>
auto handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

Tensor rms(const Tensor& x, const Tensor& w, double eps) {
  static auto op = handle<Tensor(const Tensor&, const Tensor&, double)>("mlakit_cpu::rms_norm");
  return op.call(x, w, eps);
}

Tensor linear(const Tensor& x, const Tensor& packed, int64_t n) {
  static auto op =
      handle<Tensor(const Tensor&, const Tensor&, int64_t, const std::optional<Tensor>&)>("mlakit_cpu::vnni_linear");
  return op.call(x, packed, n, std::nullopt);
}

Tensor heads(const Tensor& x, const Tensor& packed, int64_t n) {
  static auto op = handle<Tensor(const Tensor&, const Tensor&, int64_t)>("mlakit_cpu::vnni_heads");
  return op.call(x, packed, n);
}

Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleave) {
  static auto op = handle<Tensor(const Tensor&, const Tensor&, const Tensor&, bool)>("mlakit_cpu::rope_rows");
  return op.call(x, cos, sin, interleave);
}

std::tuple<Tensor, Tensor> core(const Tensor& q_lat, const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe,
                                const Tensor& rows, const Tensor& lens, double scale, int64_t splits) {
  static auto op = handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                     const std::optional<Tensor>&, const Tensor&, int64_t, int64_t,
                                                     double, int64_t)>("mlakit_cpu::latent_decode");
  return op.call(q_lat, q_pe, c_kv, k_pe, rows, lens, 1, 0, scale, splits);
}

// fp32 -> bf16 as torch rounds (c10::BFloat16 / its AVX-512 conversion): nearest even on the bits, NaN
// to 0xFFFF; not vcvtneps2bf16, which reads denormal inputs as zero
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)), u), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), r);
  return _mm512_cvtepi32_epi16(r);
}

// [n] fp32 -> [n] bf16
void cast(const float* x, int64_t n, uint16_t* y) {
  at::parallel_for(0, (n + 15) / 16, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0 * 16; i < std::min(n, i1 * 16); i += 16) {
      const __mmask16 m = tail(n - i);
      _mm256_mask_storeu_epi16(y + i, m, to_bf16(_mm512_maskz_loadu_ps(m, x + i)));
    }
  });
}

// y = a + b, bf16 rows [n, d] (a torch bf16 add: the fp32 sum rounded)
void add_rows(const uint16_t* a, const uint16_t* b, int64_t n, int64_t d, uint16_t* y) {
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 m = tail(d - j);
        const __m512 s = _mm512_add_ps(load_bf16(a + r * d + j, m), load_bf16(b + r * d + j, m));
        _mm256_mask_storeu_epi16(y + r * d + j, m, to_bf16(s));
      }
  });
}

const uint16_t* bits(const Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

bool bf16(const Tensor& t) { return t.scalar_type() == at::kBFloat16 && t.device().is_cpu(); }

// a packed weight of `n` outputs over `k` inputs (csrc/vnni_linear.cpp's layout)
bool packed_as(const Tensor& w, int64_t n, int64_t k) {
  return bf16(w) && w.dim() == 3 && w.is_contiguous() && w.size(0) == (n + 31) / 32 && w.size(1) == (k + 1) / 2 &&
         w.size(2) == 64;
}

bool heads_as(const Tensor& w, int64_t h, int64_t n, int64_t k) {
  return bf16(w) && w.dim() == 4 && w.is_contiguous() && w.size(0) == h && w.size(1) == (n + 31) / 32 &&
         w.size(2) == k / 2 && w.size(3) == 64;
}

bool norm_of(const Tensor& w, int64_t d) { return bf16(w) && w.dim() == 1 && w.is_contiguous() && w.size(0) == d; }

bool table(const Tensor& t, int64_t n, int64_t dr) {
  return t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() && t.size(0) == n && t.size(1) == dr;
}

// dims: heads, qk_nope, qk_rope, v, q_lora_rank, kv_lora_rank
std::tuple<Tensor, Tensor> mla_decode_layer(const Tensor& h, const Tensor& w_in, double eps_in, const Tensor& q_a,
                                            const Tensor& w_qa, double eps_qa, const Tensor& q_b, const Tensor& kv_a,
                                            const Tensor& w_kva, double eps_kva, const Tensor& cos_q,
                                            const Tensor& sin_q, const Tensor& cos_k, const Tensor& sin_k,
                                            bool interleave, const Tensor& latent, const Tensor& rope_pool,
                                            const Tensor& slots, const Tensor& fold, const Tensor& unfold,
                                            const Tensor& rows, const Tensor& kv_lens, double scale, int64_t splits,
                                            const Tensor& o_proj, const Tensor& w_post, double eps_post,
                                            at::IntArrayRef dims) {
  check(dims.size() == 6, "dims: heads, qk_nope, qk_rope, v, q_lora_rank, kv_lora_rank");
  const int64_t H = dims[0], dn = dims[1], dr = dims[2], dv = dims[3], QL = dims[4], L = dims[5];
  check(H > 0 && dn > 0 && dr > 0 && dv > 0 && QL > 0 && L > 0, "dims must be positive");
  check(bf16(h) && h.dim() == 2 && h.is_contiguous(), "h [N, D] bf16 contiguous");
  const int64_t N = h.size(0), D = h.size(1);
  check(N > 0 && D % 2 == 0 && QL % 2 == 0 && L % 32 == 0 && dr % 32 == 0 && dn % 2 == 0 && dv % 2 == 0,
        "widths: D, q_lora_rank, qk_nope and v even, kv_lora_rank and qk_rope multiples of 32");
  check(norm_of(w_in, D) && norm_of(w_qa, QL) && norm_of(w_kva, L) && norm_of(w_post, D), "norm weights [width] bf16");
  check(packed_as(q_a, QL, D) && packed_as(q_b, H * (dn + dr), QL) && packed_as(kv_a, L + dr, D) &&
            packed_as(o_proj, D, H * dv),
        "packed projections do not match the widths");
  check(heads_as(fold, H, L, dn) && heads_as(unfold, H, dv, L), "packed fold [H, L/32, dn/2, 64], unfold [H, dv/32, L/2, 64]");
  check(table(cos_q, N, dr) && table(sin_q, N, dr) && table(cos_k, N, dr) && table(sin_k, N, dr),
        "rope tables [N, qk_rope] fp32 contiguous");
  check(bf16(latent) && bf16(rope_pool) && latent.dim() == 2 && rope_pool.dim() == 2 && latent.size(1) == L &&
            rope_pool.size(1) == dr && latent.stride(1) == 1 && rope_pool.stride(1) == 1 &&
            latent.size(0) == rope_pool.size(0),
        "pools: latent [R, kv_lora_rank], rope [R, qk_rope] bf16, rows contiguous");
  check(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == N,
        "slots [N] int64 contiguous");
  check(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(0) == N && rows.stride(1) == 1,
        "rows [N, T] int64");
  check(kv_lens.scalar_type() == at::kLong && kv_lens.dim() == 1 && kv_lens.is_contiguous() && kv_lens.size(0) == N,
        "kv_lens [N] int64 contiguous");
  const int64_t R = latent.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) check(sp[i] >= 0 && sp[i] < R, "a slot is out of the pools");

  const Tensor x = rms(h, w_in, eps_in);
  const Tensor q = linear(rms(linear(x, q_a, QL), w_qa, eps_qa), q_b, H * (dn + dr)).view({N, H, dn + dr});
  const Tensor kv = linear(x, kv_a, L + dr);  // [N, L + dr]
  const Tensor c_kv = rms(kv.narrow(1, 0, L), w_kva, eps_kva);  // [N, L]
  const Tensor q_pe = rope(q.narrow(2, dn, dr), cos_q, sin_q, interleave);  // [N, H, dr]
  const Tensor k_pe = rope(kv.narrow(1, L, dr).unsqueeze(1), cos_k, sin_k, interleave);  // [N, 1, dr]
  const Tensor q_lat = heads(q.narrow(2, 0, dn), fold, L);  // [N, H, L]

  // the cache write: whole rows, nothing after it can refuse
  auto* lp = reinterpret_cast<uint16_t*>(latent.data_ptr<at::BFloat16>());
  auto* rp = reinterpret_cast<uint16_t*>(rope_pool.data_ptr<at::BFloat16>());
  const uint16_t *cp = bits(c_kv), *kp = bits(k_pe);
  for (int64_t i = 0; i < N; ++i) {
    std::memcpy(lp + sp[i] * latent.stride(0), cp + i * L, L * 2);
    std::memcpy(rp + sp[i] * rope_pool.stride(0), kp + i * dr, dr * 2);
  }

  const Tensor o_lat = std::get<0>(core(q_lat, q_pe, latent, rope_pool, rows, kv_lens, scale, splits));
  Tensor o_b = at::empty({N, H, L}, h.options());
  cast(o_lat.data_ptr<float>(), N * H * L, reinterpret_cast<uint16_t*>(o_b.data_ptr<at::BFloat16>()));
  const Tensor o = linear(heads(o_b, unfold, dv).view({N, H * dv}), o_proj, D);  // [N, D]
  Tensor h_out = at::empty({N, D}, h.options());
  add_rows(bits(h), bits(o), N, D, reinterpret_cast<uint16_t*>(h_out.data_ptr<at::BFloat16>()));
  return {h_out, rms(h_out, w_post, eps_post)};
}

// h + MoE(x) of a block routed as mlakit/engine/moe.py `_short_route` routes (a noaux_tc router whose
// group limit keeps every group: sigmoid scores, top-k of scores + bias, the chosen scores normalized
// and scaled) and computed by `moe_experts` (csrc/vnni_linear.cpp) over the released packs: the same
// ops in the same order (the router's through ATen, so its fp32 logits are the same MKL product)
Tensor moe_decode_block(const Tensor& h, const Tensor& x, const Tensor& gate_w, const Tensor& bias, int64_t top_k,
                        bool norm_topk, double scale, const Tensor& gate_up, const Tensor& down,
                        const std::optional<Tensor>& shared_gate_up, const std::optional<Tensor>& shared_down,
                        int64_t I, int64_t Is) {
  check(bf16(h) && h.dim() == 2 && h.is_contiguous() && bf16(x) && x.sizes() == h.sizes() && x.is_contiguous(),
        "h and x [N, D] bf16 contiguous");
  const int64_t N = h.size(0), D = h.size(1);
  check(gate_w.dim() == 2 && gate_w.size(1) == D && gate_w.device().is_cpu(), "gate weight [E, D]");
  const int64_t E = gate_w.size(0);
  check(bias.is_floating_point() && bias.dim() == 1 && bias.size(0) == E, "bias [E], a float dtype");
  check(top_k > 0 && top_k <= E, "top_k in 1..E");
  static auto experts = handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const std::optional<Tensor>&, const std::optional<Tensor>&, int64_t, int64_t)>(
      "mlakit_cpu::moe_experts");
  const Tensor scores = at::linear(x.to(at::kFloat), gate_w.to(at::kFloat)).sigmoid();  // [N, E]
  const Tensor index = std::get<1>(at::topk(scores + bias, top_k, -1, true, false));
  Tensor weights = scores.gather(1, index);
  if (norm_topk) weights.div_(weights.sum(-1, true) + 1e-20);
  weights = weights * scale;
  const Tensor out = experts.call(x, index, weights, gate_up, down, shared_gate_up, shared_down, I, Is);
  Tensor h_out = at::empty({N, D}, h.options());
  add_rows(bits(h), bits(out), N, D, reinterpret_cast<uint16_t*>(h_out.data_ptr<at::BFloat16>()));
  return h_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlakit_cpu, m) {
  m.def(
      "moe_decode_block(Tensor h, Tensor x, Tensor gate_w, Tensor bias, int top_k, bool norm_topk, float scale, "
      "Tensor gate_up, Tensor down, Tensor? shared_gate_up, Tensor? shared_down, int I, int Is) -> Tensor");
  m.impl("moe_decode_block", c10::DispatchKey::CPU, TORCH_FN(moe_decode_block));
  m.def(
      "mla_decode_layer(Tensor h, Tensor w_in, float eps_in, Tensor q_a, Tensor w_qa, float eps_qa, Tensor q_b, "
      "Tensor kv_a, Tensor w_kva, float eps_kva, Tensor cos_q, Tensor sin_q, Tensor cos_k, Tensor sin_k, "
      "bool interleave, Tensor latent, Tensor rope, Tensor slots, Tensor fold, Tensor unfold, Tensor rows, "
      "Tensor kv_lens, float scale, int splits, Tensor o_proj, Tensor w_post, float eps_post, int[] dims) "
      "-> (Tensor, Tensor)");
  m.impl("mla_decode_layer", c10::DispatchKey::CPU, TORCH_FN(mla_decode_layer));
}
