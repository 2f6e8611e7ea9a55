// Element combine shared by the CUDA kernels, free of torch headers (see
// ipc_kernels.h for why): 16-bit floats combine in float32 and round once (to nearest
// even, as torch does); MIN/MAX propagate NaN like torch. Same semantics as the CPU
// kernels, so GPU and CPU results match bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "dtype.h"

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

// The CPU kernels' semantics (csrc/cpu/reduce_impl.inc): MIN/MAX propagate NaN.
template <typename A>
__device__ __forceinline__ A combine(A a, A b, int op) {
  switch (op) {
    case 0: return a + b;
    case 1: return a * b;
    case 2:
      if (is_nan(a)) return a;
      if (is_nan(b)) return b;
      return b < a ? b : a;
    default:
      if (is_nan(a)) return a;
      if (is_nan(b)) return b;
      return b > a ? b : a;
  }
}

}  // namespace commlab
