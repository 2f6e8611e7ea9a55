// Shared-memory collectives for CPU ranks on one host: all-reduce (one-shot, two-shot,
// root), and the pieces of two-shot on their own (all-gather, reduce-scatter), broadcast,
// all-to-all and barrier, which the torch.distributed backend serves through the same sequence.
//
// Each rank owns one segment (created O_EXCL, mode 0600, name from a 128-bit token the
// group agreed on), with a header validated on attach, a sequence counter and a futex
// word on cache lines of their own, and two data buffers used by piece parity. A
// rank's counter only grows (piece*4 + phase) and waiters accept "this phase or
// later", so two buffers are enough and no call needs a trailing barrier: a peer can
// only start writing buffer b again after everyone has announced the next piece, which
// each rank does only after it stopped reading buffer b.
//
// Every piece carries a record of the whole call (call number, total bytes, piece
// index, dtype, op, mode) that peers compare before reading its data, so no piece
// pairs with a piece of another call. A rank that gives up for any reason (mismatch,
// deadline, dead peer, signal, error) marks its segment aborted with the reason and
// wakes every waiter: all ranks fail at once, with the same cause.
//
// By the end of piece c every rank has seen (itself or through a peer that waited on all)
// every rank at piece c: a waiter for a peer's second phase first checks that peer's
// record, so ranks that called different collectives always meet a check, never a wait
// that cannot end.
#pragma once

#include "../../common/torch_lite.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "../../common/codes.h"

namespace commlab {

class ShmComm {
 public:
  // Creates, sizes, pre-faults and maps this rank's own segment.
  ShmComm(const std::string& token_hex, int64_t rank, int64_t world, int64_t capacity,
          int64_t timeout_ms, std::vector<int64_t> global_ranks);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  void attach();      // map and validate every peer's segment
  void unlink_own();  // remove our name once every rank has mapped it
  // op: RedOp's code, or 4 for the caller's AVG (recorded as AVG, reduced as SUM: the API
  // divides). An empty tensor still publishes its call's record and checks its peers'.
  void allreduce(const at::Tensor& t, int64_t op, int64_t mode);
  // allreduce() for a call like the plan's (CPU, strided, contiguous, this dtype); false, touching nothing,
  // for any other tensor.
  bool try_allreduce(const at::Tensor& t, int64_t op, int64_t mode, int64_t dtype);
  // out (world * n elements) = every rank's in (n elements), in rank order.
  void allgather(const at::Tensor& out, const at::Tensor& in);
  // out (n elements) = the reduction of every rank's slice `rank` of in (world * n elements).
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, int64_t op);
  void broadcast(const at::Tensor& t, int64_t root);
  // out (sum(recv) elements: recv[j] from rank j, in rank order) = every rank's block for
  // this rank (send[q] of in's elements go to rank q, in rank order); every rank checks the
  // whole matrix of counts before any byte lands. out and in must not overlap.
  void alltoall(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& send,
                const std::vector<int64_t>& recv);
  // The other families' fast paths, like try_allreduce: the call if every tensor is like
  // the plan's (contiguous CPU tensors of scalar type `dtype`, not empty, sizes that fit,
  // no input and output sharing bytes where the API would make a private result); false,
  // touching nothing, for any other call, which then takes the API's long way.
  bool try_allgather(const at::Tensor& out, const at::Tensor& in, int64_t dtype);
  bool try_reduce_scatter(const at::Tensor& out, const at::Tensor& in, int64_t op, int64_t dtype);
  bool try_broadcast(const at::Tensor& t, int64_t root, int64_t dtype);
  // Even splits along dim 0 (all_to_all_single without split sizes).
  bool try_alltoall(const at::Tensor& out, const at::Tensor& in, int64_t dtype);
  void barrier();
  // One call of a compiled schedule (commlab/schedule/native.py): bufs i, o, s, h (undefined
  // where absent), shape their (chunks per block, block stride, chunk stride, offset) in elements, ops an (n, 10) int64
  // program; kind, total and fingerprint make the call's record.
  // passes: (offset, elements) pairs, each a run of the ops over part of every chunk.
  void run_schedule(const std::vector<at::Tensor>& bufs, const std::vector<int64_t>& shape, const at::Tensor& ops,
                    const std::vector<int64_t>& passes, int64_t op, int64_t kind, int64_t total, int64_t fingerprint,
                    int64_t ticks);
  // Whether this rank can read every peer's memory in one copy (process_vm_readv: same
  // user, ptrace allowed, one PID namespace); collective use needs every rank's yes.
  bool probe_single_copy();
  // Broadcasts of [min, max) bytes go in one copy; min < 0: never (max <= 0: no upper bound).
  int64_t single_copy_min() const { return single_copy_min_; }
  void set_single_copy_min(int64_t bytes) { single_copy_min_ = bytes; }
  int64_t single_copy_max() const { return single_copy_max_; }
  void set_single_copy_max(int64_t bytes) { single_copy_max_ = bytes; }
  // All-to-alls whose largest block between two ranks has at least this many bytes go in
  // one copy (< 0: never); every rank must set the same.
  int64_t alltoall_single_copy_min() const { return alltoall_single_copy_min_; }
  void set_alltoall_single_copy_min(int64_t bytes) { alltoall_single_copy_min_ = bytes; }
  // Calls in which this rank read a peer's memory in one copy (broadcast receivers, all-to-all).
  uint64_t single_copy_calls() const { return single_copy_calls_; }
  // Bytes per piece of a broadcast or all-gather through the segments (<= 0 or above capacity: capacity).
  int64_t piece_bytes() const { return piece_bytes_; }
  void set_piece_bytes(int64_t bytes) { piece_bytes_ = bytes; }
  // Gives up on this communicator for a reason found outside it (another stage of a
  // hierarchical call failed, a point-to-point call's records differ): peers waiting on
  // this rank fail at once, with `why` (as a mismatch where `mismatch`).
  void abort(const std::string& why, bool mismatch = false);

