// The life of a group's segments: created, sized and locked by their owner, mapped and
// validated by every peer, unlinked once all have them, and beaten by a heart thread
// while the process lives (the protocol is protocol.cpp, the collectives collectives.cpp).
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

}  // namespace commlab
