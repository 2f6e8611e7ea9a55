#include "shm_comm.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "reduce_n.h"

namespace commlab {
namespace {

constexpr uint64_t kMagic = 0x31424c4d4d4f43ull;  // "COMMLB1"
constexpr uint32_t kVersion = 1;
constexpr int64_t kDataOffset = 4096;

struct alignas(64) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t world;
  uint32_t rank;
  uint32_t uid;
  uint64_t capacity;
  int64_t pid;
  char token[33];
};

struct alignas(64) SeqLine {
  std::atomic<uint64_t> seq;
};

struct alignas(64) WakeLine {
  std::atomic<uint32_t> word;     // bumped on every publish; futex waits on it
  std::atomic<uint32_t> waiters;  // publishers skip the wake syscall when zero
};

// What each rank is about to do, by call parity: peers compare it before reading,
// so mismatched calls fail loudly instead of reading the wrong bytes.
struct alignas(64) CallInfo {
  uint64_t call;
  int64_t nbytes;
  int32_t dtype;
  int32_t op;
  int32_t mode;
};

// Set by a rank that gave up on a peer, so ranks waiting on *it* fail at once instead
// of at their own deadline: (lost global rank + 1) | kAbortDead when that peer died.
constexpr uint64_t kAbortDead = 1ull << 40;
struct alignas(64) AbortLine {
  std::atomic<uint64_t> lost;
};

struct Layout {
  Header header;
  SeqLine seq;
  WakeLine wake;
  AbortLine abort;
  CallInfo info[2];
};
static_assert(sizeof(Layout) <= kDataOffset, "control block must fit before the data");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics in shared memory");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const struct timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A peer that exited may linger as a zombie until its parent reaps it; kill(pid, 0)
// still succeeds then, so look at its state too.
bool process_alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return true;  // no /proc: trust kill()
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');
  if (!close_paren || close_paren[1] == 0) return true;
  const char state = close_paren[2];
  return state != 'Z' && state != 'X';
}

std::string errno_text(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

}  // namespace

struct ShmComm::Segment {
  std::string name;
  void* base = nullptr;
  size_t size = 0;
  Layout* ctl() const { return static_cast<Layout*>(base); }
  char* data(int parity, int64_t capacity) const {
    return static_cast<char*>(base) + kDataOffset + parity * capacity;
  }
};

std::string ShmComm::segment_name(int64_t rank) const {
  return "/commlab-" + token_ + "-" + std::to_string(rank);
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
      global_ranks_(std::move(global_ranks)) {
  TORCH_CHECK(token_.size() == 32, "commlab shm: token must be 32 hex characters");
  TORCH_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "commlab shm: bad rank/world");
  TORCH_CHECK(capacity_ >= 4096 && capacity_ % 64 == 0, "commlab shm: capacity must be a multiple of 64, >= 4096");
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == world_, "commlab shm: need one global rank per rank");
  segs_.assign(world_, nullptr);

  auto* own = new Segment();
  own->name = segment_name(rank_);
  own->size = static_cast<size_t>(kDataOffset + 2 * capacity_);
  int fd = shm_open(own->name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
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
  ::close(fd);
  if (own->base == MAP_FAILED) {
    const std::string msg = errno_text("commlab shm: mmap of own segment failed");
    shm_unlink(own->name.c_str());
    delete own;
    throw std::runtime_error(msg);
  }
  Layout* l = own->ctl();
  l->seq.seq.store(0);
  l->wake.word.store(0);
  l->wake.waiters.store(0);
  l->abort.lost.store(0);
  std::memset(l->info, 0, sizeof(l->info));
  Header& h = l->header;
  h.version = kVersion;
  h.world = static_cast<uint32_t>(world_);
  h.rank = static_cast<uint32_t>(rank_);
  h.uid = static_cast<uint32_t>(geteuid());
  h.capacity = static_cast<uint64_t>(capacity_);
  h.pid = static_cast<int64_t>(getpid());
  std::memcpy(h.token, token_.c_str(), 33);
  // The magic goes last: a reader that sees it sees a complete header.
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&h.magic)->store(kMagic, std::memory_order_release);
  segs_[rank_] = own;
}

