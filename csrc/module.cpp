// Python bindings of commlab._C. The CUDA entry points exist only when setup.py
// compiled csrc/cuda (COMMLAB_WITH_CUDA); `has_cuda()` tells Python which build it got.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "common/errors.h"
#include "common/codes.h"
#include "cpu/reduce/reduce_n.h"
#include "cpu/shm/handoff.h"
#include "cpu/shm/shm_comm.h"
#ifdef COMMLAB_WITH_CUDA
#include "cuda/ipc/ipc_comm.h"
#endif

namespace commlab {
#ifdef COMMLAB_WITH_CUDA
void reduce_n_cuda(const torch::Tensor& out, const std::vector<torch::Tensor>& inputs, RedOp op);
#endif

namespace {

void reduce_n(const torch::Tensor& out, const std::vector<torch::Tensor>& inputs, int64_t op) {
  TORCH_CHECK(op >= 0 && op <= 3, "commlab: reduce_n op code must be 0..3, got ", op);
  const auto rop = static_cast<RedOp>(op);
  if (out.is_cuda()) {
#ifdef COMMLAB_WITH_CUDA
    reduce_n_cuda(out, inputs, rop);
    return;
#else
    TORCH_CHECK(false, "commlab._C was built without CUDA");
#endif
  }
  reduce_n_cpu(out, inputs, rop);
}

pybind11::dict codes() {
  using namespace pybind11::literals;
  auto i = [](auto v) { return static_cast<int>(v); };
  pybind11::dict out;
  out["dtype"] = pybind11::dict("float32"_a = i(DType::kF32), "float64"_a = i(DType::kF64), "float16"_a = i(DType::kF16),
                                "bfloat16"_a = i(DType::kBF16), "int32"_a = i(DType::kI32), "int64"_a = i(DType::kI64),
                                "uint8"_a = i(DType::kU8));
  out["op"] = pybind11::dict("SUM"_a = i(RedOp::kSum), "PRODUCT"_a = i(RedOp::kProduct), "MIN"_a = i(RedOp::kMin),
                             "MAX"_a = i(RedOp::kMax));
  out["avg_record"] = kAvgRecord;
  out["shm_mode"] = pybind11::dict("AUTO"_a = i(ShmMode::kAuto), "ONESHOT"_a = i(ShmMode::kOneShot),
                                   "TWOSHOT"_a = i(ShmMode::kTwoShot), "ROOT"_a = i(ShmMode::kRoot));
  out["kind"] = pybind11::dict("all_reduce"_a = i(kAllReduce), "all_gather"_a = i(kAllGather),
                               "reduce_scatter"_a = i(kReduceScatter), "broadcast"_a = i(kBroadcast),
                               "barrier"_a = i(kBarrier), "all_to_all"_a = i(kAllToAll));
  out["ipc_mode"] = pybind11::dict("AUTO"_a = i(IpcMode::kAuto), "ONESHOT"_a = i(IpcMode::kOneShot),
                                   "TWOSHOT"_a = i(IpcMode::kTwoShot));
  return out;
}

bool has_cuda() {
#ifdef COMMLAB_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace commlab

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "commlab native kernels and transports";
  m.def("version", [] { return std::string(COMMLAB_VERSION); }, "commlab._C build version");
  m.def("has_cuda", &commlab::has_cuda, "whether CUDA sources were compiled in");
  // torch binds no Work.abort(); gloo's send and receive works implement it, and it is the
  // one thing that ends their wait once a half-written transfer's connection broke.
  m.def("abort_wait", [](const c10::intrusive_ptr<c10d::Work>& work) { work->abort(); }, pybind11::arg("work"),
        "make a pending or later wait() of a gloo send or receive return False (Work::abort)");
  m.def("codes", &commlab::codes, "common/codes.h as a dict, for the Python mirrors' consistency test");
  m.def("simd_level", &commlab::simd_level, "instruction set the CPU reduction loop uses");
  m.def("simd_levels", &commlab::simd_levels, "instruction sets this CPU supports");
  m.def("handoff_pingpong_ns", &commlab::handoff_pingpong_ns, pybind11::arg("name"), pybind11::arg("initiator"),
        pybind11::arg("iters"), pybind11::arg("yield_"), pybind11::arg("timeout_ms"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "one cache line ping-ponged between two processes through segment `name`; the initiator's ns for all");
  m.def("hot_copy_ns", &commlab::hot_copy_ns, pybind11::arg("nbytes"), pybind11::arg("iters"),
        pybind11::call_guard<pybind11::gil_scoped_release>(), "best ns of one memcpy of nbytes, cache-hot");
  m.def("set_simd_level", &commlab::set_simd_level, "choose scalar, avx2 or avx512 (benchmarks)");
  m.def("reduce_n", &commlab::reduce_n, pybind11::arg("out"), pybind11::arg("inputs"),
        pybind11::arg("op"),
        "out = inputs[0] op inputs[1] op ... in that order (op codes: 0 sum, 1 product, 2 min, 3 max)");

  // Failures every rank of a collective reports, distinguished by type in Python.
  pybind11::register_exception<commlab::MismatchError>(m, "MismatchError", PyExc_RuntimeError);
  pybind11::register_exception<commlab::PeerLostError>(m, "PeerLostError", PyExc_RuntimeError);
  pybind11::register_exception<commlab::ForkedError>(m, "ForkedError", PyExc_RuntimeError);

  pybind11::class_<commlab::ShmComm>(m, "ShmComm", "shared-memory collectives among the ranks of one host")
      .def(pybind11::init<const std::string&, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>>(),
           pybind11::arg("token_hex"), pybind11::arg("rank"), pybind11::arg("world"), pybind11::arg("capacity"),
           pybind11::arg("timeout_ms"), pybind11::arg("global_ranks"))
      .def("attach", &commlab::ShmComm::attach, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("unlink_own", &commlab::ShmComm::unlink_own)
      .def("close", &commlab::ShmComm::close)
      .def("allreduce", &commlab::ShmComm::allreduce, pybind11::arg("tensor"), pybind11::arg("op"),
           pybind11::arg("mode"), "in place; mode 0 auto, 1 one-shot, 2 two-shot, 3 root reduces")
      .def("try_allreduce", &commlab::ShmComm::try_allreduce, pybind11::arg("tensor"), pybind11::arg("op"),
           pybind11::arg("mode"), pybind11::arg("dtype"),
           "allreduce() if the tensor is a contiguous CPU tensor of scalar type `dtype` (else False, untouched)")
      .def("run_schedule", &commlab::ShmComm::run_schedule, pybind11::arg("bufs"), pybind11::arg("shape"),
           pybind11::arg("ops"), pybind11::arg("passes"), pybind11::arg("op"), pybind11::arg("kind"),
           pybind11::arg("total"), pybind11::arg("fingerprint"), pybind11::arg("ticks"),
           "one call of a compiled schedule (commlab/schedule/native.py)")
      .def("allgather", &commlab::ShmComm::allgather, pybind11::arg("out"), pybind11::arg("input"),
           "out (world x n) = every rank's input (n), in rank order")
      .def("reduce_scatter", &commlab::ShmComm::reduce_scatter, pybind11::arg("out"), pybind11::arg("input"),
           pybind11::arg("op"), "out (n) = reduction of every rank's slice `rank` of input (world x n)")
      .def("broadcast", &commlab::ShmComm::broadcast, pybind11::arg("tensor"), pybind11::arg("root"),
           "in place, from group rank `root`")
      .def("alltoall", &commlab::ShmComm::alltoall, pybind11::arg("out"), pybind11::arg("input"),
           pybind11::arg("send"), pybind11::arg("recv"),
           "out (recv[j] elements from each rank j) = the blocks every rank sends this one (send[q] to rank q)")
      .def("try_allgather", &commlab::ShmComm::try_allgather, pybind11::arg("out"), pybind11::arg("input"),
           pybind11::arg("dtype"), "allgather() if both are like the plan's (else False, untouched)")
      .def("try_reduce_scatter", &commlab::ShmComm::try_reduce_scatter, pybind11::arg("out"), pybind11::arg("input"),
           pybind11::arg("op"), pybind11::arg("dtype"), "reduce_scatter() if both are like the plan's (else False)")
      .def("try_broadcast", &commlab::ShmComm::try_broadcast, pybind11::arg("tensor"), pybind11::arg("root"),
           pybind11::arg("dtype"), "broadcast() if the tensor is like the plan's (else False, untouched)")
      .def("try_alltoall", &commlab::ShmComm::try_alltoall, pybind11::arg("out"), pybind11::arg("input"),
           pybind11::arg("dtype"), "alltoall() with even splits along dim 0 if both are like the plan's (else False)")
      .def("barrier", &commlab::ShmComm::barrier)
      .def("probe_single_copy", &commlab::ShmComm::probe_single_copy,
           "whether every peer's memory reads in one copy (process_vm_readv) from this rank")
      .def_property("single_copy_min", &commlab::ShmComm::single_copy_min, &commlab::ShmComm::set_single_copy_min)
      .def_property("single_copy_max", &commlab::ShmComm::single_copy_max, &commlab::ShmComm::set_single_copy_max)
      .def_property("alltoall_single_copy_min", &commlab::ShmComm::alltoall_single_copy_min,
                    &commlab::ShmComm::set_alltoall_single_copy_min)
      .def_property_readonly("single_copy_calls", &commlab::ShmComm::single_copy_calls,
                             "calls in which this rank read a peer's memory in one copy")
      .def_property("piece_bytes", &commlab::ShmComm::piece_bytes, &commlab::ShmComm::set_piece_bytes)
      .def("abort", &commlab::ShmComm::abort, pybind11::arg("why"), pybind11::arg("mismatch") = false,
           "give up on this communicator: peers waiting on this rank fail at once with `why`")
      .def("post_record", &commlab::ShmComm::post_record, pybind11::arg("kind"), pybind11::arg("elements"),
           pybind11::arg("dtype"), pybind11::arg("op"), pybind11::arg("algorithm"), pybind11::arg("root"),
           pybind11::arg("wait_all"),
           "publish a point-to-point call's record and compare it with the peers' already in the call "
           "(every peer's with wait_all); true where one differs")
      .def("records", &commlab::ShmComm::records,
           "every rank's record of the last posted call, 9 integers per rank (waits for each)")
      .def("peer_abort", &commlab::ShmComm::peer_abort,
           "(1, or 2 on a mismatch; global rank; reason) of a peer that gave up, else (0, -1, ''); does not wait")
      .def_static("dtype_code", [](const torch::Tensor& t) { return static_cast<int64_t>(t.scalar_type()); },
                  "the scalar-type code try_allreduce compares against")
      .def("segment_name", &commlab::ShmComm::segment_name)
      .def_static("unlink_names", &commlab::ShmComm::unlink_names, pybind11::arg("token_hex"), pybind11::arg("world"),
                  "remove every rank's segment name of a group; returns how many existed")
      .def_property_readonly("capacity", &commlab::ShmComm::capacity)
      .def_property_readonly("failed_peer", &commlab::ShmComm::failed_peer)
      .def_property_readonly("calls", &commlab::ShmComm::calls)
      .def_property("oneshot_max", &commlab::ShmComm::oneshot_max, &commlab::ShmComm::set_oneshot_max)
      .def_property("spin", &commlab::ShmComm::spin, &commlab::ShmComm::set_spin)
      .def_property("yield_us", &commlab::ShmComm::yield_us, &commlab::ShmComm::set_yield_us)
      .def_property("peer_timeout_ms", &commlab::ShmComm::peer_timeout_ms, &commlab::ShmComm::set_peer_timeout_ms);

#ifdef COMMLAB_WITH_CUDA
  pybind11::class_<commlab::IpcComm>(m, "IpcComm", "CUDA IPC all-reduce among processes on distinct, peer-capable GPUs")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>>(), pybind11::arg("rank"),
           pybind11::arg("world"), pybind11::arg("device"), pybind11::arg("capacity"), pybind11::arg("timeout_ms"),
           pybind11::arg("global_ranks"))
      .def("handle", &commlab::IpcComm::handle)
      .def("open", &commlab::IpcComm::open, pybind11::arg("handles"))
      .def("connect_local", &commlab::IpcComm::connect_local, pybind11::arg("block_addresses"))
      .def_property_readonly("block_address", &commlab::IpcComm::block_address)
      .def("allreduce", &commlab::IpcComm::allreduce, pybind11::arg("tensor"), pybind11::arg("op"),
           pybind11::arg("mode"), pybind11::call_guard<pybind11::gil_scoped_release>(),
           "in place, synchronous; mode 0 auto, 1 one-shot, 2 two-shot")
      .def("close", &commlab::IpcComm::close)
      .def_property_readonly("capacity", &commlab::IpcComm::capacity)
      .def_property("calls", &commlab::IpcComm::calls, &commlab::IpcComm::set_calls,
                    "calls so far (settable: flag wrap-around tests start a communicator late in its life)")
      .def_property_readonly("failed_peer", &commlab::IpcComm::failed_peer)
      .def_property("oneshot_max", &commlab::IpcComm::oneshot_max, &commlab::IpcComm::set_oneshot_max)
      .def_property("max_blocks", &commlab::IpcComm::max_blocks, &commlab::IpcComm::set_max_blocks);
#endif
}
