// Fused N-way element-wise reduction: out = in[0] (op) in[1] (op) ... (op) in[n-1],
// applied in that fixed order so that every rank computing the same reduction gets
// the same bits. Each input is read exactly once; half types accumulate in float32
// and are rounded once at the end.
#pragma once

#include "../../common/torch_lite.h"

#include <string>
#include <vector>

#include "../../common/codes.h"

namespace commlab {

void reduce_n_cpu(const at::Tensor& out, const std::vector<at::Tensor>& inputs, RedOp op);

// Raw-pointer variant for callers that reduce out of shared memory without
// wrapping every slice in a tensor.
// Which instruction-set build of the loop runs: picked once from the CPU (AVX2 when
// present), overridable with COMMLAB_SIMD=scalar|avx2|avx512 or set_simd_level().
std::string simd_level();
std::vector<std::string> simd_levels();
void set_simd_level(const std::string& name);

void reduce_n_raw(void* out, const void* const* inputs, int64_t n_inputs, int64_t numel,
                  c10::ScalarType dtype, RedOp op);

}  // namespace commlab
