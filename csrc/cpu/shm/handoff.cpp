#include "handoff.h"

#include "../../common/pause.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace commlab {
namespace {

struct alignas(64) Line {
  std::atomic<int64_t> value;
  char pad[64 - sizeof(std::atomic<int64_t>)];
};

struct Pair {
  Line ping;   // written by the initiator
  Line pong;   // written by the responder
  Line ready;  // the responder mapped the segment
};

using Clock = std::chrono::steady_clock;

void wait_for(const std::atomic<int64_t>& v, int64_t want, bool yield, Clock::time_point deadline) {
  for (uint32_t k = 1;; ++k) {
    if (v.load(std::memory_order_acquire) >= want) return;
    cpu_relax();
    if (yield) sched_yield();
    if ((k & 4095) == 0 && Clock::now() > deadline)
      throw std::runtime_error("commlab handoff: the peer did not answer in time");
  }
}

}  // namespace

int64_t handoff_pingpong_ns(const std::string& name, bool initiator, int64_t iters, bool yield, int64_t timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  int fd = -1;
  if (initiator) {
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, sizeof(Pair)) != 0) {
      const int err = errno;
      close(fd);
      shm_unlink(name.c_str());
      throw std::runtime_error(std::string("commlab handoff: ftruncate: ") + std::strerror(err));
    }
  } else {
    // The initiator creates it: retry until it exists and has its size.
    while (true) {
      fd = shm_open(name.c_str(), O_RDWR, 0);
      if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(Pair))) break;
        close(fd);
        fd = -1;
      } else if (errno != ENOENT) {
        break;
      }
      if (Clock::now() > deadline) throw std::runtime_error("commlab handoff: the initiator's segment never appeared");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (fd < 0) throw std::runtime_error(std::string("commlab handoff: shm_open: ") + std::strerror(errno));
  void* mem = mmap(nullptr, sizeof(Pair), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (mem == MAP_FAILED) {
    if (initiator) shm_unlink(name.c_str());
    throw std::runtime_error(std::string("commlab handoff: mmap: ") + std::strerror(errno));
  }
  auto* pair = static_cast<Pair*>(mem);
  int64_t ns = 0;
  try {
    if (initiator) {
      wait_for(pair->ready.value, 1, true, deadline);
      shm_unlink(name.c_str());  // both mapped it: nothing stays behind
      const auto t0 = Clock::now();
      for (int64_t i = 1; i <= iters; ++i) {
        pair->ping.value.store(i, std::memory_order_release);
        wait_for(pair->pong.value, i, yield, deadline);
      }
      ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    } else {
      pair->ready.value.store(1, std::memory_order_release);
      for (int64_t i = 1; i <= iters; ++i) {
        wait_for(pair->ping.value, i, yield, deadline);
        pair->pong.value.store(i, std::memory_order_release);
      }
    }
  } catch (...) {
    if (initiator) shm_unlink(name.c_str());
    munmap(mem, sizeof(Pair));
    throw;
  }
  munmap(mem, sizeof(Pair));
  return ns;
}

double hot_copy_ns(int64_t nbytes, int64_t iters) {
  if (nbytes <= 0 || iters <= 0) throw std::invalid_argument("commlab hot_copy_ns: nbytes and iters must be > 0");
  std::vector<char> a(nbytes, 1), b(nbytes, 2);
  double best = 1e300;
  for (int batch = 0; batch < 5; ++batch) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      std::memcpy(i & 1 ? a.data() : b.data(), i & 1 ? b.data() : a.data(), nbytes);
      asm volatile("" ::: "memory");  // every copy happens
    }
    const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / iters;
    if (ns < best) best = ns;
  }
  return best;
}

}  // namespace commlab
