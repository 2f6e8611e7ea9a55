// Host side of the CUDA N-way reduction: checks, then the torch-free launcher.
// Compiled only into CUDA builds.
#ifdef COMMLAB_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "../../common/torch_lite.h"

#include <vector>

#include "../../common/torch_codes.h"
#include "../../cpu/reduce/reduce_n.h"
#include "reduce_n_kernels.h"

namespace commlab {

void reduce_n_cuda(const at::Tensor& out, const std::vector<at::Tensor>& inputs, RedOp op) {
  TORCH_CHECK(!inputs.empty() && inputs.size() <= kMaxReduceInputs, "commlab: reduce_n on CUDA takes 1..",
              kMaxReduceInputs, " inputs, got ", inputs.size());
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "commlab: reduce_n output must be contiguous CUDA");
  ReduceInputs ptrs{};
  for (size_t k = 0; k < inputs.size(); ++k) {
    const auto& t = inputs[k];
    TORCH_CHECK(t.is_cuda() && t.device() == out.device() && t.is_contiguous(),
                "commlab: reduce_n inputs must be contiguous tensors on ", out.device());
    TORCH_CHECK(t.scalar_type() == out.scalar_type() && t.numel() == out.numel(),
                "commlab: reduce_n inputs must match the output's dtype and size");
    ptrs.p[k] = t.data_ptr();
  }
  const DType dtype = to_dtype(out.scalar_type(), "reduce_n");
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(launch_reduce_n(dtype, out.data_ptr(), ptrs, static_cast<int>(inputs.size()), out.numel(),
                                 op, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace commlab
#endif  // COMMLAB_WITH_CUDA
