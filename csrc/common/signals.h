// Python signal handlers while a thread waits in C++ (Ctrl-C's KeyboardInterrupt): the
// transports' waits poll this so an interrupt ends a wait within milliseconds.
#pragma once

#include <pybind11/pybind11.h>  // torch is not needed here: the GIL and Python's errors only

#include <memory>

namespace commlab {

// The exception a Python signal handler raised since the last check, to rethrow after
// telling the peers; null when none. Python runs handlers on the main thread only, so
// other threads get null at once without taking the GIL.
std::unique_ptr<pybind11::error_already_set> pending_signal();

}  // namespace commlab
