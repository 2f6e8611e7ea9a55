// The reduction loop for AVX2 + FMA + F16C hosts, chosen at run time (never -march=native).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "reduce_codes.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace commlab {
namespace avx2 {
namespace {
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
}  // namespace
#include "reduce_impl.inc"
}  // namespace avx2
}  // namespace commlab
#pragma GCC pop_options
