// Fork detection: a child process gets a copy of every communicator, mapped onto its
// parent's shared memory. Objects remember the generation they were built under and
// refuse to run in a child (a different generation) before touching anything shared.
#pragma once

#include <cstdint>

namespace commlab {

// 0 in the process that loaded commlab._C; bumped in each child right after fork().
uint64_t fork_generation();

}  // namespace commlab
