#include "shm_comm.h"
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

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const struct timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

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

// One thread per process beats every live communicator's own segment. Plain C++, no
// GIL: it beats while the main thread computes, waits or holds the GIL; it stops only
// when the whole process does.
class Heart {
 public:
  static Heart& get() {
    static Heart* heart = new Heart();  // never destroyed: its thread outlives static destructors
    return *heart;
  }
  void add(std::atomic<uint64_t>* beats) {
    std::lock_guard<std::mutex> hold(mu_);
    if (!running_) {
      running_ = true;
      std::thread([this] { loop(); }).detach();
    }
    beating_.push_back(beats);
  }
  void remove(std::atomic<uint64_t>* beats) {
    std::lock_guard<std::mutex> hold(mu_);
    beating_.erase(std::remove(beating_.begin(), beating_.end(), beats), beating_.end());
  }

 private:
  Heart() {
    // A child of fork() has no heart thread and may inherit the lock held: it starts
    // afresh (its copies of the parent's communicators refuse to run anyway).
    pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); },
                   [] {
                     Heart& h = get();
                     h.running_ = false;
                     h.beating_.clear();
                     h.mu_.unlock();
                   });
  }
  void loop() {
    while (true) {
      {
        std::lock_guard<std::mutex> hold(mu_);
        for (auto* b : beating_) b->fetch_add(1, std::memory_order_relaxed);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(kBeatMs));
    }
  }
  std::mutex mu_;
  bool running_ = false;
  std::vector<std::atomic<uint64_t>*> beating_;
};

}  // namespace

std::string ShmComm::segment_name(int64_t rank) const {
  return "/commlab-" + token_ + "-" + std::to_string(rank);
}

int64_t ShmComm::unlink_names(const std::string& token_hex, int64_t world) {
  TORCH_CHECK(token_hex.size() == 32, "commlab shm: token must be 32 hex characters");
  int64_t removed = 0;
  for (int64_t r = 0; r < world; ++r) {
    const std::string name = "/commlab-" + token_hex + "-" + std::to_string(r);
    if (shm_unlink(name.c_str()) == 0) ++removed;
  }
  return removed;
}

ShmComm::ShmComm(const std::string& token_hex, int64_t rank, int64_t world, int64_t capacity,
                 int64_t timeout_ms, std::vector<int64_t> global_ranks)
    : token_(token_hex),
      rank_(static_cast<int>(rank)),
      world_(static_cast<int>(world)),
      capacity_(capacity),
      timeout_ms_(timeout_ms),
      // Conservative until commlab/shm.py sets the tuned values (and their knobs) per group.
      oneshot_max_(0),
      spin_(0),
      yield_us_(0),
      fork_generation_(fork_generation()),
      global_ranks_(std::move(global_ranks)) {
  TORCH_CHECK(token_.size() == 32, "commlab shm: token must be 32 hex characters");
  TORCH_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "commlab shm: bad rank/world");
  TORCH_CHECK(capacity_ >= 4096 && capacity_ % 64 == 0, "commlab shm: capacity must be a multiple of 64, >= 4096");
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == world_, "commlab shm: need one global rank per rank");
  segs_.assign(world_, nullptr);
  ptrs_.assign(world_, nullptr);

  auto* own = new Segment();
  own->name = segment_name(rank_);
  own->size = static_cast<size_t>(kDataOffset + 2 * capacity_);
  int fd = shm_open(own->name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    const std::string msg = errno_text("commlab shm: cannot create " + own->name);
    delete own;
    throw std::runtime_error(msg);
  }
  // Reserve the pages now: a full /dev/shm fails here with a message, not with SIGBUS
  // in the middle of a collective.
  int rc = ftruncate(fd, static_cast<off_t>(own->size));
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(own->size));
  if (rc != 0) {
    int err = rc > 0 ? rc : errno;
    ::close(fd);
    shm_unlink(own->name.c_str());
    delete own;
    std::ostringstream msg;
    msg << "commlab shm: cannot reserve " << (kDataOffset + 2 * capacity_) << " bytes in /dev/shm ("
        << std::strerror(err) << "); free space there or lower COMMLAB_SHM_CAPACITY";
    throw std::runtime_error(msg.str());
  }
  own->base = mmap(nullptr, own->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (own->base == MAP_FAILED || flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const std::string msg = errno_text(own->base == MAP_FAILED ? "commlab shm: mmap of own segment failed"
                                                               : "commlab shm: cannot lock own segment");
    if (own->base != MAP_FAILED) munmap(own->base, own->size);
    ::close(fd);
    shm_unlink(own->name.c_str());
    delete own;
    throw std::runtime_error(msg);
  }
  own->fd = fd;
  Layout* l = own->ctl();
  l->seq.seq.store(0);
  l->wake.word.store(0);
  l->wake.waiters.store(0);
  l->abort.claimed.store(0);
  l->abort.word.store(0);
  std::memset(l->abort.reason, 0, sizeof(l->abort.reason));
  std::memset(l->info, 0, sizeof(l->info));
  l->beat.beats.store(0);
  Header& h = l->header;
  h.version = kVersion;
  h.world = static_cast<uint32_t>(world_);
  h.rank = static_cast<uint32_t>(rank_);
  h.uid = static_cast<uint32_t>(geteuid());
  h.capacity = static_cast<uint64_t>(capacity_);
  h.pid = static_cast<int64_t>(getpid());
  h.self_addr = reinterpret_cast<uint64_t>(&h);
  std::memcpy(h.token, token_.c_str(), 33);
  // The magic goes last: a reader that sees it sees a complete header.
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&h.magic)->store(kMagic, std::memory_order_release);
  segs_[rank_] = own;
  Heart::get().add(&l->beat.beats);
}