  // A point-to-point call's record (transports/p2p.py, records.cpp): published as a piece
  // without data and compared with the record of every peer already in the call; with
  // `wait_all`, with every peer's. Returns whether a peer's record differs (the caller
  // words the error from records()); a peer in another transport's call fails here as a
  // mismatch of this protocol.
  bool post_record(int64_t kind, int64_t elements, int64_t dtype, int64_t op, int64_t algorithm, int64_t root,
                   bool wait_all);
  // Every rank's record of the last posted call, waited for: per rank [piece, call, kind,
  // elements, dtype, op, algorithm, root, index] (index -1: a point-to-point record;
  // otherwise a shared-memory call's piece, its elements in bytes).
  std::vector<int64_t> records();
  // A peer that gave up, without waiting: (1, or 2 on a mismatch; its global rank; its
  // reason), or (0, -1, ""). Read by the thread that watches a long point-to-point wait.
  std::tuple<int64_t, int64_t, std::string> peer_abort() const;
  void close();

  // Removes every rank's segment name of a group (after a failed setup: survivors
  // clean up for a rank that died between creating its segment and the unlink).
  static int64_t unlink_names(const std::string& token_hex, int64_t world);

  int64_t capacity() const { return capacity_; }
  int64_t oneshot_max() const { return oneshot_max_; }
  void set_oneshot_max(int64_t bytes) { oneshot_max_ = bytes; }
  int64_t spin() const { return spin_; }
  void set_spin(int64_t n) { spin_ = static_cast<int>(std::max<int64_t>(0, n)); }
  int64_t yield_us() const { return yield_us_; }
  void set_yield_us(int64_t us) { yield_us_ = static_cast<int>(std::max<int64_t>(0, us)); }
  // A peer whose heartbeat stood still this long is named frozen (<= 0: never).
  int64_t peer_timeout_ms() const { return peer_timeout_ms_; }
  void set_peer_timeout_ms(int64_t ms) { peer_timeout_ms_ = ms; }
  std::string segment_name(int64_t rank) const;
  uint64_t calls() const { return calls_; }
  // Global rank this rank lost (waited for in vain, or whose give-up it relays), or -1.
  int64_t failed_peer() const { return failed_peer_; }

 private:
  struct Segment;
  struct Call;
  template <class Body>
  void guarded(Body&& body, bool may_wait = true);
  // A rank's sequence word is piece * 4 + phase; a piece passes its phases in this order.
  enum Phase : uint64_t {
    kWritten = 1,  // the piece's record, and its input where it has one, are in the segment
    kReady = 2,    // what peers read of it is ready: a reduced slice or result, the root's data
    kRead = 3,     // a reader copied it out of its peer's buffer (one-copy broadcast and all-to-all)
  };
  static constexpr uint64_t at(uint64_t piece, uint64_t phase) { return piece * 4 + phase; }
  void begin(uint64_t c, const Call& call, int64_t index, int64_t nbytes, uint64_t phase = kWritten);
  void record_only(const Call& call);
  void await_checked(int peer, uint64_t c, uint64_t phase, bool peer_may_be_past = false);
  void check_usable() const;
  void publish(uint64_t value);
  void wait_for(int peer, uint64_t target);
  void wait_seq(int peer, uint64_t target);
  void check_signals();
  void mark_aborted(uint32_t kind, int64_t cause, const std::string& why);
  [[noreturn]] void fail(uint32_t kind, int64_t lost, const std::string& msg);
  [[noreturn]] void give_up(uint32_t kind, int64_t cause, const std::string& why);
  [[noreturn]] void relay(int peer);
  void check_aborts();
  void check_info(int peer, uint64_t piece_seq, bool peer_may_be_past = false);
  bool peer_alive(int peer) const;
  void read_peer(int peer, char* dst, uint64_t addr, int64_t nbytes);
  // Bytes a broadcast or all-gather moves per piece: piece_bytes_ (capacity if unset or
  // larger), a whole number of elements and at least one.
  int64_t piece_limit(int64_t elsize) const;
  void piece(char* dst, const char* src, int64_t total, int64_t index, int64_t nbytes, int64_t elsize,
             c10::ScalarType dtype, int op, ShmMode mode);
  [[noreturn]] void fail_wait(int peer, uint64_t target, uint32_t kind, const char* why);

  std::string token_;
  int rank_;
  int world_;
  int64_t capacity_;
  int64_t timeout_ms_;
  int64_t oneshot_max_;
  int spin_;
  int yield_us_;
  int64_t peer_timeout_ms_ = 5000;
  int64_t single_copy_min_ = -1;
  int64_t single_copy_max_ = 0;
  int64_t alltoall_single_copy_min_ = -1;
  int64_t piece_bytes_ = 0;
  uint64_t fork_generation_;
  std::vector<int64_t> global_ranks_;
  std::vector<Segment*> segs_;
  std::vector<const void*> ptrs_;  // reduction inputs of a piece, reused
  bool own_unlinked_ = false;
  uint64_t seq_ = 0;    // pieces run so far
  uint64_t calls_ = 0;  // calls run so far
  uint64_t single_copy_calls_ = 0;
  uint64_t record_seq_ = 0;  // the piece of the last point-to-point record (post_record)
  // A record that waited for no peer was the last piece: a peer may still be reading the
  // piece before it, whose buffers and record slot the next piece would write (settle).
  bool unsynced_ = false;
  void settle();
  bool in_call_ = false;  // inside guarded(): a give-up now is this call's
  std::string broken_;
  int64_t failed_peer_ = -1;
};

}  // namespace commlab