void ShmComm::attach() {
  for (int j = 0; j < world_; ++j) {
    if (segs_[j]) continue;
    auto* s = new Segment();
    s->name = segment_name(j);
    s->size = static_cast<size_t>(kDataOffset + 2 * capacity_);
    int fd = shm_open(s->name.c_str(), O_RDWR, 0);
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
    ::close(fd);
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
      std::string msg = "commlab shm: refusing rank " + std::to_string(global_ranks_[j]) + "'s segment " + s->name +
                        ": " + bad + " (forged, stale or foreign)";
      delete s;
      throw std::runtime_error(msg);
    }
    segs_[j] = s;
  }
}

void ShmComm::unlink_own() {
  if (!own_unlinked_ && segs_[rank_]) {
    shm_unlink(segs_[rank_]->name.c_str());
    own_unlinked_ = true;
  }
}

void ShmComm::close() {
  unlink_own();
  for (auto*& s : segs_) {
    if (s) {
      if (s->base) munmap(s->base, s->size);
      delete s;
      s = nullptr;
    }
  }
}

ShmComm::~ShmComm() { close(); }

void ShmComm::publish(uint64_t value) {
  Layout* l = segs_[rank_]->ctl();
  l->seq.seq.store(value, std::memory_order_seq_cst);
  l->wake.word.fetch_add(1, std::memory_order_seq_cst);
  if (l->wake.waiters.load(std::memory_order_seq_cst) != 0) {
    futex(&l->wake.word, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void ShmComm::fail_wait(int peer, uint64_t target, const char* why) {
  const Layout* l = segs_[peer]->ctl();
  const int64_t pid = l->header.pid;
  const bool alive = process_alive(pid);
  const uint64_t seen = l->seq.seq.load();
  std::ostringstream msg;
  msg << "commlab shm: rank " << global_ranks_[rank_] << " waited for rank " << global_ranks_[peer] << " (pid " << pid
      << ", " << (alive ? "alive" : "dead") << "): " << why << "; it reached call " << (seen >> 2) << " phase "
      << (seen & 3) << ", this rank needs call " << (target >> 2) << " phase " << (target & 3);
  const uint64_t peer_abort = l->abort.lost.load();
  if (peer_abort != 0) {
    msg << "; rank " << global_ranks_[peer] << " had given up after losing rank " << ((peer_abort & (kAbortDead - 1)) - 1)
        << ((peer_abort & kAbortDead) ? " (dead)" : " (timed out)");
  }
  // Tell whoever waits on us, then fail.
  Layout* own = segs_[rank_]->ctl();
  uint64_t mark = static_cast<uint64_t>(global_ranks_[peer]) + 1;
  if (peer_abort != 0) mark = peer_abort;  // pass the original loss along
  else if (!alive) mark |= kAbortDead;
  uint64_t expected = 0;
  own->abort.lost.compare_exchange_strong(expected, mark);
  own->wake.word.fetch_add(1, std::memory_order_seq_cst);
  futex(&own->wake.word, FUTEX_WAKE, INT_MAX, nullptr);
  throw std::runtime_error(msg.str());
}

void ShmComm::wait_for(int peer, uint64_t target) {
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
  const int64_t deadline = now_ms() + timeout_ms_;
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
      fail_wait(peer, target, "timed out");
    }
    // Wake at least every 100 ms to notice a peer that died.
    const int64_t slice = std::min<int64_t>(left, 100);
    struct timespec ts{static_cast<time_t>(slice / 1000), static_cast<long>((slice % 1000) * 1000000)};
    futex(&l->wake.word, FUTEX_WAIT, word, &ts);
    l->wake.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (seq.load(std::memory_order_acquire) >= target) return;
    if (l->abort.lost.load(std::memory_order_acquire) != 0) fail_wait(peer, target, "peer aborted the collective");
    if (!process_alive(l->header.pid)) fail_wait(peer, target, "peer process died");
  }
}

void ShmComm::write_info(uint64_t call, int64_t nbytes, int dtype, int op, int mode) {
  CallInfo& ci = segs_[rank_]->ctl()->info[call & 1];
  ci.call = call;
  ci.nbytes = nbytes;
  ci.dtype = dtype;
  ci.op = op;
  ci.mode = mode;
}

void ShmComm::check_info(int peer, uint64_t call, int64_t nbytes, int dtype, int op, int mode) {
  const CallInfo& ci = segs_[peer]->ctl()->info[call & 1];
  if (ci.call == call && ci.nbytes == nbytes && ci.dtype == dtype && ci.op == op && ci.mode == mode) return;
  std::ostringstream msg;
  msg << "commlab shm: mismatch: rank " << global_ranks_[rank_] << " runs call " << call << " with " << nbytes
      << " bytes, dtype " << dtype << ", op " << op << ", mode " << mode << "; rank " << global_ranks_[peer]
      << " has call " << ci.call << " with " << ci.nbytes << " bytes, dtype " << ci.dtype << ", op " << ci.op
      << ", mode " << ci.mode;
  throw std::runtime_error(msg.str());
}

void ShmComm::piece(char* dst, const char* src, int64_t nbytes, int64_t elsize, c10::ScalarType dtype, int op,
                    ShmMode mode) {
  const uint64_t c = ++call_;
  const int par = static_cast<int>(c & 1);
  const int dcode = static_cast<int>(dtype);
  const int mcode = static_cast<int>(mode);
  const int64_t count = nbytes / elsize;
  std::vector<const void*> ptrs(world_);

  std::memcpy(segs_[rank_]->data(par, capacity_), src, nbytes);
  write_info(c, nbytes, dcode, op, mcode);
  publish(c * 4 + 1);

  if (mode == ShmMode::kOneShot) {
    // Every rank reduces everything, in rank order: identical bits on every rank.
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) {
        wait_for(j, c * 4 + 1);
        check_info(j, c, nbytes, dcode, op, mcode);
      }
      ptrs[j] = segs_[j]->data(par, capacity_);
    }
    reduce_n_raw(dst, ptrs.data(), world_, count, dtype, static_cast<RedOp>(op));
    return;
  }

  if (mode == ShmMode::kRoot) {
    if (rank_ == 0) {
      for (int j = 1; j < world_; ++j) {
        wait_for(j, c * 4 + 1);
        check_info(j, c, nbytes, dcode, op, mcode);
      }
      for (int j = 0; j < world_; ++j) ptrs[j] = segs_[j]->data(par, capacity_);
      char* result = segs_[0]->data(par, capacity_);
      reduce_n_raw(result, ptrs.data(), world_, count, dtype, static_cast<RedOp>(op));
      publish(c * 4 + 2);
      std::memcpy(dst, result, nbytes);
    } else {
      wait_for(0, c * 4 + 2);
      check_info(0, c, nbytes, dcode, op, mcode);
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
      wait_for(j, c * 4 + 1);
      check_info(j, c, nbytes, dcode, op, mcode);
    }
  }
  int64_t off, len;
  slice(rank_, &off, &len);
  for (int j = 0; j < world_; ++j) ptrs[j] = segs_[j]->data(par, capacity_) + off;
  reduce_n_raw(segs_[rank_]->data(par, capacity_) + off, ptrs.data(), world_, len / elsize, dtype,
               static_cast<RedOp>(op));
  publish(c * 4 + 2);
  for (int k = 0; k < world_; ++k) {
    const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
    if (j != rank_) wait_for(j, c * 4 + 2);
    slice(j, &off, &len);
    std::memcpy(dst + off, segs_[j]->data(par, capacity_) + off, len);
  }
}

