// The shared-memory layout every rank's segment follows, and the private types of
// ShmComm: the protocol (shm_comm.cpp) and the point-to-point call records
// (records.cpp) both read it. Internal to commlab._C.
#pragma once

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <optional>
#include <string>

#include "../../common/errors.h"
#include "shm_comm.h"

namespace commlab {
namespace shm_layout {

constexpr uint64_t kMagic = 0x31424c4d4d4f43ull;  // "COMMLB1"
constexpr uint32_t kVersion = 7;
constexpr int64_t kDataOffset = 4096;
constexpr int kReasonBytes = 1024;
constexpr int64_t kSliceMs = 50;     // longest futex sleep: bounds how late a signal or a death is seen
constexpr int64_t kLivenessMs = 100;  // how often a sleeping waiter probes the awaited peer
constexpr int64_t kSignalCheckMs = 20;  // how often a sleeping waiter asks Python for pending signals
constexpr int64_t kBeatMs = 250;        // how often a process's heart beats in its segments

struct alignas(64) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t world;
  uint32_t rank;
  uint32_t uid;
  uint64_t capacity;
  int64_t pid;
  uint64_t self_addr;  // this header's address in its owner's process: what a single-copy probe reads
  char token[33];
};

struct alignas(64) SeqLine {
  std::atomic<uint64_t> seq;
};

struct alignas(64) WakeLine {
  std::atomic<uint32_t> word;     // bumped on every publish and abort; futex waits on it
  std::atomic<uint32_t> waiters;  // publishers skip the wake syscall when zero
};

// The whole call a piece belongs to, by piece parity: peers compare it before reading,
// so a piece never pairs with a piece of another call. Its kind is a CallKind
// (common/codes.h); index kRecordIndex marks a point-to-point call's record (records.cpp).
constexpr int64_t kRecordIndex = -1;

struct alignas(64) CallInfo {
  uint64_t piece_seq;
  uint64_t call;
  int64_t total;  // bytes of the whole call (all-gather: per rank; reduce-scatter: per rank's whole input)
  int64_t index;  // piece index within the call
  int64_t nbytes;
  int32_t dtype;
  int32_t op;
  int32_t mode;
  int32_t kind;
  int32_t root;
  uint64_t addr;  // single-copy calls: the caller's buffer, in its own process (not compared)
};

// Why a rank gave up, set once: kind << 32 | (global rank of the cause + 1). The reason
// text is written before the word is published, so a reader that sees the word reads it.
enum AbortKind : uint32_t { kTimeout = 1, kDead = 2, kMismatch = 3, kInterrupted = 4, kError = 5, kFrozen = 6 };
struct alignas(64) AbortLine {
  std::atomic<uint32_t> claimed;
  std::atomic<uint64_t> word;
  // Calls the rank had completed when it gave up (written before the word): a peer still
  // finishing one of those completes it too, and meets the abort in its next call.
  std::atomic<uint64_t> finished;
  char reason[kReasonBytes];
};

// Bumped by a thread of the owner's process while it lives and runs: a peer whose lock
// is held (alive) but whose counter stands still is frozen (SIGSTOP, a debugger, a hung
// host under a VM), which neither the lock nor a socket ever shows.
struct alignas(64) BeatLine {
  std::atomic<uint64_t> beats;
};

struct Layout {
  Header header;
  SeqLine seq;
  WakeLine wake;
  AbortLine abort;
  CallInfo info[2];
  BeatLine beat;
};
static_assert(sizeof(Layout) <= kDataOffset, "control block must fit before the data");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics in shared memory");

inline long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const struct timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

inline int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

}  // namespace shm_layout

using namespace shm_layout;

// What every piece of a call records (CallInfo less the per-piece fields).
struct ShmComm::Call {
  int32_t kind;
  int64_t total;
  int32_t dtype;
  int32_t op;
  int32_t mode;
  int32_t root;
};

// A segment stays open as well as mapped: the owner holds an exclusive flock on it for
// its lifetime and peers probe that lock to learn whether the owner is gone. Unlike a
// pid, a lock means the same in every PID namespace and cannot be reused.
struct ShmComm::Segment {
  std::string name;
  void* base = nullptr;
  size_t size = 0;
  int fd = -1;
  Layout* ctl() const { return static_cast<Layout*>(base); }
  char* data(int parity, int64_t capacity) const {
    return static_cast<char*>(base) + kDataOffset + parity * capacity;
  }
};

// Runs a call's pieces without the GIL (with it where the call never waits: giving it
// up and taking it back costs more than such a call). Anything but a protocol failure
// mid-call still leaves peers waiting on this rank: tell them.
template <class Body>
void ShmComm::guarded(Body&& body, bool may_wait) {
  ++calls_;
  in_call_ = true;
  struct Leave {
    bool& flag;
    ~Leave() { flag = false; }
  } leave{in_call_};
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (may_wait) no_gil.emplace();
  try {
    if (unsynced_ && may_wait) settle();
    body();
  } catch (const MismatchError&) {
    throw;
  } catch (const PeerLostError&) {
    throw;
  } catch (const pybind11::error_already_set&) {
    throw;
  } catch (const std::exception& e) {
    const std::string why = "commlab shm: rank " + std::to_string(global_ranks_[rank_]) + " failed: " + e.what();
    mark_aborted(kError, global_ranks_[rank_], why);
    broken_ = why;
    throw;
  }
}

}  // namespace commlab