void ShmComm::attach() {
  for (int j = 0; j < world_; ++j) {
    if (segs_[j]) continue;
    auto* s = new Segment();
    s->name = segment_name(j);
    s->size = static_cast<size_t>(kDataOffset + 2 * capacity_);
    int fd = shm_open(s->name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      std::string msg = errno_text("commlab shm: cannot open rank " + std::to_string(global_ranks_[j]) +
                                   "'s segment " + s->name);
      delete s;
      throw std::runtime_error(msg);
    }
    struct stat st;
    std::string bad;
    if (fstat(fd, &st) != 0) bad = errno_text("fstat");
    else if (st.st_uid != geteuid()) bad = "owned by another user";
    else if ((st.st_mode & 0777) != 0600) bad = "mode is not 0600";
    else if (static_cast<size_t>(st.st_size) != s->size) bad = "unexpected size " + std::to_string(st.st_size);
    if (bad.empty()) {
      s->base = mmap(nullptr, s->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      if (s->base == MAP_FAILED) {
        s->base = nullptr;
        bad = errno_text("mmap");
      }
    }
    if (bad.empty()) {
      const Header& h = s->ctl()->header;
      const uint64_t magic = reinterpret_cast<const std::atomic<uint64_t>*>(&h.magic)->load(std::memory_order_acquire);
      if (magic != kMagic) bad = "bad magic";
      else if (h.version != kVersion) bad = "version " + std::to_string(h.version);
      else if (h.world != static_cast<uint32_t>(world_) || h.rank != static_cast<uint32_t>(j)) bad = "rank/world mismatch";
      else if (h.capacity != static_cast<uint64_t>(capacity_)) bad = "capacity mismatch";
      else if (std::memcmp(h.token, token_.c_str(), 33) != 0) bad = "token mismatch";
      else if (h.uid != static_cast<uint32_t>(geteuid())) bad = "header uid mismatch";
    }
    if (!bad.empty()) {
      if (s->base) munmap(s->base, s->size);
      ::close(fd);
      std::string msg = "commlab shm: refusing rank " + std::to_string(global_ranks_[j]) + "'s segment " + s->name +
                        ": " + bad + " (forged, stale or foreign)";
      delete s;
      throw std::runtime_error(msg);
    }
    s->fd = fd;
    segs_[j] = s;
  }
}

void ShmComm::unlink_own() {
  if (!own_unlinked_ && segs_[rank_]) {
    shm_unlink(segs_[rank_]->name.c_str());
    own_unlinked_ = true;
  }
}

bool ShmComm::probe_single_copy() {
  // The whole header read out of each peer's own process must equal our mapping of it: a
  // pid of another namespace, a refused ptrace check or a kernel without the call all fail.
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const Header& h = segs_[j]->ctl()->header;
    Header copy;
    struct iovec local{&copy, sizeof(copy)};
    struct iovec remote{reinterpret_cast<void*>(h.self_addr), sizeof(copy)};
    const ssize_t n = process_vm_readv(static_cast<pid_t>(h.pid), &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof(copy)) || std::memcmp(&copy, &h, sizeof(copy)) != 0) return false;
  }
  return true;
}

