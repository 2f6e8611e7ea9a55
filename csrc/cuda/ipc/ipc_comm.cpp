// Host side of the CUDA IPC all-reduce (protocol in ipc_comm.h, kernels in
// ipc_kernels.cu). Plain C++: compiled only into CUDA builds.
#ifdef COMMLAB_WITH_CUDA
#include "ipc_comm.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <sstream>
#include <stdexcept>

#include "../../common/errors.h"
#include "../../common/fork.h"
#include "../../common/signals.h"
#include "../../common/torch_codes.h"
#include "ipc_kernels.h"

namespace commlab {

using ipc::kMaxBlocks;
using ipc::kMaxRanks;
using ipc::kSignalBytes;
using ipc::kThreads;
using IpcError = ipc::Error;

IpcComm::IpcComm(int64_t rank, int64_t world, int64_t device, int64_t capacity, int64_t timeout_ms,
                 std::vector<int64_t> global_ranks)
    : rank_(static_cast<int>(rank)),
      world_(static_cast<int>(world)),
      device_(static_cast<int>(device)),
      capacity_(capacity),
      timeout_ms_(timeout_ms),
      oneshot_max_(256 << 10),
      max_blocks_(32),
      global_ranks_(std::move(global_ranks)),
      fork_generation_(fork_generation()) {
  TORCH_CHECK(world_ >= 1 && world_ <= kMaxRanks, "commlab ipc: group size must be 1..", kMaxRanks, ", got ", world);
  TORCH_CHECK(rank_ >= 0 && rank_ < world_, "commlab ipc: rank ", rank, " outside a group of ", world);
  TORCH_CHECK(capacity_ >= 4096 && capacity_ % 256 == 0, "commlab ipc: capacity must be a multiple of 256, >= 4096");
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == world_, "commlab ipc: need one global rank per group rank");
  TORCH_CHECK(timeout_ms_ > 0, "commlab ipc: timeout must be positive");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  peers_.assign(world_, nullptr);
  opened_.assign(world_, false);
  try {
    C10_CUDA_CHECK(ipc::preload());
    C10_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&block_), kSignalBytes + 2 * capacity_));
    C10_CUDA_CHECK(cudaMemset(block_, 0, kSignalBytes));
    // Zeroed before any peer can map the block (the handle is exchanged after this).
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    C10_CUDA_CHECK(cudaHostAlloc(&error_host_, sizeof(IpcError), cudaHostAllocMapped));
    std::memset(error_host_, 0, sizeof(IpcError));
    static_cast<IpcError*>(error_host_)->peer = -1;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&error_dev_, error_host_, 0));
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&abort_host_), sizeof(int), cudaHostAllocDefault));
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  } catch (...) {
    release_resources();  // nothing half-made survives a failed constructor
    throw;
  }
  peers_[rank_] = block_;
}

IpcComm::~IpcComm() {
  try {
    close();
  } catch (...) {
    // The CUDA context may already be gone at interpreter exit.
  }
}

pybind11::bytes IpcComm::handle() const {
  TORCH_CHECK(block_ != nullptr, "commlab ipc: communicator is closed");
  cudaIpcMemHandle_t h;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&h, block_));
  return pybind11::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
}

void IpcComm::open(const std::vector<std::string>& handles) {
  TORCH_CHECK(block_ != nullptr, "commlab ipc: communicator is closed");
  TORCH_CHECK(static_cast<int>(handles.size()) == world_, "commlab ipc: need ", world_, " handles, got ", handles.size());
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    TORCH_CHECK(handles[q].size() == sizeof(cudaIpcMemHandle_t), "commlab ipc: rank ", global_ranks_[q],
                " sent a handle of ", handles[q].size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[q].data(), sizeof(h));
    void* p = nullptr;
    const cudaError_t rc = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      TORCH_CHECK(false, "commlab ipc: cannot map rank ", global_ranks_[q], "'s buffer on GPU ", device_, ": ",
                  cudaGetErrorString(rc));
    }
    peers_[q] = static_cast<char*>(p);
    opened_[q] = true;
  }
  connected_ = true;
}

void IpcComm::connect_local(const std::vector<int64_t>& block_addresses) {
  TORCH_CHECK(static_cast<int>(block_addresses.size()) == world_, "commlab ipc: need ", world_, " addresses");
  for (int q = 0; q < world_; ++q) {
    if (q != rank_) peers_[q] = reinterpret_cast<char*>(block_addresses[q]);
  }
  connected_ = true;
}

