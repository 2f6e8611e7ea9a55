// Python bindings of commlab._C. The CUDA entry points exist only when setup.py
// compiled csrc/cuda (COMMLAB_WITH_CUDA); `has_cuda()` tells Python which build it got.
#include <torch/extension.h>

#include "cpu/reduce_n.h"

namespace commlab {
#ifdef COMMLAB_WITH_CUDA
void reduce_n_cuda(const torch::Tensor& out, const std::vector<torch::Tensor>& inputs, RedOp op);
#endif

namespace {

void reduce_n(const torch::Tensor& out, const std::vector<torch::Tensor>& inputs, int64_t op) {
  TORCH_CHECK(op >= 0 && op <= 3, "commlab: reduce_n op code must be 0..3, got ", op);
  const auto rop = static_cast<RedOp>(op);
  if (out.is_cuda()) {
#ifdef COMMLAB_WITH_CUDA
    reduce_n_cuda(out, inputs, rop);
    return;
#else
    TORCH_CHECK(false, "commlab._C was built without CUDA");
#endif
  }
  reduce_n_cpu(out, inputs, rop);
}

bool has_cuda() {
#ifdef COMMLAB_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace commlab

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "commlab native kernels and transports";
  m.def("version", [] { return std::string(COMMLAB_VERSION); }, "commlab._C build version");
  m.def("has_cuda", &commlab::has_cuda, "whether CUDA sources were compiled in");
  m.def("reduce_n", &commlab::reduce_n, pybind11::arg("out"), pybind11::arg("inputs"),
        pybind11::arg("op"),
        "out = inputs[0] op inputs[1] op ... in that order (op codes: 0 sum, 1 product, 2 min, 3 max)");
}
