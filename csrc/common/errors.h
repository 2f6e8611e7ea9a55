// The failures a collective reports on every rank, as distinct C++ types so Python
// maps them onto commlab's exceptions by type, never by parsing a message.
#pragma once

#include <stdexcept>
#include <string>

namespace commlab {

// The ranks entered one collective differently (size, dtype, op, mode, call order).
struct MismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A peer was lost: it died, missed the deadline, was interrupted, or gave up itself.
struct PeerLostError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A communicator used by a process forked after it was created: the child must not
// touch its parent's shared state.
struct ForkedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace commlab
