// Prefetches into L2 that the compiler keeps, shared by the decode cores (latent_decode.cpp,
// latent_decode_f32.cpp): GCC 12 (-O1 and up) deleted loops of _mm_prefetch with nothing else in them
// (no prefetch instruction was left in the built library), so these are inline asm. Not for the inner
// loop of a product: vnni_linear's tile keeps _mm_prefetch, which the compiler keeps and schedules
// there; the same prefetches as this asm made the lm_head at 32 rows 2x slower (21.6 -> 42.5 ms, Zen 4).
#pragma once

#include <cstdint>

namespace mlakit_prefetch {

// the cache line holding p into L2
inline void line_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// bytes [p, p + n) into L2, a line at a time
inline void span_l2(const void* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) line_l2(static_cast<const char*>(p) + i);
}

}  // namespace mlakit_prefetch
