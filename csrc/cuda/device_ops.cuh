// Element combine shared by the CUDA kernels, free of torch headers (see
// ipc_kernels.h for why): 16-bit floats combine in float32 and round once (to nearest
// even, as torch does); MIN/MAX propagate NaN like torch. Same semantics as the CPU
// kernels, so GPU and CPU results match bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "../common/codes.h"

namespace commlab {

// Element access: 16-bit floats are combined in float32 and rounded once (round to
// nearest even, as torch does), like the CPU kernels.
template <typename T> struct Elem {
  using Acc = T;
  __device__ static Acc load(T v) { return v; }
  __device__ static T store(Acc v) { return v; }
};
template <> struct Elem<__half> {
  using Acc = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <> struct Elem<__nv_bfloat16> {
  using Acc = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename A> __device__ __forceinline__ bool is_nan(A a) {
  if constexpr (std::is_floating_point<A>::value) return a != a;
  return false;
}

// The CPU kernels' semantics (csrc/cpu/reduce/reduce_impl.inc): MIN/MAX propagate NaN.
template <typename A>
__device__ __forceinline__ A combine(A a, A b, RedOp op) {
  switch (op) {
    case RedOp::kSum: return a + b;
    case RedOp::kProduct: return a * b;
    case RedOp::kMin:
      if (is_nan(a)) return a;
      if (is_nan(b)) return b;
      return b < a ? b : a;
    default:
      if (is_nan(a)) return a;
      if (is_nan(b)) return b;
      return b > a ? b : a;
  }
}

// Host side: calls f(static_cast<T*>(nullptr)) with T the element type of `dtype`
// (the launchers' one switch over types).
template <typename F>
cudaError_t dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(static_cast<float*>(nullptr));
    case DType::kF64: return f(static_cast<double*>(nullptr));
    case DType::kF16: return f(static_cast<__half*>(nullptr));
    case DType::kBF16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::kI32: return f(static_cast<int32_t*>(nullptr));
    case DType::kI64: return f(static_cast<int64_t*>(nullptr));
    case DType::kU8: return f(static_cast<uint8_t*>(nullptr));
  }
  return cudaErrorInvalidValue;
}

}  // namespace commlab
