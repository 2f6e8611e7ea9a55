// A schedule (commlab/schedule: MSCCL's steps) run over the segments, no Python per step.
//
// commlab/schedule/native.py compiles each rank's steps, in one order valid for every
// rank (the checker's), into ops. A message lands in its sender's segment at a slot fixed
// at compile time; the sender's sequence word advances by one for each message it sends
// or receives, so a receiver knows which value announces its message, and a sender knows
// which value of the slot's last reader says the slot is free again. Slots per connection
// are as many as messages the order ever has in flight on it, so waiting in that order
// cannot deadlock. A call runs the ops once per pass over part of every chunk. It starts
// and ends with a record every rank checks (the call's kind, size, dtype, op and the
// schedule's fingerprint): ranks that call differently meet a mismatch before any
// message is read, and at the end every peer has read our slots and the sequence is in
// step again.
#include "layout.h"

#include <climits>
#include <cstring>
#include "../../common/errors.h"
#include "../reduce/reduce_n.h"

namespace commlab {

namespace {
enum OpCode : int64_t { kSend = 0, kRecv = 1, kRecvReduce = 2, kCopy = 3, kReduce = 4 };
// One op: code, src buffer, src chunk, dst buffer, dst chunk, chunks, peer, slot, wait, tick.
constexpr int64_t kFields = 10;
constexpr int64_t kNoWait = INT64_MIN;  // a send into a slot nobody read before
}  // namespace

void ShmComm::run_schedule(const std::vector<at::Tensor>& bufs, const std::vector<int64_t>& shape,
                           const at::Tensor& ops, const std::vector<int64_t>& passes, int64_t op, int64_t kind,
                           int64_t total, int64_t fingerprint, int64_t ticks) {
  check_usable();
  TORCH_CHECK(bufs.size() == 4 && shape.size() == 16, "commlab shm: run_schedule takes i, o, s, h and their shapes");
  TORCH_CHECK(ops.dim() == 2 && ops.size(1) == kFields && ops.scalar_type() == at::kLong && ops.is_contiguous(),
              "commlab shm: run_schedule's ops must be an (n, 10) int64 tensor");
  TORCH_CHECK(op >= -1 && op <= kAvgRecord, "commlab shm: op code must be -1 or 0..4");
  if (world_ == 1) return;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  char* base[4] = {nullptr, nullptr, nullptr, nullptr};
  for (int b = 0; b < 4; ++b) {
    if (bufs[b].defined() && bufs[b].numel() > 0) {
      TORCH_CHECK(bufs[b].device().is_cpu() && bufs[b].is_contiguous(), "commlab shm: schedule buffers must be contiguous CPU tensors");
      if (dtype == c10::ScalarType::Undefined) dtype = bufs[b].scalar_type();
      TORCH_CHECK(bufs[b].scalar_type() == dtype, "commlab shm: schedule buffers differ in dtype");
      base[b] = static_cast<char*>(bufs[b].data_ptr());
    }
  }
  TORCH_CHECK(dtype != c10::ScalarType::Undefined, "commlab shm: a schedule call with no buffer");
  TORCH_CHECK(passes.size() % 2 == 0, "commlab shm: passes are (offset, elements) pairs");
  const int64_t elsize = c10::elementSize(dtype);
  const int64_t n = ops.size(0);
  const int64_t* o = ops.data_ptr<int64_t>();
  // Chunk k of buffer b in a pass over elements [off, off + elems) of every chunk: the
  // caller's i and o in block k / per at `stride`, chunk k % per at `step`, from `offset`;
  // scratch and hold (b >= 2) hold the pass's chunks back to back.
  int64_t off = 0, elems = 0;
  auto where = [&](int64_t b, int64_t k) -> char* {
    if (b >= 2) return base[b] + k * elems * elsize;
    const int64_t* s = shape.data() + 4 * b;
    return base[b] + ((k / s[0]) * s[1] + (k % s[0]) * s[2] + s[3] + off) * elsize;
  };
  for (size_t p = 0; p < passes.size(); p += 2) {  // every chunk an op names lies inside its buffer
    off = passes[p];
    elems = passes[p + 1];
    TORCH_CHECK(off >= 0 && elems > 0, "commlab shm: a pass of ", elems, " elements at ", off);
    for (int64_t x = 0; x < n; ++x) {
      const int64_t* f = o + x * kFields;
      for (int side = 0; side < 2; ++side) {
        const int64_t b = f[1 + 2 * side], k = f[2 + 2 * side];
        if (b < 0) continue;
        TORCH_CHECK(b < 4 && base[b] != nullptr && k >= 0 && f[5] > 0, "commlab shm: schedule op ", x,
                    " names a missing buffer");
        TORCH_CHECK(where(b, k + f[5] - 1) + elems * elsize <= base[b] + bufs[b].numel() * elsize,
                    "commlab shm: schedule op ", x, " runs past its buffer");
      }
      if (f[0] == kSend || f[0] == kRecv || f[0] == kRecvReduce) {
        TORCH_CHECK(f[6] >= 0 && f[6] < world_ && f[6] != rank_, "commlab shm: schedule op ", x, " names peer ", f[6]);
        TORCH_CHECK((f[7] + f[5]) * elems * elsize <= 2 * capacity_, "commlab shm: schedule op ", x,
                    "'s slot is past the segment");
      }
    }
  }
  const Call call{static_cast<int32_t>(kind), total, static_cast<int32_t>(dtype), static_cast<int32_t>(op),
                  static_cast<int32_t>(fingerprint), -1};
  const RedOp red = reduction_of(static_cast<int>(op < 0 ? 0 : op));
  guarded([&] {
    const uint64_t c0 = ++seq_;
    begin(c0, call, 0, static_cast<int64_t>(passes.size() / 2));
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) await_checked(j, c0, kWritten, true);  // a peer past c0 compared our records first
    }
    char* own = segs_[rank_]->data(0, capacity_);  // both parity buffers: one region of 2 x capacity
    const void* ptrs[2];
    for (size_t p = 0; p < passes.size(); p += 2) {
      off = passes[p];
      elems = passes[p + 1];
      const int64_t chunk = elems * elsize;
      const uint64_t first = c0 + (p / 2) * static_cast<uint64_t>(ticks);  // this pass's ticks follow it
      for (int64_t x = 0; x < n; ++x) {
        const int64_t* f = o + x * kFields;
        const int64_t cnt = f[5];
        switch (f[0]) {
          case kSend: {
            // The slot's last reader is past it: in this pass (wait > 0), or the last (wait <= 0).
            if (f[8] > 0 || (f[8] != kNoWait && p > 0)) wait_for(static_cast<int>(f[6]), at(first + f[8], kWritten));
            char* slot = own + f[7] * chunk;
            for (int64_t k = 0; k < cnt; ++k) std::memcpy(slot + k * chunk, where(f[1], f[2] + k), chunk);
            publish(at(first + f[9], kWritten));
            break;
          }
          case kRecv:
          case kRecvReduce: {
            const int peer = static_cast<int>(f[6]);
            wait_for(peer, at(first + f[8], kWritten));
            const char* slot = segs_[peer]->data(0, capacity_) + f[7] * chunk;
            for (int64_t k = 0; k < cnt; ++k) {
              char* dst = where(f[3], f[4] + k);
              if (f[0] == kRecv) {
                std::memcpy(dst, slot + k * chunk, chunk);
              } else {  // received (op) local, as MSCCL's runtime folds
                ptrs[0] = slot + k * chunk;
                ptrs[1] = where(f[1], f[2] + k);
                reduce_n_raw(dst, ptrs, 2, elems, dtype, red);
              }
            }
            publish(at(first + f[9], kWritten));
            break;
          }
          case kCopy:
            for (int64_t k = 0; k < cnt; ++k) {
              char* dst = where(f[3], f[4] + k);
              const char* src = where(f[1], f[2] + k);
              if (dst != src) std::memcpy(dst, src, chunk);
            }
            break;
          case kReduce:  // dst = src (op) dst
            for (int64_t k = 0; k < cnt; ++k) {
              char* dst = where(f[3], f[4] + k);
              ptrs[0] = where(f[1], f[2] + k);
              ptrs[1] = dst;
              reduce_n_raw(dst, ptrs, 2, elems, dtype, red);
            }
            break;
          default:
            TORCH_CHECK(false, "commlab shm: schedule op ", x, " has unknown code ", f[0]);
        }
      }
    }
    // Every rank's sequence to the same piece, and every peer past its last read of our
    // slots: what runs next may write our segment's buffers at once (a point-to-point
    // call's gathered counts do, without waiting for anybody).
    const uint64_t c1 = c0 + (passes.size() / 2) * static_cast<uint64_t>(ticks) + 1;
    seq_ = c1;
    begin(c1, call, 1, static_cast<int64_t>(passes.size() / 2));
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) await_checked(j, c1, kWritten, true);
    }
  });
}

}  // namespace commlab