// Reads nbytes at `addr` in `peer`'s process into dst, in one copy.
void ShmComm::read_peer(int peer, char* dst, uint64_t addr, int64_t nbytes) {
  const pid_t pid = static_cast<pid_t>(segs_[peer]->ctl()->header.pid);
  int64_t done = 0;
  while (done < nbytes) {
    struct iovec local{dst + done, static_cast<size_t>(nbytes - done)};
    struct iovec remote{reinterpret_cast<void*>(addr + done), static_cast<size_t>(nbytes - done)};
    const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      if (err == EINTR) continue;
      const bool dead = err == ESRCH || !peer_alive(peer);
      std::ostringstream msg;
      msg << "commlab shm: rank " << global_ranks_[rank_] << " could not read rank " << global_ranks_[peer]
          << "'s buffer (" << std::strerror(err) << ")" << (dead ? ": its process died" : "");
      give_up(dead ? kDead : kError, global_ranks_[dead ? peer : rank_], msg.str());
    }
    done += n;
  }
}

void ShmComm::close() {
  // A forked child holds copies of its parent's names and locks: it only lets go of its
  // own mappings and descriptors (closing a copy does not release the parent's lock).
  if (fork_generation_ == fork_generation()) unlink_own();
  if (segs_[rank_]) Heart::get().remove(&segs_[rank_]->ctl()->beat.beats);
  for (auto*& s : segs_) {
    if (s) {
      if (s->base) munmap(s->base, s->size);
      if (s->fd >= 0) ::close(s->fd);
      delete s;
      s = nullptr;
    }
  }
}

ShmComm::~ShmComm() { close(); }

void ShmComm::check_usable() const {
  if (fork_generation_ != fork_generation()) {
    std::ostringstream msg;
    msg << "commlab shm: this process (pid " << getpid() << ") was forked from the process that set up this group's "
        << "shared memory; a forked child cannot take part in its parent's collectives (create a process group in "
        << "the child)";
    throw ForkedError(msg.str());
  }
  for (int j = 0; j < world_; ++j) {
    if (segs_[j] == nullptr) throw std::runtime_error("commlab shm: not attached (or closed)");
  }
  if (!broken_.empty()) throw std::runtime_error("commlab shm: unusable after an earlier failure: " + broken_);
}

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

// Records piece c of `call` and announces it (phase 1, or a later phase that implies it):
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
  publish(c * 4 + phase);
}

