// The entry point every instruction-set build of the reduction loop provides
// (reduce_impl.inc compiled by reduce_n.cpp, reduce_n_avx2.cpp, reduce_n_avx512.cpp).
// These files may not see c10 types: the codes are commlab's own (common/codes.h).
#pragma once

#include <cstdint>

#include "../../common/codes.h"

namespace commlab {

namespace baseline {
bool reduce(void* out, const void* const* inputs, int64_t n, int64_t numel, DType dtype, RedOp op);
}
namespace avx2 {
bool reduce(void* out, const void* const* inputs, int64_t n, int64_t numel, DType dtype, RedOp op);
}
namespace avx512 {
bool reduce(void* out, const void* const* inputs, int64_t n, int64_t numel, DType dtype, RedOp op);
}

}  // namespace commlab
