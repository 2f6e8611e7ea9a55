// The five collectives over the segments, in pieces of at most a buffer: all-reduce
// (one-shot, two-shot, root), all-gather, reduce-scatter, broadcast (through the root's
// buffers, or in one copy out of its process) and all-to-all (through the segments, a
// rank's own block straight, or in one copy out of its peers' processes), with their fast paths.
#include "layout.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include "../../common/errors.h"
#include "../../common/fork.h"
#include "../../common/pause.h"
#include "../../common/signals.h"
#include "../reduce/reduce_n.h"

namespace commlab {

void ShmComm::piece(char* dst, const char* src, int64_t total, int64_t index, int64_t nbytes, int64_t elsize,
                    c10::ScalarType dtype, int op, ShmMode mode) {
  const uint64_t c = ++seq_;
  const int par = static_cast<int>(c & 1);
  const int64_t count = nbytes / elsize;
  const void** ptrs = ptrs_.data();

  std::memcpy(segs_[rank_]->data(par, capacity_), src, nbytes);
  begin(c, Call{kAllReduce, total, static_cast<int32_t>(dtype), op, static_cast<int32_t>(mode), -1}, index, nbytes);

  if (mode == ShmMode::kOneShot) {
    // Every rank reduces everything, in rank order: identical bits on every rank.
    for (int j = 0; j < world_; ++j) {
      if (j != rank_) {
        await_checked(j, c, kWritten);
      }
      ptrs[j] = segs_[j]->data(par, capacity_);
    }
    reduce_n_raw(dst, ptrs, world_, count, dtype, reduction_of(op));
    return;
  }

  if (mode == ShmMode::kRoot) {
    if (rank_ == 0) {
      for (int j = 1; j < world_; ++j) {
        await_checked(j, c, kWritten);
      }
      for (int j = 0; j < world_; ++j) ptrs[j] = segs_[j]->data(par, capacity_);
      char* result = segs_[0]->data(par, capacity_);
      reduce_n_raw(result, ptrs, world_, count, dtype, reduction_of(op));
      publish(at(c, kReady));
      std::memcpy(dst, result, nbytes);
    } else {
      await_checked(0, c, kReady);
      std::memcpy(dst, segs_[0]->data(par, capacity_), nbytes);
    }
    return;
  }

  // Two-shot: rank r reduces its 1/p slice from every segment into its own segment,
  // then everyone copies every reduced slice out.
  auto slice = [&](int j, int64_t* off, int64_t* len) {
    const int64_t base = count / world_, extra = count % world_;
    const int64_t start = j * base + std::min<int64_t>(j, extra);
    *off = start * elsize;
    *len = (base + (j < extra ? 1 : 0)) * elsize;
  };
  for (int j = 0; j < world_; ++j) {
    if (j != rank_) {
      await_checked(j, c, kWritten);
    }
  }
  int64_t off, len;
  slice(rank_, &off, &len);
  for (int j = 0; j < world_; ++j) ptrs[j] = segs_[j]->data(par, capacity_) + off;
  reduce_n_raw(segs_[rank_]->data(par, capacity_) + off, ptrs, world_, len / elsize, dtype, reduction_of(op));
  publish(at(c, kReady));
  for (int k = 0; k < world_; ++k) {
    const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
    if (j != rank_) wait_for(j, at(c, kReady));
    slice(j, &off, &len);
    std::memcpy(dst + off, segs_[j]->data(par, capacity_) + off, len);
  }
}

namespace {
// A tensor the fast paths take as it is: what the API's long way would pass unchanged.
bool like_plan(const at::Tensor& t, int64_t dtype) {
  return t.layout() == c10::kStrided && t.device().is_cpu() && static_cast<int64_t>(t.scalar_type()) == dtype &&
         t.is_contiguous() && !t.is_neg() && !t.is_conj();
}
}  // namespace

bool ShmComm::try_allreduce(const at::Tensor& t, int64_t op, int64_t mode, int64_t dtype) {
  // The API's fast path: anything unlike the plan's call goes the long way, untouched.
  if (!like_plan(t, dtype)) return false;
  allreduce(t, op, mode);
  return true;
}

void ShmComm::allreduce(const at::Tensor& t, int64_t op, int64_t mode) {
  check_usable();  // before anything shared is touched (a forked child stops here)
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "commlab shm: needs a contiguous CPU tensor");
  TORCH_CHECK(op >= 0 && op <= kAvgRecord, "commlab shm: op code must be 0..4 (4: AVG, summed)");
  TORCH_CHECK(mode >= 0 && mode <= 3, "commlab shm: mode must be a ShmMode (0..3)");
  const int64_t elsize = t.element_size();
  const int64_t nbytes = t.numel() * elsize;
  if (world_ == 1) return;
  if (nbytes == 0) {
    record_only(Call{kAllReduce, 0, static_cast<int32_t>(t.scalar_type()), static_cast<int32_t>(op),
                     static_cast<int32_t>(mode), -1});
    return;
  }
  // Pieces never split an element and fit one parity buffer.
  const int64_t max_piece = (capacity_ / elsize) * elsize;
  char* data = static_cast<char*>(t.data_ptr());
  const auto dtype = t.scalar_type();
  guarded([&] {
    int64_t index = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      ShmMode m = static_cast<ShmMode>(mode);
      if (m == ShmMode::kAuto) m = (n <= oneshot_max_) ? ShmMode::kOneShot : ShmMode::kTwoShot;
      piece(data + done, data + done, nbytes, index, n, elsize, dtype, static_cast<int>(op), m);
    }
  });
}