// Waits for `peer` to reach piece c, phase `phase`, having checked its record first: a
// peer in another collective never publishes our phase 2, but always its phase 1.
// `peer_may_be_past`: where a peer may leave piece c before we check it (the broadcast's
// receivers wait for the root only) and write this record slot again, a peer past c
// compared its record with ours before it left.
void ShmComm::await_checked(int peer, uint64_t c, uint64_t phase, bool peer_may_be_past) {
  wait_for(peer, c * 4 + 1);
  check_info(peer, c, peer_may_be_past);
  if (phase > 1) wait_for(peer, c * 4 + phase);
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
      out << " of " << c10::toString(static_cast<c10::ScalarType>(ci.dtype)) << " (piece " << ci.index << ")";
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

void ShmComm::piece(char* dst, const char* src, int64_t total, int64_t index, int64_t nbytes, int64_t elsize,
                    c10::ScalarType dtype, int op, ShmMode mode) {
  const uint64_t c = ++seq_;
  const int par = static_cast<int>(c & 1);
  const int64_t count = nbytes / elsize;
  const void** ptrs = ptrs_.data();

  std::memcpy(segs_[rank_]->data(par, capacity_), src, nbytes);
  begin(c, Call{kAllReduce, total, static_cast<int32_t>(dtype), op, static_cast<int32_t>(mode), -1}, index, nbytes);

  if (mode == ShmMode::kOneShot) {
    // Every rank reduces everything, in rank order: identical bits on every rank.
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) {
        await_checked(j, c, 1);
      }
      ptrs[j] = segs_[j]->data(par, capacity_);
    }
    reduce_n_raw(dst, ptrs, world_, count, dtype, reduction_of(op));
    return;
  }

  if (mode == ShmMode::kRoot) {
    if (rank_ == 0) {
      for (int j = 1; j < world_; ++j) {
        await_checked(j, c, 1);
      }
      for (int j = 0; j < world_; ++j) ptrs[j] = segs_[j]->data(par, capacity_);
      char* result = segs_[0]->data(par, capacity_);
      reduce_n_raw(result, ptrs, world_, count, dtype, reduction_of(op));
      publish(c * 4 + 2);
      std::memcpy(dst, result, nbytes);
    } else {
      await_checked(0, c, 2);
      std::memcpy(dst, segs_[0]->data(par, capacity_), nbytes);
    }
    return;
  }

  // Two-shot: rank r reduces its 1/p slice from every segment into its own segment,
  // then everyone copies every reduced slice out.
  auto slice = [&](int j, int64_t* off, int64_t* len) {
    const int64_t base = count / world_, extra = count % world_;
    const int64_t start = j * base + std::min<int64_t>(j, extra);
    *off = start * elsize;
    *len = (base + (j < extra ? 1 : 0)) * elsize;
  };
  for (int j = 0; j < world_; ++j) {
    if (j != rank_) {
      await_checked(j, c, 1);
    }
  }
  int64_t off, len;
  slice(rank_, &off, &len);
  for (int j = 0; j < world_; ++j) ptrs[j] = segs_[j]->data(par, capacity_) + off;
  reduce_n_raw(segs_[rank_]->data(par, capacity_) + off, ptrs, world_, len / elsize, dtype, reduction_of(op));
  publish(c * 4 + 2);
  for (int k = 0; k < world_; ++k) {
    const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
    if (j != rank_) wait_for(j, c * 4 + 2);
    slice(j, &off, &len);
    std::memcpy(dst + off, segs_[j]->data(par, capacity_) + off, len);
  }
}

namespace {
// A tensor the fast paths take as it is: what the API's long way would pass unchanged.
bool like_plan(const at::Tensor& t, int64_t dtype) {
  return t.layout() == c10::kStrided && t.device().is_cpu() && static_cast<int64_t>(t.scalar_type()) == dtype &&
         t.is_contiguous() && !t.is_neg() && !t.is_conj();
}
}  // namespace

// A call with nothing to move still takes part in the check: its record is published
// and compared with every peer's, as a barrier's is, so a peer with data meets a
// mismatch instead of waiting for a piece that never comes.
void ShmComm::record_only(const Call& call) {
  guarded([&] {
    const uint64_t c = ++seq_;
    begin(c, call, 0, 0);
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) await_checked(j, c, 1);
    }
  });
}

bool ShmComm::try_allreduce(const at::Tensor& t, int64_t op, int64_t mode, int64_t dtype) {
  // The API's fast path: anything unlike the plan's call goes the long way, untouched.
  if (!like_plan(t, dtype)) return false;
  allreduce(t, op, mode);
  return true;
}

