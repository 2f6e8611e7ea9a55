// The spin-wait hint: a waiter polling a cache line another core will write.
#pragma once

namespace commlab {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace commlab