namespace {
void check_dense(const at::Tensor& t, const char* what, const char* role) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous() && !t.is_neg() && !t.is_conj(),
              "commlab shm: ", what, "'s ", role, " must be a contiguous CPU tensor");
}

// all_gather's and reduce_scatter's checks: `whole` holds world x `part` elements of
// one dtype. Returns the part's bytes.
int64_t check_pair(const at::Tensor& whole, const char* whole_role, const at::Tensor& part,
                   const char* part_role, const char* what, int world) {
  check_dense(whole, what, whole_role);
  check_dense(part, what, part_role);
  TORCH_CHECK(whole.scalar_type() == part.scalar_type(), "commlab shm: ", what, "'s input and output differ in dtype");
  TORCH_CHECK(whole.numel() == part.numel() * world, "commlab shm: ", what, "'s ", whole_role,
              " must hold world size x ", part_role);
  return part.numel() * part.element_size();
}

// A group of one exchanges nothing: the input is the output. (An empty call in a larger
// group still publishes its record: record_only.)
bool alone(char* dst, const char* src, int64_t nbytes, int world) {
  if (nbytes != 0 && world == 1 && dst != src) std::memmove(dst, src, nbytes);
  return world == 1;
}
}  // namespace

int64_t ShmComm::piece_limit(int64_t elsize) const {
  const int64_t piece = piece_bytes_ > 0 ? std::min(piece_bytes_, capacity_) : capacity_;
  return std::max<int64_t>(1, piece / elsize) * elsize;
}

void ShmComm::allgather(const at::Tensor& out, const at::Tensor& in) {
  check_usable();
  const int64_t nbytes = check_pair(out, "output", in, "input", "all_gather", world_);
  const int64_t elsize = in.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  if (alone(dst, src, nbytes, world_)) return;
  const int64_t max_piece = piece_limit(elsize);
  const Call call{kAllGather, nbytes, static_cast<int32_t>(in.scalar_type()), -1, -1, -1};
  if (nbytes == 0) return record_only(call);
  guarded([&] {
    int64_t index = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      const uint64_t c = ++seq_;
      const int par = static_cast<int>(c & 1);
      std::memcpy(segs_[rank_]->data(par, capacity_), src + done, n);
      begin(c, call, index, n);
      // Our own slice comes from our segment too: `in` may be a view of that very slice of `out`.
      for (int k = 0; k < world_; ++k) {
        const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
        if (j != rank_) await_checked(j, c, kWritten);
        std::memcpy(dst + j * nbytes + done, segs_[j]->data(par, capacity_), n);
      }
    }
  });
}

void ShmComm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, int64_t op) {
  check_usable();
  TORCH_CHECK(op >= 0 && op <= kAvgRecord, "commlab shm: op code must be 0..4 (4: AVG, summed)");
  const int64_t nbytes = check_pair(in, "input", out, "output", "reduce_scatter", world_);  // per rank
  const int64_t elsize = in.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  if (alone(dst, src, nbytes, world_)) return;
  // A piece holds the same stretch of every rank's slice.
  const int64_t max_piece = (capacity_ / (elsize * world_)) * elsize;
  TORCH_CHECK(max_piece > 0, "commlab shm: capacity too small for reduce_scatter among ", world_, " ranks");
  const auto dtype = in.scalar_type();
  const Call call{kReduceScatter, nbytes * world_, static_cast<int32_t>(dtype), static_cast<int32_t>(op), -1, -1};
  if (nbytes == 0) return record_only(call);
  guarded([&] {
    const void** ptrs = ptrs_.data();
    int64_t index = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      const uint64_t c = ++seq_;
      const int par = static_cast<int>(c & 1);
      char* own = segs_[rank_]->data(par, capacity_);
      for (int j = 0; j < world_; ++j) std::memcpy(own + j * n, src + j * nbytes + done, n);
      begin(c, call, index, n);
      for (int j = 0; j < world_; ++j) {
        if (j != rank_) await_checked(j, c, kWritten);
        ptrs[j] = segs_[j]->data(par, capacity_) + rank_ * n;
      }
      reduce_n_raw(dst + done, ptrs, world_, n / elsize, dtype, reduction_of(static_cast<int>(op)));
    }
  });
}

