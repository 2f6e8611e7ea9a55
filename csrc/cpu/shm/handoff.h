// One cache line handed back and forth between two processes: the latency floor under
// any shared-memory collective (a peer can act on data no sooner than it sees a flag).
#pragma once

#include <cstdint>
#include <string>

namespace commlab {

// Ping-pong `iters` times through a fresh POSIX shared-memory segment `name` (the
// initiator creates it 0600, the responder opens it, the initiator unlinks it once both
// mapped). Waiters spin with pause, and also yield each round when `yield` (ranks
// outnumber cores: the peer may need this very core). Returns the initiator's wall time
// for all round trips in ns (0 for the responder); throws after timeout_ms without the peer.
int64_t handoff_pingpong_ns(const std::string& name, bool initiator, int64_t iters, bool yield, int64_t timeout_ms);

// The best time, in ns, of one memcpy of nbytes between two cache-hot buffers (best
// batch of iters copies): the least any all-reduce spends writing its result.
double hot_copy_ns(int64_t nbytes, int64_t iters);

}  // namespace commlab
