// The reduction loop for AVX-512 (F, BW, VL) hosts, chosen at run time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "reduce_codes.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>

namespace commlab {
namespace avx512 {
namespace {
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
}  // namespace
#include "reduce_impl.inc"
}  // namespace avx512
}  // namespace commlab
#pragma GCC pop_options