void ShmComm::broadcast(const at::Tensor& t, int64_t root) {
  check_usable();
  check_dense(t, "broadcast", "tensor");
  TORCH_CHECK(root >= 0 && root < world_, "commlab shm: broadcast root ", root, " is not a rank of this group");
  const int64_t elsize = t.element_size();
  const int64_t nbytes = t.numel() * elsize;
  if (world_ == 1) return;
  if (nbytes == 0) {
    return record_only(Call{kBroadcast, 0, static_cast<int32_t>(t.scalar_type()), -1, -1, static_cast<int32_t>(root)});
  }
  // Pieces smaller than a buffer: the root copies one in while the receivers copy the last out.
  const int64_t max_piece = piece_limit(elsize);
  char* data = static_cast<char*>(t.data_ptr());
  const int from = static_cast<int>(root);
  if (single_copy_min_ >= 0 && nbytes >= single_copy_min_ && (single_copy_max_ <= 0 || nbytes < single_copy_max_)) {
    // One copy: every receiver reads the root's tensor out of its process; the root
    // returns once all have (kRead), so the caller may write the tensor again.
    const Call call{kBroadcast, nbytes, static_cast<int32_t>(t.scalar_type()), -1, 1, static_cast<int32_t>(root)};
    guarded([&] {
      const uint64_t c = ++seq_;
      if (rank_ == from) {
        segs_[rank_]->ctl()->info[c & 1].addr = reinterpret_cast<uint64_t>(data);
        begin(c, call, 0, nbytes);
        for (int j = 0; j < world_; ++j) {
          if (j != rank_) await_checked(j, c, kWritten);
        }
        publish(at(c, kReady));
        for (int j = 0; j < world_; ++j) {
          if (j != rank_) wait_for(j, at(c, kRead));
        }
      } else {
        begin(c, call, 0, nbytes);
        await_checked(from, c, kReady);
        read_peer(from, data, segs_[from]->ctl()->info[c & 1].addr, nbytes);
        ++single_copy_calls_;
        publish(at(c, kRead));
      }
    });
    return;
  }
  const Call call{kBroadcast, nbytes, static_cast<int32_t>(t.scalar_type()), -1, -1, static_cast<int32_t>(root)};
  guarded([&] {
    int64_t index = 0;
    uint64_t c = 0;
    for (int64_t done = 0; done < nbytes; done += max_piece, ++index) {
      const int64_t n = std::min(max_piece, nbytes - done);
      c = ++seq_;
      const int par = static_cast<int>(c & 1);
      if (rank_ == from) {
        // The buffer last held piece c - 2, which a receiver has copied out once it is at
        // c - 1 (before this call's first piece, the last call's end saw to that).
        if (index > 0) {
          for (int j = 0; j < world_; ++j) {
            if (j != rank_) await_checked(j, c - 1, kWritten, true);
          }
        }
        std::memcpy(segs_[rank_]->data(par, capacity_), data + done, n);
        // Published at once, arrived or not: each receiver checks the record against its
        // own call before it copies (a late receiver held every other one back before).
        begin(c, call, index, n, kReady);
      } else {
        // Piece c's record slot last held c - 2, the last call's final piece when index is 1:
        // a peer still checking it there (the root published piece 0 without waiting) has
        // not reached c - 1.
        if (index == 1) {
          for (int j = 0; j < world_; ++j) {
            if (j != rank_ && j != from) wait_for(j, at(c - 1, kWritten));
          }
        }
        begin(c, call, index, n);
        await_checked(from, c, kReady, true);
        std::memcpy(data + done, segs_[from]->data(par, capacity_), n);
      }
    }
    // Every rank ends knowing every peer reached the last piece, with the same call: so
    // every buffer is free for the next call, and a mismatch fails every rank.
    for (int j = 0; j < world_; ++j) {
      if (j != rank_ && j != from) await_checked(j, c, kWritten, true);
    }
  });
}