void IpcComm::set_max_blocks(int64_t n) {
  TORCH_CHECK(n >= 1 && n <= kMaxBlocks, "commlab ipc: max_blocks must be 1..", kMaxBlocks);
  max_blocks_ = static_cast<int>(n);
}

void IpcComm::check_usable() const {
  if (fork_generation_ != fork_generation()) {
    throw ForkedError("commlab ipc: this process was forked from the one that set up this group's CUDA IPC "
                      "buffers; a forked child cannot take part in its parent's collectives");
  }
  TORCH_CHECK(block_ != nullptr, "commlab ipc: communicator is closed");
  TORCH_CHECK(connected_, "commlab ipc: peers' buffers are not mapped yet");
  if (!broken_.empty()) throw std::runtime_error("commlab ipc: unusable after an earlier failure: " + broken_);
}

void IpcComm::allreduce(const at::Tensor& t, int64_t op, int64_t mode) {
  check_usable();
  TORCH_CHECK(t.is_cuda() && t.get_device() == device_, "commlab ipc: tensor must be on cuda:", device_,
              ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "commlab ipc: tensor must be contiguous");
  TORCH_CHECK(op >= 0 && op <= kAvgRecord, "commlab ipc: op code must be 0..4 (4: AVG, summed)");
  TORCH_CHECK(mode >= 0 && mode <= 2, "commlab ipc: mode must be an IpcMode (0 auto, 1 one-shot, 2 two-shot)");
  const auto imode = static_cast<IpcMode>(mode);
  const int64_t numel = t.numel();
  if (world_ == 1) return;
  const int64_t elsize = t.element_size();
  const int64_t chunk = capacity_ / elsize;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  const DType dtype = to_dtype(t.scalar_type(), "ipc");
  ipc::Launch launch{};
  for (int q = 0; q < world_; ++q) launch.blocks[q] = peers_[q];
  launch.rank = rank_;
  launch.world = world_;
  launch.op = reduction_of(static_cast<int>(op));
  launch.timeout_ns = static_cast<uint64_t>(timeout_ms_) * 1000000ull;
  launch.err = static_cast<IpcError*>(error_dev_);
  char* base = static_cast<char*>(t.data_ptr());
  // An empty call still runs one kernel of no elements: its start barrier compares the
  // call's record with every peer's, so a peer with data meets a mismatch, not a deadline.
  for (int64_t off = 0; off < numel || (numel == 0 && off == 0); off += chunk) {
    const int64_t n = std::min(chunk, numel - off);
    const uint64_t seq = ++seq_;
    const int64_t data_offset = kSignalBytes + static_cast<int64_t>(seq & 1) * capacity_;
    C10_CUDA_CHECK(cudaMemcpyAsync(block_ + data_offset, base + off * elsize, n * elsize, cudaMemcpyDeviceToDevice,
                                   stream));
    const bool two_shot = imode == IpcMode::kTwoShot || (imode == IpcMode::kAuto && n * elsize > oneshot_max_);
    const int64_t work = two_shot ? (n + world_ - 1) / world_ : n;
    // Same on every rank (a function of the call alone): block b meets block b.
    const int grid = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, max_blocks_));
    launch.data_offset = data_offset;
    launch.out = base + off * elsize;
    launch.numel = n;
    launch.grid = grid;
    launch.seq = seq;
    launch.two_shot = two_shot;
    launch.code = ipc::call_code(static_cast<int>(dtype), static_cast<int>(op), two_shot, grid);
    C10_CUDA_CHECK(ipc::launch_allreduce(dtype, launch, stream));
  }
  // The deadline is enforced on the GPU; the host learns of a give-up only once the
  // stream drained, so the call is synchronous (like gloo's CUDA path).
  wait_done(stream);
  const auto* e = static_cast<const volatile IpcError*>(error_host_);
  if (e->peer >= 0 && e->mismatch) {
    auto describe = [](int64_t seq, int64_t numel, int64_t code) {
      std::ostringstream d;
      d << "call " << seq << " with " << numel << " elements (dtype code " << (code & 0xff) << ", op " << ((code >> 8) & 0xff)
        << ", " << ((code >> 16) & 1 ? "two-shot" : "one-shot") << ", " << ((code >> 24) & 0xff) << " blocks)";
      return d.str();
    };
    std::ostringstream msg;
    msg << "commlab ipc: mismatch: rank " << global_ranks_[rank_] << " runs "
        << describe(static_cast<int64_t>(e->seq), e->my_numel, e->my_code) << "; rank " << global_ranks_[e->peer]
        << " runs " << describe(e->their_seq, e->their_numel, e->their_code);
    broken_ = msg.str();
    failed_peer_ = e->peer;
    throw MismatchError(broken_);
  }
  if (e->peer >= 0) {
    const int pa = e->peer_abort;
    const int cause = (pa & ipc::kAbortRankMask) - 1;
    std::ostringstream msg;
    msg << "commlab ipc: rank " << global_ranks_[rank_] << " waited for rank " << global_ranks_[e->peer]
        << " at the " << (e->barrier == 0 ? "start" : "middle") << " barrier of call " << e->seq;
    if (e->relayed && (pa & ipc::kAbortMismatch)) {
      msg << ": mismatch: rank " << global_ranks_[e->peer] << " gave up because rank " << global_ranks_[cause]
          << " called differently";
      broken_ = msg.str();
      failed_peer_ = cause;
      throw MismatchError(broken_);
    }
    if (e->relayed && (pa & ipc::kAbortInterrupted)) {
      msg << ": rank " << global_ranks_[cause] << " was interrupted by a signal and stopped";
    } else if (e->relayed) {
      msg << ": rank " << global_ranks_[e->peer] << " had given up after losing rank " << global_ranks_[cause];
    } else {
      msg << " for more than " << timeout_ms_ << " ms (it had reached call " << e->seen << ")";
    }
    broken_ = msg.str();
    failed_peer_ = e->relayed ? cause : e->peer;
    throw PeerLostError(broken_);
  }
}

