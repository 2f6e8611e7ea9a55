// Plain codes shared by every instruction-set build of the reduction loop (which may
// not see c10 types) and by the code that maps torch dtypes onto them.
#pragma once

#include <cstdint>

namespace commlab {

enum : int { kOpSum = 0, kOpProduct = 1, kOpMin = 2, kOpMax = 3 };
enum : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kI64 = 5, kU8 = 6 };

namespace baseline {
bool reduce(void* out, const void* const* inputs, int64_t n, int64_t numel, int dtype, int op);
}
namespace avx2 {
bool reduce(void* out, const void* const* inputs, int64_t n, int64_t numel, int dtype, int op);
}
namespace avx512 {
bool reduce(void* out, const void* const* inputs, int64_t n, int64_t numel, int dtype, int op);
}

}  // namespace commlab
