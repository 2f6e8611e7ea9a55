// Element types the CUDA kernels take, as a plain enum so that kernel files need no
// torch headers (torch_dtype.h maps torch's ScalarType onto it on the host side).
#pragma once

namespace commlab {

// kU8 stays last: ipc::preload() walks the values up to it.
enum class DType : int { kF32 = 0, kF64, kF16, kBF16, kI32, kI64, kU8 };

}  // namespace commlab