void ShmComm::allreduce(const at::Tensor& t, int64_t op, int64_t mode) {
  check_usable();  // before anything shared is touched (a forked child stops here)
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "commlab shm: needs a contiguous CPU tensor");
  TORCH_CHECK(op >= 0 && op <= kAvgRecord, "commlab shm: op code must be 0..4 (4: AVG, summed)");
  TORCH_CHECK(mode >= 0 && mode <= 3, "commlab shm: mode must be a ShmMode (0..3)");
  const int64_t elsize = t.element_size();
  const int64_t nbytes = t.numel() * elsize;
  if (world_ == 1) return;
  if (nbytes == 0) {
    record_only(Call{kAllReduce, 0, static_cast<int32_t>(t.scalar_type()), static_cast<int32_t>(op),
                     static_cast<int32_t>(mode), -1});
    return;
  }
  // Pieces never split an element and fit one parity buffer.
  const int64_t max_piece = (capacity_ / elsize) * elsize;
  char* data = static_cast<char*>(t.data_ptr());
  const auto dtype = t.scalar_type();
  guarded([&] {
    int64_t index = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      ShmMode m = static_cast<ShmMode>(mode);
      if (m == ShmMode::kAuto) m = (n <= oneshot_max_) ? ShmMode::kOneShot : ShmMode::kTwoShot;
      piece(data + done, data + done, nbytes, index, n, elsize, dtype, static_cast<int>(op), m);
    }
  });
}

namespace {
void check_dense(const at::Tensor& t, const char* what, const char* role) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous() && !t.is_neg() && !t.is_conj(),
              "commlab shm: ", what, "'s ", role, " must be a contiguous CPU tensor");
}

// all_gather's and reduce_scatter's checks: `whole` holds world x `part` elements of
// one dtype. Returns the part's bytes.
int64_t check_pair(const at::Tensor& whole, const char* whole_role, const at::Tensor& part,
                   const char* part_role, const char* what, int world) {
  check_dense(whole, what, whole_role);
  check_dense(part, what, part_role);
  TORCH_CHECK(whole.scalar_type() == part.scalar_type(), "commlab shm: ", what, "'s input and output differ in dtype");
  TORCH_CHECK(whole.numel() == part.numel() * world, "commlab shm: ", what, "'s ", whole_role,
              " must hold world size x ", part_role);
  return part.numel() * part.element_size();
}

// A group of one exchanges nothing: the input is the output. (An empty call in a larger
// group still publishes its record: record_only.)
bool alone(char* dst, const char* src, int64_t nbytes, int world) {
  if (nbytes != 0 && world == 1 && dst != src) std::memmove(dst, src, nbytes);
  return world == 1;
}
}  // namespace

int64_t ShmComm::piece_limit(int64_t elsize) const {
  const int64_t piece = piece_bytes_ > 0 ? std::min(piece_bytes_, capacity_) : capacity_;
  return std::max<int64_t>(1, piece / elsize) * elsize;
}

void ShmComm::allgather(const at::Tensor& out, const at::Tensor& in) {
  check_usable();
  const int64_t nbytes = check_pair(out, "output", in, "input", "all_gather", world_);
  const int64_t elsize = in.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  if (alone(dst, src, nbytes, world_)) return;
  const int64_t max_piece = piece_limit(elsize);
  const Call call{kAllGather, nbytes, static_cast<int32_t>(in.scalar_type()), -1, -1, -1};
  if (nbytes == 0) return record_only(call);
  guarded([&] {
    int64_t index = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      const uint64_t c = ++seq_;
      const int par = static_cast<int>(c & 1);
      std::memcpy(segs_[rank_]->data(par, capacity_), src + done, n);
      begin(c, call, index, n);
      // Our own slice comes from our segment too: `in` may be a view of that very slice of `out`.
      for (int k = 0; k < world_; ++k) {
        const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
        if (j != rank_) await_checked(j, c, 1);
        std::memcpy(dst + j * nbytes + done, segs_[j]->data(par, capacity_), n);
      }
    }
  });
}

