// Launch interface of the CUDA N-way reduction (reduce_n_kernels.cu), torch-free
// like ipc_kernels.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../common/codes.h"

namespace commlab {

// Passed by value as a kernel argument; 16 inputs cover the ranks one host holds.
constexpr int kMaxReduceInputs = 16;
struct ReduceInputs {
  const void* p[kMaxReduceInputs];
};

// out = in[0] op in[1] op ... op in[n-1], in that order.
cudaError_t launch_reduce_n(DType dtype, void* out, const ReduceInputs& in, int n, int64_t numel, RedOp op,
                            cudaStream_t stream);

}  // namespace commlab
