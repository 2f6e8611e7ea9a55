#include "reduce_n.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../../common/torch_codes.h"
#include "isa.h"

namespace commlab {
namespace baseline {
namespace {
inline float h2f(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline uint16_t f2h(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
}  // namespace
#include "reduce_impl.inc"
}  // namespace baseline

namespace {

using ReduceFn = bool (*)(void*, const void* const*, int64_t, int64_t, DType, RedOp);

struct Level {
  const char* name;
  ReduceFn fn;
  bool (*supported)();
};

bool always() { return true; }
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() { return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl"); }

const Level kLevels[] = {
    {"scalar", &baseline::reduce, &always},
    {"avx2", &avx2::reduce, &has_avx2},
    {"avx512", &avx512::reduce, &has_avx512},
};
constexpr int kNumLevels = sizeof(kLevels) / sizeof(kLevels[0]);

// The default is AVX2 even where AVX-512 exists: measured no faster for this
// memory-bound loop, and 512-bit code lowers the clock on some parts
// (bench/test_bench_kernels.py compares them).
int default_level() {
  if (const char* env = std::getenv("COMMLAB_SIMD")) {
    for (int i = 0; i < kNumLevels; ++i)
      if (std::strcmp(env, kLevels[i].name) == 0 && kLevels[i].supported()) return i;
  }
  return has_avx2() ? 1 : 0;
}

std::atomic<int> g_level{-1};

int level() {
  int l = g_level.load(std::memory_order_relaxed);
  if (l < 0) {
    l = default_level();
    g_level.store(l, std::memory_order_relaxed);
  }
  return l;
}

}  // namespace

std::string simd_level() { return kLevels[level()].name; }

std::vector<std::string> simd_levels() {
  std::vector<std::string> out;
  for (const auto& l : kLevels)
    if (l.supported()) out.emplace_back(l.name);
  return out;
}

void set_simd_level(const std::string& name) {
  for (int i = 0; i < kNumLevels; ++i) {
    if (name == kLevels[i].name) {
      TORCH_CHECK(kLevels[i].supported(), "commlab: this CPU does not support ", name);
      g_level.store(i);
      return;
    }
  }
  TORCH_CHECK(false, "commlab: unknown SIMD level '", name, "' (scalar, avx2, avx512)");
}

void reduce_n_raw(void* out, const void* const* inputs, int64_t n_inputs, int64_t numel,
                  c10::ScalarType dtype, RedOp op) {
  TORCH_CHECK(n_inputs >= 1, "commlab: reduce_n needs at least one input");
  if (numel == 0) return;
  const int code = dtype_code(dtype);
  TORCH_CHECK(code >= 0, "commlab: reduce_n does not support dtype ", dtype);
  kLevels[level()].fn(out, inputs, n_inputs, numel, static_cast<DType>(code), op);
}

void reduce_n_cpu(const at::Tensor& out, const std::vector<at::Tensor>& inputs, RedOp op) {
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
  TORCH_CHECK(dtype_code(out.scalar_type()) >= 0, "commlab: reduce_n does not support dtype ",
              out.scalar_type());
  // Pure computation on buffers we hold references to: let other Python threads run.
  pybind11::gil_scoped_release no_gil;
  reduce_n_raw(out.data_ptr(), ptrs.data(), static_cast<int64_t>(ptrs.size()), out.numel(),
               out.scalar_type(), op);
}

}  // namespace commlab
