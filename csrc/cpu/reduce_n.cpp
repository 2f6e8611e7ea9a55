#include "reduce_n.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <type_traits>

namespace commlab {
namespace {

// The accumulator type: float for the 16-bit floats (one rounding at the end),
// the element type itself otherwise (integers wrap exactly like torch's).
template <typename T> struct Acc { using type = T; };
template <> struct Acc<c10::Half> { using type = float; };
template <> struct Acc<c10::BFloat16> { using type = float; };

template <typename A>
inline A combine(A a, A b, RedOp op) {
  switch (op) {
    case RedOp::kSum: return a + b;
    case RedOp::kProduct: return a * b;
    case RedOp::kMin:
      if constexpr (std::is_floating_point_v<A>) {
        // torch.minimum semantics: NaN wins, whichever side it is on.
        if (std::isnan(a)) return a;
        if (std::isnan(b)) return b;
      }
      return b < a ? b : a;
    case RedOp::kMax:
      if constexpr (std::is_floating_point_v<A>) {
        if (std::isnan(a)) return a;
        if (std::isnan(b)) return b;
      }
      return b > a ? b : a;
  }
  return a;
}

// Blocked so the accumulator stays in L1 while every input streams through once;
// the switch on op is hoisted out of the inner loop so it vectorizes.
template <typename T, RedOp OP>
void reduce_block_loop(T* out, const void* const* inputs, int64_t n, int64_t numel) {
  using A = typename Acc<T>::type;
  constexpr int64_t kBlock = 1024;
  A acc[kBlock];
  for (int64_t base = 0; base < numel; base += kBlock) {
    const int64_t len = std::min(kBlock, numel - base);
    const T* in0 = static_cast<const T*>(inputs[0]) + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<A>(in0[i]);
    for (int64_t k = 1; k < n; ++k) {
      const T* in = static_cast<const T*>(inputs[k]) + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine<A>(acc[i], static_cast<A>(in[i]), OP);
    }
    T* o = out + base;
    for (int64_t i = 0; i < len; ++i) o[i] = static_cast<T>(acc[i]);
  }
}

template <typename T>
void reduce_typed(void* out, const void* const* inputs, int64_t n, int64_t numel, RedOp op) {
  T* o = static_cast<T*>(out);
  switch (op) {
    case RedOp::kSum: return reduce_block_loop<T, RedOp::kSum>(o, inputs, n, numel);
    case RedOp::kProduct: return reduce_block_loop<T, RedOp::kProduct>(o, inputs, n, numel);
    case RedOp::kMin: return reduce_block_loop<T, RedOp::kMin>(o, inputs, n, numel);
    case RedOp::kMax: return reduce_block_loop<T, RedOp::kMax>(o, inputs, n, numel);
  }
  TORCH_CHECK(false, "commlab: unknown reduction op ", static_cast<int64_t>(op));
}

}  // namespace

void reduce_n_raw(void* out, const void* const* inputs, int64_t n_inputs, int64_t numel,
                  c10::ScalarType dtype, RedOp op) {
  TORCH_CHECK(n_inputs >= 1, "commlab: reduce_n needs at least one input");
  if (numel == 0) return;
  switch (dtype) {
    case c10::kFloat: return reduce_typed<float>(out, inputs, n_inputs, numel, op);
    case c10::kDouble: return reduce_typed<double>(out, inputs, n_inputs, numel, op);
    case c10::kHalf: return reduce_typed<c10::Half>(out, inputs, n_inputs, numel, op);
    case c10::kBFloat16: return reduce_typed<c10::BFloat16>(out, inputs, n_inputs, numel, op);
    case c10::kInt: return reduce_typed<int32_t>(out, inputs, n_inputs, numel, op);
    case c10::kLong: return reduce_typed<int64_t>(out, inputs, n_inputs, numel, op);
    case c10::kByte: return reduce_typed<uint8_t>(out, inputs, n_inputs, numel, op);
    default: TORCH_CHECK(false, "commlab: reduce_n does not support dtype ", dtype);
  }
}

void reduce_n_cpu(const torch::Tensor& out, const std::vector<torch::Tensor>& inputs, RedOp op) {
  TORCH_CHECK(!inputs.empty(), "commlab: reduce_n needs at least one input");
  TORCH_CHECK(out.is_contiguous(), "commlab: reduce_n output must be contiguous");
  std::vector<const void*> ptrs;
  ptrs.reserve(inputs.size());
  for (const auto& t : inputs) {
    TORCH_CHECK(t.device().is_cpu(), "commlab: reduce_n input is not on the CPU");
    TORCH_CHECK(t.is_contiguous(), "commlab: reduce_n inputs must be contiguous");
    TORCH_CHECK(t.scalar_type() == out.scalar_type(), "commlab: reduce_n dtype mismatch: ",
                t.scalar_type(), " vs ", out.scalar_type());
    TORCH_CHECK(t.numel() == out.numel(), "commlab: reduce_n size mismatch: ", t.numel(), " vs ",
                out.numel());
    ptrs.push_back(t.data_ptr());
  }
  // Pure computation on buffers we hold references to: let other Python threads run.
  pybind11::gil_scoped_release no_gil;
  reduce_n_raw(out.data_ptr(), ptrs.data(), static_cast<int64_t>(ptrs.size()), out.numel(),
               out.scalar_type(), op);
}

}  // namespace commlab