void ShmComm::alltoall(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& send,
                       const std::vector<int64_t>& recv) {
  check_usable();
  check_dense(out, "all_to_all", "output");
  check_dense(in, "all_to_all", "input");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "commlab shm: all_to_all's input and output differ in dtype");
  TORCH_CHECK(static_cast<int>(send.size()) == world_ && static_cast<int>(recv.size()) == world_,
              "commlab shm: all_to_all needs one send and one receive count per rank");
  const int64_t elsize = in.element_size();
  std::vector<int64_t> soff(world_ + 1, 0), roff(world_ + 1, 0);  // byte offsets of each peer's block
  for (int q = 0; q < world_; ++q) {
    TORCH_CHECK(send[q] >= 0 && recv[q] >= 0, "commlab shm: all_to_all counts must not be negative");
    soff[q + 1] = soff[q] + send[q] * elsize;
    roff[q + 1] = roff[q] + recv[q] * elsize;
  }
  TORCH_CHECK(soff[world_] == in.numel() * elsize && roff[world_] == out.numel() * elsize,
              "commlab shm: all_to_all counts must add up to the input's and the output's sizes");
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(in.data_ptr());
  // Blocks land in the output while the input is still read (by this rank and, in one copy, its peers).
  TORCH_CHECK(world_ == 1 || dst + roff[world_] <= src || src + soff[world_] <= dst,
              "commlab shm: all_to_all's input and output must not overlap");
  if (world_ == 1) {
    TORCH_CHECK(send[0] == recv[0], "commlab shm: all_to_all of one rank sends ", send[0], " elements to itself and expects ",
                recv[0]);
    if (send[0] != 0 && dst != src) std::memmove(dst, src, send[0] * elsize);
    return;
  }
  // A piece's buffer: every rank's byte counts (sent to, received from each peer), then
  // one slot per other rank holding the same stretch of its block (a rank's own block goes
  // straight from its input to its output, never through a segment).
  const int64_t head = ((2 * world_ * static_cast<int64_t>(sizeof(int64_t)) + 63) / 64) * 64;
  const int64_t slot = ((capacity_ - head) / (world_ - 1) / 64) * 64;  // a multiple of every element size
  // Where rank `owner`'s segment holds its block for rank `dest` (dest != owner).
  auto slot_at = [&](int owner, int dest) { return head + ((dest - owner - 1 + world_) % world_) * slot; };
  TORCH_CHECK(slot > 0, "commlab shm: capacity too small for all_to_all among ", world_, " ranks");
  // One copy where blocks are large enough: each rank reads its blocks out of its peers'
  // inputs. Every rank takes the same path, decided from the whole matrix of counts; a
  // rank whose own blocks already reach the bound knows it before the matrix, and writes
  // no data into the first piece.
  int64_t own_biggest = 0;
  for (int q = 0; q < world_; ++q) {
    if (q != rank_) own_biggest = std::max({own_biggest, send[q] * elsize, recv[q] * elsize});
  }
  const bool may_single = alltoall_single_copy_min_ >= 0;
  const bool surely_single = may_single && own_biggest >= alltoall_single_copy_min_;
  // The record carries no sizes (they differ by rank): the counts are checked as a whole below.
  // It carries the one-copy bound: ranks that would choose the path differently fail alike.
  const Call call{kAllToAll, alltoall_single_copy_min_, static_cast<int32_t>(in.scalar_type()), -1, -1, -1};
  guarded([&] {
    int64_t pieces = 1;  // known after the first piece, from every rank's counts
    for (int64_t index = 0; index < pieces; ++index) {
      const int64_t done = index * slot;
      const uint64_t c = ++seq_;
      const int par = static_cast<int>(c & 1);
      char* own = segs_[rank_]->data(par, capacity_);
      int64_t* counts = reinterpret_cast<int64_t*>(own);
      for (int q = 0; q < world_; ++q) {
        counts[q] = send[q] * elsize;
        counts[world_ + q] = recv[q] * elsize;
        const int64_t n = std::min(slot, std::max<int64_t>(0, send[q] * elsize - done));
        if (q != rank_ && n > 0 && !surely_single) std::memcpy(own + slot_at(rank_, q), src + soff[q] + done, n);
      }
      if (index == 0) segs_[rank_]->ctl()->info[par].addr = reinterpret_cast<uint64_t>(src);
      begin(c, call, index, slot);
      if (index == 0) {
        // Every rank's counts before any byte lands: each rank checks the whole matrix in
        // the same order, so a disagreement is the same error on every rank.
        int64_t biggest = 0;  // the largest block between two ranks
        for (int j = 0; j < world_; ++j) {
          if (j != rank_) await_checked(j, c, kWritten);
        }
        for (int j = 0; j < world_; ++j) {
          const int64_t* sj = reinterpret_cast<const int64_t*>(segs_[j]->data(par, capacity_));
          for (int q = 0; q < world_; ++q) {
            const int64_t* rq = reinterpret_cast<const int64_t*>(segs_[q]->data(par, capacity_)) + world_;
            if (sj[q] != rq[j]) {
              std::ostringstream msg;
              msg << "commlab shm: mismatch: ranks called all_to_all with splits that disagree: rank "
                  << global_ranks_[j] << " sends " << sj[q] / elsize << " elements to rank " << global_ranks_[q]
                  << ", which expects " << rq[j] / elsize << " from it";
              give_up(kMismatch, global_ranks_[j == rank_ ? q : j], msg.str());
            }
            if (q != j) biggest = std::max(biggest, sj[q]);
          }
        }
        if (send[rank_] > 0) std::memmove(dst + roff[rank_], src + soff[rank_], send[rank_] * elsize);
        if (may_single && biggest >= alltoall_single_copy_min_) {
          // Rank j's block for this rank starts after its blocks for the ranks before this one.
          for (int k = 1; k < world_; ++k) {
            const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
            if (recv[j] == 0) continue;
            const int64_t* sj = reinterpret_cast<const int64_t*>(segs_[j]->data(par, capacity_));
            int64_t at_j = 0;
            for (int q = 0; q < rank_; ++q) at_j += sj[q];
            read_peer(j, dst + roff[j], segs_[j]->ctl()->info[par].addr + at_j, recv[j] * elsize);
          }
          // The input is read by peers until each has published kRead: only then may the caller write it.
          ++single_copy_calls_;
          publish(at(c, kRead));
          for (int j = 0; j < world_; ++j) {
            if (j != rank_) wait_for(j, at(c, kRead));
          }
          return;
        }
        pieces = std::max<int64_t>(1, (biggest + slot - 1) / slot);
      }
      for (int k = 1; k < world_; ++k) {
        const int j = (rank_ + k) % world_;  // start at different peers to spread the reads
        if (index > 0) await_checked(j, c, kWritten);
        const int64_t n = std::min(slot, std::max<int64_t>(0, recv[j] * elsize - done));
        if (n > 0) std::memcpy(dst + roff[j] + done, segs_[j]->data(par, capacity_) + slot_at(j, rank_), n);
      }
    }
  });
}

