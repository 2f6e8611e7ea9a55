// Point-to-point calls' records (transports/p2p.py) on the group's shared memory: the
// check that ranks called alike, without a rendezvous.
//
// Each rank publishes its call's record as a piece without data, then compares it with
// the record of every peer already in the call; a peer not there yet compares ours when
// it arrives (the record is published before the look, both sequentially consistent:
// of two ranks, the later always sees the earlier). So every pair of ranks in the call
// is compared by one of them before either sends the other a byte, and nobody waits for
// a peer that has not arrived: the messages the algorithm sends anyway do that.
#include <pybind11/pybind11.h>

#include <cstring>

#include "layout.h"

namespace commlab {
namespace {

bool same_record(const CallInfo& a, const CallInfo& b) {
  return a.piece_seq == b.piece_seq && a.call == b.call && a.total == b.total && a.index == b.index &&
         a.nbytes == b.nbytes && a.dtype == b.dtype && a.op == b.op && a.mode == b.mode && a.kind == b.kind &&
         a.root == b.root;
}

}  // namespace

bool ShmComm::post_record(int64_t kind, int64_t elements, int64_t dtype, int64_t op, int64_t algorithm, int64_t root,
                          bool wait_all) {
  check_usable();
  bool differs = false;
  guarded([&] {
    const uint64_t c = ++seq_;
    record_seq_ = c;
    // The algorithm's code rides in the mode field: point-to-point calls have no mode.
    begin(c, Call{static_cast<int32_t>(kind), elements, static_cast<int32_t>(dtype), static_cast<int32_t>(op),
                  static_cast<int32_t>(algorithm), static_cast<int32_t>(root)},
          kRecordIndex, 0);
    const CallInfo& mine = segs_[rank_]->ctl()->info[c & 1];
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      if (wait_all) {
        wait_for(j, at(c, kWritten));
      } else if (segs_[j]->ctl()->seq.seq.load(std::memory_order_seq_cst) < at(c, kWritten)) {
        continue;  // not in this call yet: it compares ours when it arrives
      }
      const CallInfo& theirs = segs_[j]->ctl()->info[c & 1];
      if (theirs.index != kRecordIndex) check_info(j, c, true);  // a shared-memory call: that protocol's mismatch
      if (same_record(mine, theirs)) continue;
      // Defensive: a peer that wrote this slot again left this call, which it can only do
      // having compared our record or with our data (whatever it runs next waits for us).
      std::atomic_thread_fence(std::memory_order_acquire);
      if (__atomic_load_n(&theirs.piece_seq, __ATOMIC_RELAXED) > c) continue;
      differs = true;
    }
  }, wait_all);
  unsynced_ = !wait_all;
  return differs;
}

// Pieces go in lockstep within one (a piece's buffers are written again two pieces on,
// once every peer published the piece between, having read the one before): a record
// that waited for no peer breaks the step, so the next call that moves data through the
// segments first waits for every peer's record.
void ShmComm::settle() {
  for (int j = 0; j < world_; ++j) {
    if (j != rank_) wait_for(j, at(record_seq_, kWritten));
  }
  unsynced_ = false;
}

std::vector<int64_t> ShmComm::records() {
  check_usable();
  const uint64_t c = record_seq_;
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(world_) * 9);
  pybind11::gil_scoped_release no_gil;
  for (int j = 0; j < world_; ++j) {
    if (j != rank_) wait_for(j, at(c, kWritten));
    const CallInfo& ci = segs_[j]->ctl()->info[c & 1];
    const int64_t row[9] = {static_cast<int64_t>(ci.piece_seq), static_cast<int64_t>(ci.call), ci.kind, ci.total,
                            ci.dtype, ci.op, ci.mode, ci.root, ci.index};
    rows.insert(rows.end(), row, row + 9);
  }
  return rows;
}

std::tuple<int64_t, int64_t, std::string> ShmComm::peer_abort() const {
  std::tuple<int64_t, int64_t, std::string> found{0, -1, std::string()};
  for (int j = 0; j < world_; ++j) {
    if (j == rank_ || segs_[j] == nullptr) continue;
    const AbortLine& a = segs_[j]->ctl()->abort;
    const uint64_t w = a.word.load(std::memory_order_acquire);
    if (w == 0) continue;
    const int64_t state = static_cast<uint32_t>(w >> 32) == kMismatch ? 2 : 1;
    if (state > std::get<0>(found)) {  // a mismatch first: another rank's give-up must not hide it
      found = {state, global_ranks_[j], std::string(a.reason, strnlen(a.reason, kReasonBytes))};
    }
  }
  return found;
}

}  // namespace commlab
