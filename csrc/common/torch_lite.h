// What commlab's C++ needs from torch outside its Python bindings (module.cpp): the
// Tensor type with its checks, and pybind11 for the GIL and Python's errors.
// torch/extension.h brings the whole C++ frontend: ~15 s more to compile per file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