void ShmComm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, int64_t op) {
  check_usable();
  TORCH_CHECK(op >= 0 && op <= kAvgRecord, "commlab shm: op code must be 0..4 (4: AVG, summed)");
  const int64_t nbytes = check_pair(in, "input", out, "output", "reduce_scatter", world_);  // per rank
  const int64_t elsize = in.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  if (alone(dst, src, nbytes, world_)) return;
  // A piece holds the same stretch of every rank's slice.
  const int64_t max_piece = (capacity_ / (elsize * world_)) * elsize;
  TORCH_CHECK(max_piece > 0, "commlab shm: capacity too small for reduce_scatter among ", world_, " ranks");
  const auto dtype = in.scalar_type();
  const Call call{kReduceScatter, nbytes * world_, static_cast<int32_t>(dtype), static_cast<int32_t>(op), -1, -1};
  if (nbytes == 0) return record_only(call);
  guarded([&] {
    const void** ptrs = ptrs_.data();
    int64_t index = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      const uint64_t c = ++seq_;
      const int par = static_cast<int>(c & 1);
      char* own = segs_[rank_]->data(par, capacity_);
      for (int j = 0; j < world_; ++j) std::memcpy(own + j * n, src + j * nbytes + done, n);
      begin(c, call, index, n);
      for (int j = 0; j < world_; ++j) {
        if (j != rank_) await_checked(j, c, 1);
        ptrs[j] = segs_[j]->data(par, capacity_) + rank_ * n;
      }
      reduce_n_raw(dst + done, ptrs, world_, n / elsize, dtype, reduction_of(static_cast<int>(op)));
    }
  });
}

void ShmComm::broadcast(const at::Tensor& t, int64_t root) {
  check_usable();
  check_dense(t, "broadcast", "tensor");
  TORCH_CHECK(root >= 0 && root < world_, "commlab shm: broadcast root ", root, " is not a rank of this group");
  const int64_t elsize = t.element_size();
  const int64_t nbytes = t.numel() * elsize;
  if (world_ == 1) return;
  if (nbytes == 0) {
    return record_only(Call{kBroadcast, 0, static_cast<int32_t>(t.scalar_type()), -1, -1, static_cast<int32_t>(root)});
  }
  // Pieces smaller than a buffer: the root copies one in while the receivers copy the last out.
  const int64_t max_piece = piece_limit(elsize);
  char* data = static_cast<char*>(t.data_ptr());
  const int from = static_cast<int>(root);
  if (single_copy_min_ >= 0 && nbytes >= single_copy_min_ && (single_copy_max_ <= 0 || nbytes < single_copy_max_)) {
    // One copy: every receiver reads the root's tensor out of its process; the root
    // returns once all have (phase 3), so the caller may write the tensor again.
    const Call call{kBroadcast, nbytes, static_cast<int32_t>(t.scalar_type()), -1, 1, static_cast<int32_t>(root)};
    guarded([&] {
      const uint64_t c = ++seq_;
      if (rank_ == from) {
        segs_[rank_]->ctl()->info[c & 1].addr = reinterpret_cast<uint64_t>(data);
        begin(c, call, 0, nbytes);
        for (int j = 0; j < world_; ++j) {
          if (j != rank_) await_checked(j, c, 1);
        }
        publish(c * 4 + 2);
        for (int j = 0; j < world_; ++j) {
          if (j != rank_) wait_for(j, c * 4 + 3);
        }
      } else {
        begin(c, call, 0, nbytes);
        await_checked(from, c, 2);
        read_peer(from, data, segs_[from]->ctl()->info[c & 1].addr, nbytes);
        publish(c * 4 + 3);
      }
    });
    return;
  }
  const Call call{kBroadcast, nbytes, static_cast<int32_t>(t.scalar_type()), -1, -1, static_cast<int32_t>(root)};
  guarded([&] {
    int64_t index = 0;
    uint64_t c = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      c = ++seq_;
      const int par = static_cast<int>(c & 1);
      if (rank_ == from) {
        // The buffer last held piece c - 2, which a receiver has copied out once it is at
        // c - 1 (before this call's first piece, the last call's end saw to that).
        if (index > 0) {
          for (int j = 0; j < world_; ++j) {
            if (j != rank_) await_checked(j, c - 1, 1, true);
          }
        }
        std::memcpy(segs_[rank_]->data(par, capacity_), data + done, n);
        // Published at once, arrived or not: each receiver checks the record against its
        // own call before it copies (a late receiver held every other one back before).
        begin(c, call, index, n, 2);
      } else {
        // Piece c's record slot last held c - 2, the last call's final piece when index is 1:
        // a peer still checking it there (the root published piece 0 without waiting) has
        // not reached c - 1.
        if (index == 1) {
          for (int j = 0; j < world_; ++j) {
            if (j != rank_ && j != from) wait_for(j, (c - 1) * 4 + 1);
          }
        }
        begin(c, call, index, n);
        await_checked(from, c, 2, true);
        std::memcpy(data + done, segs_[from]->data(par, capacity_), n);
      }
    }
    // Every rank ends knowing every peer reached the last piece, with the same call: so
    // every buffer is free for the next call, and a mismatch fails every rank.
    for (int j = 0; j < world_; ++j) {
      if (j != rank_ && j != from) await_checked(j, c, 1, true);
    }
  });
}

