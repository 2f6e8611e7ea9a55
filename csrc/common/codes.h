// The one set of codes every part of commlab._C shares: element types, reduction ops
// and transport modes. Plain enums, no torch headers, so the per-instruction-set loops
// and the CUDA kernel files can use them. Python mirrors them (commlab/core/reduction.py
// Op, commlab/transports/shm.py and ipc.py Mode); tests compare both sides through
// commlab._C.codes().
#pragma once

#include <cstdint>

namespace commlab {

// kU8 stays last: loops over every type (the CUDA preload) walk the values up to it.
enum class DType : int { kF32 = 0, kF64, kF16, kBF16, kI32, kI64, kU8 };

// AVG is SUM followed by one division, done in Python: no reduction runs it.
enum class RedOp : int { kSum = 0, kProduct = 1, kMin = 2, kMax = 3 };

// The op code of a caller's AVG where a transport records the call (shared memory's and
// CUDA IPC's call records): ranks that average and ranks that sum must not pair.
constexpr int kAvgRecord = 4;

// The reduction a recorded op code runs: AVG's is SUM.
inline RedOp reduction_of(int op) { return op == kAvgRecord ? RedOp::kSum : static_cast<RedOp>(op); }

// Which collective a call is, in the call records of shared memory: ranks that called
// different collectives fail with a mismatch instead of exchanging the wrong data.
enum CallKind : int32_t { kAllReduce = 0, kAllGather = 1, kReduceScatter = 2, kBroadcast = 3, kBarrier = 4, kAllToAll = 5 };

// Shared memory: one-shot (every rank reduces all inputs), two-shot (reduce-scatter
// then gather), root (rank 0 reduces, the parameter-server pattern); auto picks one- or
// two-shot by size.
enum class ShmMode : int { kAuto = 0, kOneShot = 1, kTwoShot = 2, kRoot = 3 };

// CUDA IPC: the same choice without the root mode.
enum class IpcMode : int { kAuto = 0, kOneShot = 1, kTwoShot = 2 };

}  // namespace commlab
