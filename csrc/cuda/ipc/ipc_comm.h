// All-reduce among processes whose GPUs can read each other's memory (CUDA IPC).
//
// Each rank owns one cudaMalloc'ed block: a signal area (barrier flags) and two data
// buffers used by call parity. Peers map it once through cudaIpcOpenMemHandle. A call
// copies the caller's chunk into the own buffer and launches one kernel that meets
// the peers at a flag barrier and reduces straight out of their buffers:
//  - one-shot: every rank reduces all inputs (one barrier),
//  - two-shot: rank r reduces slice r in place, a second barrier, then every rank
//    gathers the reduced slices (two barriers, p-times less reading).
// Flags carry the call number and waiters accept "this call or later", so, as in the
// shared-memory transport, two buffers replace a trailing barrier: a peer can only
// overwrite buffer b after everyone entered the next call's kernel, and a rank's
// kernel starts only when its previous one (the last reader of b) has finished.
//
// The barrier is the release/acquire flag exchange vLLM's custom all-reduce uses,
// with what it lacks: a deadline (the group's timeout, measured on the GPU's global
// timer). A block that gives up records which peer and which barrier in host-mapped
// memory and the kernel returns; the host raises after the stream finished.
// In-kernel barriers need every rank's kernel resident at the same time: they are
// for distinct GPUs only. Processes sharing one GPU are time-sliced and would
// deadlock; commlab/ipc.py sends them through host-staged shared memory instead.
#pragma once

#include <cuda_runtime_api.h>
#include "../../common/torch_lite.h"

#include <cstdint>
#include <string>
#include <vector>

namespace commlab {

class IpcComm {
 public:
  // Allocates this rank's block on `device` (zeroed signals) and host-mapped error word.
  IpcComm(int64_t rank, int64_t world, int64_t device, int64_t capacity, int64_t timeout_ms,
          std::vector<int64_t> global_ranks);
  ~IpcComm();
  IpcComm(const IpcComm&) = delete;
  IpcComm& operator=(const IpcComm&) = delete;

  // cudaIpcMemHandle_t of the own block, as bytes for the group's object exchange.
  pybind11::bytes handle() const;
  // Map every peer's block (handles[rank] is ignored: that is our own).
  void open(const std::vector<std::string>& handles);
  // Same-process peers (tests on one GPU): take their blocks' device addresses directly.
  void connect_local(const std::vector<int64_t>& block_addresses);
  int64_t block_address() const { return reinterpret_cast<int64_t>(block_); }

  void allreduce(const at::Tensor& t, int64_t op, int64_t mode);
  void close();

  int64_t capacity() const { return capacity_; }
  int64_t oneshot_max() const { return oneshot_max_; }
  void set_oneshot_max(int64_t bytes) { oneshot_max_ = bytes; }
  int64_t max_blocks() const { return max_blocks_; }
  void set_max_blocks(int64_t n);
  int64_t calls() const { return static_cast<int64_t>(seq_); }
  // Tests of flag wrap-around start a communicator far into its life.
  void set_calls(int64_t n) { seq_ = static_cast<uint64_t>(n); }
  // Group rank this rank lost (waited for in vain, directly or through a peer), or -1.
  int64_t failed_peer() const { return failed_peer_; }

 private:
  void check_usable() const;
  void release_resources();
  // Waits for this call's kernels; a signal on the main thread (Ctrl-C) stops them.
  void wait_done(cudaStream_t stream);
  void stop_if_signalled();

  int rank_;
  int world_;
  int device_;
  int64_t capacity_;
  int64_t timeout_ms_;
  int64_t oneshot_max_;
  int max_blocks_;
  std::vector<int64_t> global_ranks_;
  char* block_ = nullptr;         // own: signals, then two data buffers
  std::vector<char*> peers_;      // every rank's block as this device sees it
  std::vector<bool> opened_;      // which peers_ came from cudaIpcOpenMemHandle
  void* error_host_ = nullptr;    // host-mapped IpcError
  void* error_dev_ = nullptr;
  int* abort_host_ = nullptr;     // pinned source of the word that stops our kernels
  cudaStream_t side_ = nullptr;   // non-blocking stream for that write
  cudaEvent_t done_ = nullptr;    // recorded after a call's kernels
  bool connected_ = false;
  std::string broken_;
  uint64_t seq_ = 0;              // calls so far: 64-bit like the flags
  uint64_t fork_generation_ = 0;
  int failed_peer_ = -1;
};

}  // namespace commlab