namespace {
// The other families' fast paths leave empty calls to the long way, which agrees them.
bool plain(const at::Tensor& t, int64_t dtype) { return t.numel() > 0 && like_plan(t, dtype); }

bool share_bytes(const at::Tensor& a, const at::Tensor& b) {
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.numel() * b.element_size() && b0 < a0 + a.numel() * a.element_size();
}
}  // namespace

bool ShmComm::try_allgather(const at::Tensor& out, const at::Tensor& in, int64_t dtype) {
  // The input may be this rank's block of the output: allgather() reads it from the segment.
  if (!plain(out, dtype) || !plain(in, dtype) || out.numel() != in.numel() * world_) return false;
  allgather(out, in);
  return true;
}

bool ShmComm::try_reduce_scatter(const at::Tensor& out, const at::Tensor& in, int64_t op, int64_t dtype) {
  if (!plain(out, dtype) || !plain(in, dtype) || in.numel() != out.numel() * world_ || share_bytes(out, in) ||
      op < 0 || op > 3)
    return false;
  reduce_scatter(out, in, op);
  return true;
}

bool ShmComm::try_broadcast(const at::Tensor& t, int64_t root, int64_t dtype) {
  if (!plain(t, dtype) || root < 0 || root >= world_) return false;
  broadcast(t, root);
  return true;
}

bool ShmComm::try_alltoall(const at::Tensor& out, const at::Tensor& in, int64_t dtype) {
  // Even splits count rows of dim 0, as the API's long way does.
  if (!plain(out, dtype) || !plain(in, dtype) || in.dim() == 0 || out.dim() == 0 || in.size(0) % world_ != 0 ||
      out.size(0) % world_ != 0 || share_bytes(out, in))
    return false;
  const int64_t send = in.size(0) / world_ * (in.numel() / in.size(0));
  const int64_t recv = out.size(0) / world_ * (out.numel() / out.size(0));
  alltoall(out, in, std::vector<int64_t>(world_, send), std::vector<int64_t>(world_, recv));
  return true;
}

}  // namespace commlab