void IpcComm::wait_done(cudaStream_t stream) {
  C10_CUDA_CHECK(cudaEventRecord(done_, stream));
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto next_check = start + std::chrono::milliseconds(20);
  while (true) {
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) C10_CUDA_CHECK(q);
    const auto now = clock::now();
    // Poll hard for a millisecond (small calls finish in microseconds), then gently.
    if (now - start > std::chrono::milliseconds(1)) std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(20);
      stop_if_signalled();
    }
  }
}

void IpcComm::stop_if_signalled() {
  auto raised = pending_signal();
  if (!raised) return;
  // Stop our kernels (they watch our abort word at every barrier); peers see the same
  // word and give up too, naming this rank as interrupted.
  *abort_host_ = ipc::kAbortInterrupted | (rank_ + 1);
  cudaMemcpyAsync(ipc::abort_word(block_), abort_host_, sizeof(int), cudaMemcpyHostToDevice, side_);
  cudaStreamSynchronize(side_);
  cudaEventSynchronize(done_);
  broken_ = "commlab ipc: rank " + std::to_string(global_ranks_[rank_]) + " was interrupted by a signal";
  throw *raised;
}

void IpcComm::release_resources() {
  for (int q = 0; q < static_cast<int>(peers_.size()); ++q) {
    if (opened_[q]) cudaIpcCloseMemHandle(peers_[q]);
    opened_[q] = false;
    if (q != rank_) peers_[q] = nullptr;
  }
  if (block_ != nullptr) cudaFree(block_);
  block_ = nullptr;
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  error_host_ = error_dev_ = nullptr;
  if (abort_host_ != nullptr) cudaFreeHost(abort_host_);
  abort_host_ = nullptr;
  if (side_ != nullptr) cudaStreamDestroy(side_);
  side_ = nullptr;
  if (done_ != nullptr) cudaEventDestroy(done_);
  done_ = nullptr;
  cudaGetLastError();  // nothing to report at teardown
  connected_ = false;
}

void IpcComm::close() {
  if (block_ == nullptr && done_ == nullptr) return;
  // A forked child has no usable CUDA context: it only forgets its copies.
  if (fork_generation_ != fork_generation()) {
    block_ = nullptr;
    done_ = nullptr;
    return;
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  release_resources();
}

}  // namespace commlab
#endif  // COMMLAB_WITH_CUDA
