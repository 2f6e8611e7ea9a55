// The protocol every collective of the segments speaks: a rank publishes its pieces'
// phases in its sequence word, waits for its peers' (spinning, yielding, then sleeping
// on a futex while it watches for aborts, deaths, frozen heartbeats and signals), and
// compares their records before it reads a byte; a rank that gives up says why in its
// abort line, which every waiter relays.
#include "layout.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include "../../common/errors.h"
#include "../../common/fork.h"
#include "../../common/pause.h"
#include "../../common/signals.h"
#include "../reduce/reduce_n.h"

namespace commlab {

namespace {

const char* op_name(int op) {
  static const char* names[] = {"SUM", "PRODUCT", "MIN", "MAX", "AVG"};
  return op >= 0 && op <= kAvgRecord ? names[op] : "?";
}

const char* mode_name(int mode) {
  static const char* names[] = {"auto", "one-shot", "two-shot", "root"};
  return mode >= 0 && mode < 4 ? names[mode] : "?";
}

const char* kind_name(int kind) {
  static const char* names[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "all_to_all"};
  return kind >= 0 && kind < 6 ? names[kind] : "?";
}

}  // namespace

void ShmComm::publish(uint64_t value) {
  Layout* l = segs_[rank_]->ctl();
  l->seq.seq.store(value, std::memory_order_seq_cst);
  l->wake.word.fetch_add(1, std::memory_order_seq_cst);
  if (l->wake.waiters.load(std::memory_order_seq_cst) != 0) {
    futex(&l->wake.word, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

bool ShmComm::peer_alive(int peer) const {
  const int fd = segs_[peer]->fd;
  if (flock(fd, LOCK_SH | LOCK_NB) == 0) {  // the owner's exclusive lock is gone with it
    flock(fd, LOCK_UN);
    return false;
  }
  return true;  // EWOULDBLOCK: still held (any other error: no evidence of death)
}

// Marks our segment aborted (the first reason wins) and wakes every waiter of every
// segment, so ranks sleeping on any peer look at the abort words at once.
void ShmComm::mark_aborted(uint32_t kind, int64_t cause, const std::string& why) {
  Layout* own = segs_[rank_]->ctl();
  uint32_t expected = 0;
  if (own->abort.claimed.compare_exchange_strong(expected, 1)) {
    const size_t n = std::min<size_t>(why.size(), kReasonBytes - 1);
    std::memcpy(own->abort.reason, why.data(), n);
    own->abort.reason[n] = 0;
    own->abort.finished.store(in_call_ ? calls_ - 1 : calls_, std::memory_order_relaxed);
    own->abort.word.store((static_cast<uint64_t>(kind) << 32) | static_cast<uint64_t>(cause + 1),
                          std::memory_order_release);
  }
  for (auto* s : segs_) {
    Layout* l = s->ctl();
    l->wake.word.fetch_add(1, std::memory_order_seq_cst);
    futex(&l->wake.word, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

[[noreturn]] void ShmComm::fail(uint32_t kind, int64_t lost, const std::string& msg) {
  broken_ = msg;
  failed_peer_ = lost;
  if (kind == kMismatch) throw MismatchError(msg);
  throw PeerLostError(msg);
}

[[noreturn]] void ShmComm::give_up(uint32_t kind, int64_t cause, const std::string& why) {
  mark_aborted(kind, cause, why);
  fail(kind, cause, why);
}

[[noreturn]] void ShmComm::relay(int peer) {
  const AbortLine& a = segs_[peer]->ctl()->abort;
  const uint64_t w = a.word.load(std::memory_order_acquire);
  const uint32_t kind = static_cast<uint32_t>(w >> 32);
  const int64_t cause = static_cast<int64_t>(w & 0xffffffffull) - 1;
  const std::string reason(a.reason, strnlen(a.reason, kReasonBytes));
  std::string msg = reason;
  if (kind != kMismatch) {
    msg = "commlab shm: rank " + std::to_string(global_ranks_[rank_]) + " stopped because rank " +
          std::to_string(global_ranks_[peer]) + " gave up: " + reason;
  }
  // Pass the original reason on: ranks that wait on this one learn the first cause.
  mark_aborted(kind, cause, reason);
  fail(kind, cause >= 0 ? cause : global_ranks_[peer], msg);
}

void ShmComm::check_aborts() {
  for (int j = 0; j < world_; ++j) {
    if (j != rank_ && segs_[j]->ctl()->abort.word.load(std::memory_order_acquire) != 0) relay(j);
  }
}

void ShmComm::check_signals() {
  auto raised = pending_signal();
  if (!raised) return;
  // A handler raised (KeyboardInterrupt on Ctrl-C): tell the peers, then let it out.
  const std::string why = "commlab shm: rank " + std::to_string(global_ranks_[rank_]) +
                          " was interrupted by a signal (its handler raised " + std::string(raised->what()).substr(0, 80) +
                          ")";
  mark_aborted(kInterrupted, global_ranks_[rank_], why);
  broken_ = why;
  throw *raised;
}

[[noreturn]] void ShmComm::fail_wait(int peer, uint64_t target, uint32_t kind, const char* why) {
  const Layout* l = segs_[peer]->ctl();
  const uint64_t seen = l->seq.seq.load();
  std::ostringstream msg;
  msg << "commlab shm: rank " << global_ranks_[rank_] << " waited for rank " << global_ranks_[peer] << " (pid "
      << l->header.pid << ", " << (kind == kDead ? "dead" : kind == kFrozen ? "frozen" : "alive") << "): " << why
      << "; it reached piece "
      << (seen >> 2) << " phase " << (seen & 3) << ", this rank needs piece " << (target >> 2) << " phase "
      << (target & 3);
  give_up(kind, global_ranks_[peer], msg.str());
}

void ShmComm::wait_for(int peer, uint64_t target) {
  wait_seq(peer, target);
  // A peer that gave up in this call after publishing what we need fails it here too, so
  // the ranks end alike whenever they can see it (one load of a line that rarely
  // changes). One that gave up in a later call completed this one: so do we.
  const AbortLine& a = segs_[peer]->ctl()->abort;
  if (a.word.load(std::memory_order_acquire) != 0 && a.finished.load(std::memory_order_relaxed) < calls_) relay(peer);
}

void ShmComm::wait_seq(int peer, uint64_t target) {
  Layout* l = segs_[peer]->ctl();
  auto& seq = l->seq.seq;
  // A short spin catches peers that are running right now; beyond it, sleep on the
  // futex: with more ranks than cores a spinning waiter steals the core its peer needs.
  for (int i = 0; i < spin_; ++i) {
    if (seq.load(std::memory_order_acquire) >= target) return;
    cpu_relax();
  }
  // Then yield for a while (a cheap poll where every rank has a core; commlab/shm.py
  // turns it off where ranks outnumber cores, and says why). Past that, sleep.
  if (yield_us_ > 0) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(yield_us_);
    do {
      for (int k = 0; k < 16; ++k) {
        if (seq.load(std::memory_order_acquire) >= target) return;
        sched_yield();
      }
    } while (std::chrono::steady_clock::now() < until);
  }
  const int64_t start = now_ms();
  const int64_t deadline = start + timeout_ms_;
  int64_t next_probe = start + kLivenessMs;
  uint64_t beats = l->beat.beats.load(std::memory_order_relaxed);
  int64_t beat_seen = start;
  int64_t next_signal_check = start + kSignalCheckMs;
  while (true) {
    const uint32_t word = l->wake.word.load(std::memory_order_seq_cst);
    l->wake.waiters.fetch_add(1, std::memory_order_seq_cst);
    if (seq.load(std::memory_order_seq_cst) >= target) {
      l->wake.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    const int64_t left = deadline - now_ms();
    if (left <= 0) {
      l->wake.waiters.fetch_sub(1, std::memory_order_seq_cst);
      check_aborts();
      fail_wait(peer, target, kTimeout, "timed out");
    }
    const int64_t slice = std::min<int64_t>(left, kSliceMs);
    struct timespec ts{static_cast<time_t>(slice / 1000), static_cast<long>((slice % 1000) * 1000000)};
    const bool interrupted = futex(&l->wake.word, FUTEX_WAIT, word, &ts) != 0 && errno == EINTR;
    l->wake.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (seq.load(std::memory_order_acquire) >= target) return;
    check_aborts();
    const int64_t now = now_ms();
    // Taking the GIL on every wake-up would tax every small call: a signal that reached
    // this thread interrupts the sleep, one that reached another is seen within 20 ms.
    if (interrupted || now >= next_signal_check) {
      next_signal_check = now + kSignalCheckMs;
      check_signals();
    }
    if (now >= next_probe) {
      next_probe = now + kLivenessMs;
      if (!peer_alive(peer)) {
        // It may have published what we wait for just before it exited (its last call).
        if (seq.load(std::memory_order_acquire) >= target) return;
        fail_wait(peer, target, kDead, "its process died or closed the communicator");
      }
      const uint64_t b = l->beat.beats.load(std::memory_order_relaxed);
      if (b != beats) {
        beats = b;
        beat_seen = now;
      } else if (peer_timeout_ms_ > 0 && now - beat_seen >= peer_timeout_ms_) {
        if (seq.load(std::memory_order_acquire) >= target) return;
        const std::string why = "stopped responding: no heartbeat for " + std::to_string((now - beat_seen) / 1000) +
                                " s (its process is frozen: stopped, in a debugger, or its host hangs)";
        fail_wait(peer, target, kFrozen, why.c_str());
      }
    }
  }
}

// Records piece c of `call` and announces it (kWritten, or a later phase that implies it):
// the caller copied its data first.
void ShmComm::begin(uint64_t c, const Call& call, int64_t index, int64_t nbytes, uint64_t phase) {
  CallInfo& ci = segs_[rank_]->ctl()->info[c & 1];
  // The sequence first: a reader that saw the record change under it sees this change.
  __atomic_store_n(&ci.piece_seq, c, __ATOMIC_RELAXED);
  std::atomic_thread_fence(std::memory_order_release);
  ci.call = calls_;
  ci.total = call.total;
  ci.index = index;
  ci.nbytes = nbytes;
  ci.dtype = call.dtype;
  ci.op = call.op;
  ci.mode = call.mode;
  ci.kind = call.kind;
  ci.root = call.root;
  publish(at(c, phase));
}

// Waits for `peer` to reach piece c, phase `phase`, having checked its record first: a
// peer in another collective never publishes our kReady, but always its kWritten.
// `peer_may_be_past`: where a peer may leave piece c before we check it (the broadcast's
// receivers wait for the root only) and write this record slot again, a peer past c
// compared its record with ours before it left.
void ShmComm::await_checked(int peer, uint64_t c, uint64_t phase, bool peer_may_be_past) {
  wait_for(peer, at(c, kWritten));
  check_info(peer, c, peer_may_be_past);
  if (phase > kWritten) wait_for(peer, at(c, phase));
}

void ShmComm::check_info(int peer, uint64_t piece_seq, bool peer_may_be_past) {
  const CallInfo& mine = segs_[rank_]->ctl()->info[piece_seq & 1];
  const CallInfo& theirs = segs_[peer]->ctl()->info[piece_seq & 1];
  if (theirs.piece_seq == mine.piece_seq && theirs.call == mine.call && theirs.total == mine.total &&
      theirs.index == mine.index && theirs.nbytes == mine.nbytes && theirs.dtype == mine.dtype &&
      theirs.op == mine.op && theirs.mode == mine.mode && theirs.kind == mine.kind && theirs.root == mine.root) {
    return;
  }
  if (peer_may_be_past) {
    std::atomic_thread_fence(std::memory_order_acquire);
    if (__atomic_load_n(&theirs.piece_seq, __ATOMIC_RELAXED) > piece_seq) return;
  }
  auto describe = [](std::ostringstream& out, int64_t rank, const CallInfo& ci) {
    out << "rank " << rank << ": call " << ci.call << " " << kind_name(ci.kind);
    if (ci.kind == kBarrier) return;
    if (ci.index == kRecordIndex) {  // a point-to-point call's record: elements, and no piece
      out << " of " << ci.total << " " << c10::toString(static_cast<c10::ScalarType>(ci.dtype))
          << " by a point-to-point algorithm";
      return;
    }
    if (ci.kind == kAllToAll) {  // sizes per peer: compared through the splits, not the record
      out << " of " << c10::toString(static_cast<c10::ScalarType>(ci.dtype));
      // total: the block size from which the rank reads its peers' memory in one copy (-1: never)
      if (ci.total >= 0) out << ", one copy from " << ci.total << " bytes";
      out << " (piece " << ci.index << ")";
      return;
    }
    out << " of " << ci.total << " bytes of " << c10::toString(static_cast<c10::ScalarType>(ci.dtype));
    if (ci.kind == kAllReduce || ci.kind == kReduceScatter) out << ", op " << op_name(ci.op);
    if (ci.kind == kAllReduce) out << ", " << mode_name(ci.mode);
    if (ci.kind == kBroadcast) out << " from rank " << ci.root;
    out << " (piece " << ci.index << ", " << ci.nbytes << " bytes)";
  };
  // Both records in rank order: ranks that find the same difference report it alike.
  const bool me_first = global_ranks_[rank_] < global_ranks_[peer];
  std::ostringstream msg;
  msg << "commlab shm: mismatch: ranks called ";
  if (mine.kind == theirs.kind) msg << kind_name(mine.kind) << " differently: ";
  else msg << "different collectives: ";
  describe(msg, me_first ? global_ranks_[rank_] : global_ranks_[peer], me_first ? mine : theirs);
  msg << "; ";
  describe(msg, me_first ? global_ranks_[peer] : global_ranks_[rank_], me_first ? theirs : mine);
  give_up(kMismatch, global_ranks_[peer], msg.str());
}

// A call with nothing to move still takes part in the check: its record is published
// and compared with every peer's, as a barrier's is, so a peer with data meets a
// mismatch instead of waiting for a piece that never comes.
void ShmComm::record_only(const Call& call) {
  guarded([&] {
    const uint64_t c = ++seq_;
    begin(c, call, 0, 0);
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) await_checked(j, c, kWritten);
    }
  });
}

void ShmComm::abort(const std::string& why, bool mismatch) {
  check_usable();
  mark_aborted(mismatch ? kMismatch : kError, global_ranks_[rank_], why);
  broken_ = why;
}

void ShmComm::barrier() {
  check_usable();
  if (world_ == 1) return;
  guarded([&] {
    const uint64_t c = ++seq_;
    begin(c, Call{kBarrier, 0, -1, -1, -1, -1}, 0, 0);
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) await_checked(j, c, kWritten);
    }
  });
}

}  // namespace commlab
