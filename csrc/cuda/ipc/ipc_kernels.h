// Launch interface of the CUDA IPC all-reduce kernels (ipc_kernels.cu). Kept free of
// torch headers on purpose: nvcc spends minutes per target on them, the kernels need
// none, so the kernels compile in seconds and the host side (ipc_comm.cpp) is C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../common/codes.h"

namespace commlab {
namespace ipc {

constexpr int kMaxRanks = 8;     // one node's GPUs
constexpr int kMaxBlocks = 64;   // every block of every rank must be resident at once
constexpr int kThreads = 512;
constexpr int64_t kSignalBytes = 64 << 10;  // signal area; keeps the data buffers aligned

// A rank's abort word (in its signal area): 0, or why it gave up, | (1 + a group rank):
// lost (that peer missed the deadline, or had given up), mismatch (that peer called
// differently), interrupted (its own host thread took a signal and stopped its kernels).
constexpr int kAbortLost = 0;
constexpr int kAbortInterrupted = 1 << 20;
constexpr int kAbortMismatch = 1 << 21;
constexpr int kAbortRankMask = kAbortInterrupted - 1;

// Host-mapped: the host reads it once the stream finished, without a copy.
struct Error {
  int peer;      // group rank waited for in vain or called differently, -1 when none
  int barrier;   // 0 start, 1 middle
  int relayed;   // 1 when that peer had itself given up: its abort word follows
  int peer_abort;
  uint64_t seq;
  uint64_t seen;
  int mismatch;  // 1 when the peer's call differs: its record follows
  int64_t my_numel, my_code, their_seq, their_numel, their_code;
};

// What every rank must agree on for a call, compared on the GPU after the first
// barrier (a mismatch would otherwise read garbage or wait out the deadline). The
// grid is part of it: block b of every rank meets block b of every other.
inline int64_t call_code(int dtype, int op, bool two_shot, int grid) {
  return dtype | (op << 8) | (int64_t{two_shot} << 16) | (int64_t{grid} << 24);
}

struct Launch {
  char* blocks[kMaxRanks];  // every rank's block as this device sees it
  int64_t data_offset;      // where this call's input sits in every block
  void* out;                // the caller's chunk
  int64_t numel;
  int rank, world, grid;
  RedOp op;
  uint64_t seq;             // call number: 64-bit, so a stale flag never reads as a later call
  bool two_shot;
  int64_t code;             // call_code() of this call
  uint64_t timeout_ns;
  Error* err;               // device view of the host-mapped Error
};

// Loads every kernel of this file now (see ipc_kernels.cu).
cudaError_t preload();

cudaError_t launch_allreduce(DType dtype, const Launch& args, cudaStream_t stream);

// Device address of the abort word in a rank's block (the host stops its own
// kernels by writing it from another stream).
int* abort_word(char* block);

}  // namespace ipc
}  // namespace commlab