void ShmComm::alltoall(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& send,
                       const std::vector<int64_t>& recv) {
  check_usable();
  check_dense(out, "all_to_all", "output");
  check_dense(in, "all_to_all", "input");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "commlab shm: all_to_all's input and output differ in dtype");
  TORCH_CHECK(static_cast<int>(send.size()) == world_ && static_cast<int>(recv.size()) == world_,
              "commlab shm: all_to_all needs one send and one receive count per rank");
  const int64_t elsize = in.element_size();
  std::vector<int64_t> soff(world_ + 1, 0), roff(world_ + 1, 0);  // byte offsets of each peer's block
  for (int q = 0; q < world_; ++q) {
    TORCH_CHECK(send[q] >= 0 && recv[q] >= 0, "commlab shm: all_to_all counts must not be negative");
    soff[q + 1] = soff[q] + send[q] * elsize;
    roff[q + 1] = roff[q] + recv[q] * elsize;
  }
  TORCH_CHECK(soff[world_] == in.numel() * elsize && roff[world_] == out.numel() * elsize,
              "commlab shm: all_to_all counts must add up to the input's and the output's sizes");
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  if (world_ == 1) {
    TORCH_CHECK(send[0] == recv[0], "commlab shm: all_to_all of one rank sends ", send[0], " elements to itself and expects ",
                recv[0]);
    if (send[0] != 0 && dst != src) std::memmove(dst, src, send[0] * elsize);
    return;
  }
  // A piece's buffer: every rank's byte counts (sent to, received from each peer), then
  // one slot per destination holding the same stretch of each block.
  const int64_t head = ((2 * world_ * static_cast<int64_t>(sizeof(int64_t)) + 63) / 64) * 64;
  const int64_t slot = ((capacity_ - head) / world_ / 64) * 64;  // a multiple of every element size
  TORCH_CHECK(slot > 0, "commlab shm: capacity too small for all_to_all among ", world_, " ranks");
  // The record carries no sizes (they differ by rank): the counts are checked as a whole below.
  const Call call{kAllToAll, 0, static_cast<int32_t>(in.scalar_type()), -1, -1, -1};
  guarded([&] {
    int64_t pieces = 1;  // known after the first piece, from every rank's counts
    for (int64_t index = 0; index < pieces; ++index) {
      const int64_t done = index * slot;
      const uint64_t c = ++seq_;
      const int par = static_cast<int>(c & 1);
      char* own = segs_[rank_]->data(par, capacity_);
      int64_t* counts = reinterpret_cast<int64_t*>(own);
      for (int q = 0; q < world_; ++q) {
        counts[q] = send[q] * elsize;
        counts[world_ + q] = recv[q] * elsize;
        const int64_t n = std::min(slot, std::max<int64_t>(0, send[q] * elsize - done));
        if (n > 0) std::memcpy(own + head + q * slot, src + soff[q] + done, n);
      }
      begin(c, call, index, slot);
      if (index == 0) {
        // Every rank's counts before any byte lands: each rank checks the whole matrix in
        // the same order, so a disagreement is the same error on every rank.
        int64_t biggest = 0;
        for (int j = 0; j < world_; ++j) {
          if (j != rank_) await_checked(j, c, 1);
        }
        for (int j = 0; j < world_; ++j) {
          const int64_t* sj = reinterpret_cast<const int64_t*>(segs_[j]->data(par, capacity_));
          for (int q = 0; q < world_; ++q) {
            const int64_t* rq = reinterpret_cast<const int64_t*>(segs_[q]->data(par, capacity_)) + world_;
            if (sj[q] != rq[j]) {
              std::ostringstream msg;
              msg << "commlab shm: mismatch: ranks called all_to_all with splits that disagree: rank "
                  << global_ranks_[j] << " sends " << sj[q] / elsize << " elements to rank " << global_ranks_[q]
                  << ", which expects " << rq[j] / elsize << " from it";
              give_up(kMismatch, global_ranks_[j == rank_ ? q : j], msg.str());
            }
            biggest = std::max(biggest, sj[q]);
          }
        }
        pieces = std::max<int64_t>(1, (biggest + slot - 1) / slot);
      }
      for (int k = 0; k < world_; ++k) {
        const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
        if (j != rank_ && index > 0) await_checked(j, c, 1);
        const int64_t n = std::min(slot, std::max<int64_t>(0, recv[j] * elsize - done));
        if (n > 0) std::memcpy(dst + roff[j] + done, segs_[j]->data(par, capacity_) + head + rank_ * slot, n);
      }
    }
  });
}

