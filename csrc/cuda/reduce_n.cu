// CUDA twin of csrc/cpu/reduce_n.cpp: out = in[0] op in[1] op ... in fixed order,
// each input read once, 16-bit floats accumulated in float32.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <vector>

#include "../cpu/reduce_n.h"

namespace commlab {
namespace {

// Passed by value as a kernel argument; 16 inputs cover the ranks one host holds.
constexpr int kMaxInputs = 16;
struct InputPtrs {
  const void* p[kMaxInputs];
};

template <typename T> struct AccT { using type = T; };
template <> struct AccT<at::Half> { using type = float; };
template <> struct AccT<at::BFloat16> { using type = float; };

template <typename A>
__device__ __forceinline__ A dcombine(A a, A b, int op) {
  switch (op) {
    case 0: return a + b;
    case 1: return a * b;
    case 2:
      if constexpr (std::is_floating_point_v<A>) {
        if (isnan(a)) return a;
        if (isnan(b)) return b;
      }
      return b < a ? b : a;
    default:
      if constexpr (std::is_floating_point_v<A>) {
        if (isnan(a)) return a;
        if (isnan(b)) return b;
      }
      return b > a ? b : a;
  }
}

template <typename T>
__global__ void reduce_n_kernel(T* out, InputPtrs in, int n, int64_t numel, int op) {
  using A = typename AccT<T>::type;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += stride) {
    A acc = static_cast<A>(static_cast<const T*>(in.p[0])[i]);
    for (int k = 1; k < n; ++k) acc = dcombine<A>(acc, static_cast<A>(static_cast<const T*>(in.p[k])[i]), op);
    out[i] = static_cast<T>(acc);
  }
}

}  // namespace

void reduce_n_cuda(const torch::Tensor& out, const std::vector<torch::Tensor>& inputs, RedOp op) {
  TORCH_CHECK(!inputs.empty() && inputs.size() <= kMaxInputs,
              "commlab: reduce_n on CUDA takes 1..", kMaxInputs, " inputs, got ", inputs.size());
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "commlab: reduce_n output must be contiguous CUDA");
  InputPtrs ptrs{};
  for (size_t k = 0; k < inputs.size(); ++k) {
    const auto& t = inputs[k];
    TORCH_CHECK(t.is_cuda() && t.device() == out.device() && t.is_contiguous(),
                "commlab: reduce_n inputs must be contiguous tensors on ", out.device());
    TORCH_CHECK(t.scalar_type() == out.scalar_type() && t.numel() == out.numel(),
                "commlab: reduce_n inputs must match the output's dtype and size");
    ptrs.p[k] = t.data_ptr();
  }
  const int64_t numel = out.numel();
  if (numel == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const int threads = 256;
  const int64_t want = (numel + threads - 1) / threads;
  const int blocks = static_cast<int>(std::min<int64_t>(want, 4096));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_SWITCH(out.scalar_type(), "commlab_reduce_n",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); })
      AT_DISPATCH_CASE(at::kDouble, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); })
      AT_DISPATCH_CASE(at::kHalf, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); })
      AT_DISPATCH_CASE(at::kInt, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); })
      AT_DISPATCH_CASE(at::kLong, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); })
      AT_DISPATCH_CASE(at::kByte, [&] {
        reduce_n_kernel<scalar_t><<<blocks, threads, 0, stream>>>(out.data_ptr<scalar_t>(), ptrs,
            static_cast<int>(inputs.size()), numel, static_cast<int>(op)); }));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace commlab
