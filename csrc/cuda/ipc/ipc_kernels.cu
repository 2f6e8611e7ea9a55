// CUDA IPC all-reduce kernels; the protocol is described in ipc_comm.h.
#include "ipc_kernels.h"

#include <cuda_runtime.h>

#include "../device_ops.cuh"

namespace commlab {
namespace ipc {
namespace {

// Lives at the start of each rank's block. Peers write their arrival into our slots
// (slot [block][peer]); we only read them. `abort` says whom this rank gave up on.
struct Signal {
  alignas(128) uint64_t start[kMaxBlocks][kMaxRanks];
  alignas(128) uint64_t mid[kMaxBlocks][kMaxRanks];
  alignas(128) int abort;  // see kAbortLost / kAbortInterrupted
  alignas(128) int64_t info[2][3];  // by call parity: seq, numel, call_code
};
static_assert(sizeof(Signal) <= kSignalBytes, "signal area too small");

__device__ __forceinline__ void st_release(uint64_t* addr, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%1], %0;" ::"l"(v), "l"(addr) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* addr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}

__device__ __forceinline__ int ld_volatile(const int* addr) { return *reinterpret_cast<const volatile int*>(addr); }

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every block meets the same block of every peer. Thread t < world announces this
// block's arrival in peer t's slot (release: the block's earlier writes, ordered by
// the __syncthreads, become visible first) and waits for peer t's arrival in ours
// (acquire, "this call or later"). Returns false when it gave up: the peer missed the
// deadline, or some rank (this one's other blocks, or the peer) already gave up.
__device__ bool barrier(const Launch& a, int which) {
  __shared__ int failed;
  __syncthreads();
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < a.world) {
    const int t = threadIdx.x;
    Signal* peer = reinterpret_cast<Signal*>(a.blocks[t]);
    Signal* self = reinterpret_cast<Signal*>(a.blocks[a.rank]);
    st_release(which == 0 ? &peer->start[blockIdx.x][a.rank] : &peer->mid[blockIdx.x][a.rank], a.seq);
    const uint64_t* in = which == 0 ? &self->start[blockIdx.x][t] : &self->mid[blockIdx.x][t];
    uint64_t t0 = 0;
    for (uint32_t spins = 1;; ++spins) {
      const uint64_t seen = ld_acquire(in);
      int peer_abort = 0;
      bool expired = false;
      if (seen >= a.seq) {  // this call or later; 64 bits never wrap
        // A peer that arrived and then gave up fails this call here too.
        peer_abort = ld_volatile(&peer->abort);
        if (peer_abort == 0) break;
      } else {
        if ((spins & 255) != 0) continue;
        __nanosleep(200);
        const uint64_t now = global_ns();
        if (t0 == 0) t0 = now;
        peer_abort = ld_volatile(&peer->abort);
        expired = now - t0 > a.timeout_ns;
        if (!expired && peer_abort == 0 && ld_volatile(&self->abort) == 0) continue;
      }
      // The first give-up of this rank records why (passing a peer's mismatch or
      // interruption on as such); other blocks just leave.
      const bool pass_on = !expired && (peer_abort & (kAbortMismatch | kAbortInterrupted));
      const int mark = pass_on ? peer_abort : (kAbortLost | (t + 1));
      if (atomicCAS(&self->abort, 0, mark) == 0) {
        a.err->peer = t;
        a.err->barrier = which;
        a.err->relayed = peer_abort != 0 && !expired;
        a.err->peer_abort = peer_abort;
        a.err->seq = a.seq;
        a.err->seen = seen;
        __threadfence_system();
      }
      failed = 1;
      break;
    }
  }
  __syncthreads();
  return failed == 0;
}

// Block 0 compares every peer's record of this call with its own (written before
// the start barrier, so the barrier's acquire made it visible). On a difference it
// gives up like a timed-out barrier; the other blocks notice through `abort`.
__device__ bool same_call(const Launch& a) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  if (threadIdx.x < a.world) {
    const int t = threadIdx.x;
    const volatile int64_t* info = reinterpret_cast<Signal*>(a.blocks[t])->info[a.seq & 1];
    const int64_t seq = info[0], numel = info[1], code = info[2];
    if (seq != static_cast<int64_t>(a.seq) || numel != a.numel || code != a.code) {
      Signal* self = reinterpret_cast<Signal*>(a.blocks[a.rank]);
      if (atomicCAS(&self->abort, 0, kAbortMismatch | (t + 1)) == 0) {
        a.err->peer = t;
        a.err->seq = a.seq;
        a.err->mismatch = 1;
        a.err->my_numel = a.numel;
        a.err->my_code = a.code;
        a.err->their_seq = seq;
        a.err->their_numel = numel;
        a.err->their_code = code;
        __threadfence_system();
      }
      bad = 1;
    }
  }
  __syncthreads();
  return bad == 0;
}

template <typename T>
__device__ __forceinline__ T reduce_at(const T* const* in, int world, int64_t i, RedOp op) {
  using E = Elem<T>;
  typename E::Acc acc = E::load(in[0][i]);
  for (int k = 1; k < world; ++k) acc = combine(acc, E::load(in[k][i]), op);
  return E::store(acc);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) allreduce_kernel(Launch a) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    volatile int64_t* mine = reinterpret_cast<Signal*>(a.blocks[a.rank])->info[a.seq & 1];
    mine[0] = static_cast<int64_t>(a.seq);
    mine[1] = a.numel;
    mine[2] = a.code;
  }
  if (!barrier(a, 0)) return;
  if (blockIdx.x == 0 && !same_call(a)) return;
  const T* in[kMaxRanks];
  for (int k = 0; k < a.world; ++k) in[k] = reinterpret_cast<const T*>(a.blocks[k] + a.data_offset);
  T* out = static_cast<T*>(a.out);
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!a.two_shot) {
    for (int64_t i = first; i < a.numel; i += stride) out[i] = reduce_at(in, a.world, i, a.op);
    return;
  }
  // Reduce-scatter: slice r, reduced in place in our own buffer. Peers read other
  // slices of it meanwhile, never this one, until after the middle barrier. The
  // (block, thread) that reduces element j of a slice is the one that gathers it on
  // every rank, so a per-block barrier is enough.
  const int64_t part = (a.numel + a.world - 1) / a.world;
  auto slice_len = [&](int q) {
    const int64_t end = (q + 1) * part < a.numel ? (q + 1) * part : a.numel;
    return end > q * part ? end - q * part : int64_t{0};
  };
  {
    const int64_t lo = a.rank * part, n = slice_len(a.rank);
    T* mine = reinterpret_cast<T*>(a.blocks[a.rank] + a.data_offset) + lo;
    for (int64_t j = first; j < n; j += stride) mine[j] = reduce_at(in, a.world, lo + j, a.op);
  }
  if (!barrier(a, 1)) return;
  for (int q = 0; q < a.world; ++q) {
    const int64_t lo = q * part, n = slice_len(q);
    const T* src = in[q] + lo;
    for (int64_t j = first; j < n; j += stride) out[lo + j] = src[j];
  }
}

}  // namespace

cudaError_t preload() {
  // Loading every instantiation now matters under lazy module loading (CUDA's
  // default): a kernel loaded on first launch while another kernel of this process
  // spins at a barrier waiting for it can wait forever.
  cudaFuncAttributes attr;
  cudaError_t rc = cudaSuccess;
  for (int d = 0; d <= static_cast<int>(DType::kU8); ++d) {
    const cudaError_t r = dispatch(static_cast<DType>(d), [&](auto* tag) {
      return cudaFuncGetAttributes(&attr, allreduce_kernel<std::remove_pointer_t<decltype(tag)>>);
    });
    if (r != cudaSuccess) rc = r;
  }
  return rc;
}

cudaError_t launch_allreduce(DType dtype, const Launch& a, cudaStream_t stream) {
  return dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    allreduce_kernel<T><<<a.grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

int* abort_word(char* block) { return &reinterpret_cast<Signal*>(block)->abort; }

}  // namespace ipc
}  // namespace commlab