void ShmComm::allreduce(const torch::Tensor& t, int64_t op, int64_t mode) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "commlab shm: needs a contiguous CPU tensor");
  TORCH_CHECK(op >= 0 && op <= 3, "commlab shm: op code must be 0..3");
  TORCH_CHECK(mode >= 0 && mode <= 3, "commlab shm: mode must be 0..3");
  for (int j = 0; j < world_; ++j) TORCH_CHECK(segs_[j] != nullptr, "commlab shm: not attached (or closed)");
  const int64_t elsize = t.element_size();
  const int64_t nbytes = t.numel() * elsize;
  if (nbytes == 0 || world_ == 1) return;
  // Pieces never split an element and fit one parity buffer.
  const int64_t max_piece = (capacity_ / elsize) * elsize;
  char* data = static_cast<char*>(t.data_ptr());
  const auto dtype = t.scalar_type();
  pybind11::gil_scoped_release no_gil;
  for (int64_t done = 0; done < nbytes; done += max_piece) {
    const int64_t n = std::min(max_piece, nbytes - done);
    ShmMode m = static_cast<ShmMode>(mode);
    if (m == ShmMode::kAuto) m = (n <= oneshot_max_) ? ShmMode::kOneShot : ShmMode::kTwoShot;
    piece(data + done, data + done, n, elsize, dtype, static_cast<int>(op), m);
  }
}

}  // namespace commlab