namespace {
// The other families' fast paths leave empty calls to the long way, which agrees them.
bool plain(const at::Tensor& t, int64_t dtype) { return t.numel() > 0 && like_plan(t, dtype); }

bool share_bytes(const at::Tensor& a, const at::Tensor& b) {
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.numel() * b.element_size() && b0 < a0 + a.numel() * a.element_size();
}
}  // namespace

bool ShmComm::try_allgather(const at::Tensor& out, const at::Tensor& in, int64_t dtype) {
  // The input may be this rank's block of the output: allgather() reads it from the segment.
  if (!plain(out, dtype) || !plain(in, dtype) || out.numel() != in.numel() * world_) return false;
  allgather(out, in);
  return true;
}

bool ShmComm::try_reduce_scatter(const at::Tensor& out, const at::Tensor& in, int64_t op, int64_t dtype) {
  if (!plain(out, dtype) || !plain(in, dtype) || in.numel() != out.numel() * world_ || share_bytes(out, in) ||
      op < 0 || op > 3)
    return false;
  reduce_scatter(out, in, op);
  return true;
}

bool ShmComm::try_broadcast(const at::Tensor& t, int64_t root, int64_t dtype) {
  if (!plain(t, dtype) || root < 0 || root >= world_) return false;
  broadcast(t, root);
  return true;
}

bool ShmComm::try_alltoall(const at::Tensor& out, const at::Tensor& in, int64_t dtype) {
  // Even splits count rows of dim 0, as the API's long way does.
  if (!plain(out, dtype) || !plain(in, dtype) || in.dim() == 0 || out.dim() == 0 || in.size(0) % world_ != 0 ||
      out.size(0) % world_ != 0 || share_bytes(out, in))
    return false;
  const int64_t send = in.size(0) / world_ * (in.numel() / in.size(0));
  const int64_t recv = out.size(0) / world_ * (out.numel() / out.size(0));
  alltoall(out, in, std::vector<int64_t>(world_, send), std::vector<int64_t>(world_, recv));
  return true;
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
      if (j != rank_) await_checked(j, c, 1);
    }
  });
}

}  // namespace commlab
