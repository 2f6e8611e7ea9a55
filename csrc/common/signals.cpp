#include "signals.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace commlab {

std::unique_ptr<pybind11::error_already_set> pending_signal() {
  thread_local const bool main_thread = syscall(SYS_gettid) == getpid();  // the main thread's tid is the pid
  if (!main_thread) return nullptr;
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return nullptr;
  return std::make_unique<pybind11::error_already_set>();
}

}  // namespace commlab
