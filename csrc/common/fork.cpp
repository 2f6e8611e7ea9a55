#include "fork.h"

#include <pthread.h>

#include <atomic>

namespace commlab {
namespace {

std::atomic<uint64_t> g_generation{0};

void bump_in_child() { g_generation.fetch_add(1, std::memory_order_relaxed); }

// Registered when the extension loads, so every fork after that is seen.
const int g_registered = pthread_atfork(nullptr, nullptr, &bump_in_child);

}  // namespace

uint64_t fork_generation() {
  (void)g_registered;
  return g_generation.load(std::memory_order_relaxed);
}

}  // namespace commlab
