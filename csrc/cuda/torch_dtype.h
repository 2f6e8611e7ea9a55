// Host side: torch's ScalarType onto the kernels' DType.
#pragma once

#include <torch/extension.h>

#include "dtype.h"

namespace commlab {

inline DType to_dtype(c10::ScalarType t, const char* who) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kDouble: return DType::kF64;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    case at::kByte: return DType::kU8;
    default: break;
  }
  TORCH_CHECK(false, "commlab ", who, ": dtype ", t, " is not supported on CUDA");
}

}  // namespace commlab
