// CUDA twin of csrc/cpu/reduce/reduce_n.cpp: out = in[0] op in[1] op ... in fixed order,
// each input read once, 16-bit floats accumulated in float32.
#include "reduce_n_kernels.h"

#include <cuda_runtime.h>

#include "../device_ops.cuh"

namespace commlab {
namespace {

template <typename T>
__global__ void reduce_n_kernel(T* out, ReduceInputs in, int n, int64_t numel, RedOp op) {
  using E = Elem<T>;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel; i += stride) {
    typename E::Acc acc = E::load(static_cast<const T*>(in.p[0])[i]);
    for (int k = 1; k < n; ++k) acc = combine(acc, E::load(static_cast<const T*>(in.p[k])[i]), op);
    out[i] = E::store(acc);
  }
}

}  // namespace

cudaError_t launch_reduce_n(DType dtype, void* out, const ReduceInputs& in, int n, int64_t numel, RedOp op,
                            cudaStream_t stream) {
  const int threads = 256;
  const int64_t want = (numel + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 4096 ? want : 4096);
  return dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    reduce_n_kernel<T><<<blocks, threads, 0, stream>>>(static_cast<T*>(out), in, n, numel, op);
    return cudaGetLastError();
  });
}

}  // namespace commlab
