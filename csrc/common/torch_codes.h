// torch's ScalarType onto commlab's DType (host side only: includes torch).
#pragma once

#include "torch_lite.h"

#include "codes.h"

namespace commlab {

// -1 for a dtype commlab does not reduce.
inline int dtype_code(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return static_cast<int>(DType::kF32);
    case at::kDouble: return static_cast<int>(DType::kF64);
    case at::kHalf: return static_cast<int>(DType::kF16);
    case at::kBFloat16: return static_cast<int>(DType::kBF16);
    case at::kInt: return static_cast<int>(DType::kI32);
    case at::kLong: return static_cast<int>(DType::kI64);
    case at::kByte: return static_cast<int>(DType::kU8);
    default: return -1;
  }
}

inline DType to_dtype(c10::ScalarType t, const char* who) {
  const int code = dtype_code(t);
  TORCH_CHECK(code >= 0, "commlab ", who, ": dtype ", t, " is not supported");
  return static_cast<DType>(code);
}

}  // namespace commlab
