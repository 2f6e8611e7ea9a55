#!/usr/bin/env bash
# The one prepared GPU check (issues #3, #6, #13, #18, #19, #30), for a machine with one NVIDIA GPU:
#   scripts/gpu_check.sh [PART ...]   PARTs: build tests bench compare sharded gather share colls bench4 probe trace
#                                     (default: all)
# A lease is ~15 minutes, machine start included, so every part runs in ONE call under one
# time budget (GPU_CHECK_BUDGET seconds, default 540, under the device tool's 600 s a call):
# each step gets at most what is left, a step that cannot get 20 s is skipped and said so,
# the steps run in the order of what matters most, and a failed step does not stop the next.
# Results: $OUT (the device tool's folder) or /tmp/commlab-gpu-check: summary.txt (one line
# per step) and all.log (every step's output), within the tool's 8 returned files.
# Steps: build commlab._C for this GPU only; the GPU tests (ipc's P2P kernels with 2-4
# communicators in one process, their deadline, 64-bit flags across 2^31 and 2^32 calls,
# Ctrl-C stopping the kernels, the host-staged path with 2 and 4 processes on the GPU,
# the CUDA reduction kernels, DDP hooks on CUDA streams against DDP's own allreduce, every
# pure torch.distributed algorithm of each family on CUDA tensors of a gloo group);
# ipc next to gloo with CUDA tensors (2 ranks); DP/DDP on the GPU beside commlab.predict's
# columns for this GPU (#18); ZeRO-1 and FSDP2 on it beside predict's columns (#28); every
# all-gather algorithm that claims CUDA (2 ranks on the GPU over gloo); the --share-gpu
# comparison; every other family on CUDA; ipc at 4 ranks; as an experiment, the P2P kernels
# forced onto two processes sharing the GPU (time-slicing completes them or their 20 s
# deadline must fire; a hang past the step's limit is a bug); compare --trace on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/commlab-gpu-check}
PARTS=" ${*:-build tests bench compare sharded gather share colls bench4 probe trace} "
BUDGET=${GPU_CHECK_BUDGET:-540}
START=$(date +%s)
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUTDIR"
LOG="$OUTDIR/all.log" SUMMARY="$OUTDIR/summary.txt"
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo
status=0
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    echo "=== $name: skipped, ${left}s of the budget left" | tee -a "$LOG" "$SUMMARY"; status=1; return
  fi
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$LOG" "$SUMMARY"
  [ "$rc" -eq 0 ] || status=1
}

{ date -u; nvidia-smi -L; python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"; } 2>&1 | tee -a "$SUMMARY" "$LOG"

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
  export TORCH_CUDA_ARCH_LIST
fi
[ -n "${CUDA_HOME:-}" ] || { [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda; }
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
before=$status
want build && step build 180 python3 setup.py -q build_ext --inplace
# The H200 image's CC/CXX (/opt/gcc wrappers) link libstdc++ statically, which setup.py
# refuses (the first C++ error segfaulted, 2026-12-04): the system compilers then.
if want build && grep -q "links the C++ runtime statically" "$LOG" && [ -x /usr/bin/g++ ]; then
  status=$before
  step build_system_gcc 180 env CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 setup.py -q build_ext --inplace
fi
python3 -c "import commlab._C as C; assert C.has_cuda(), 'built without CUDA kernels'" 2>&1 | tee -a "$LOG" "$SUMMARY" \
  || { echo "no CUDA build" | tee -a "$SUMMARY"; exit 1; }

# Two runs, so a crash in one (a segfault ends pytest) does not hide the other's results.
PYTEST=(python3 -m pytest -q -p no:cacheprovider --durations=5 ${GPU_CHECK_PYTEST_ARGS:-})
want tests && step tests_ipc 100 "${PYTEST[@]}" tests/test_ipc.py
want tests && step tests_cuda 120 "${PYTEST[@]}" tests/test_reduce_kernels.py tests/test_hooks_cuda.py tests/test_gpu_paths.py

BENCH=(python3 -m commlab.allreduce_bench --device cuda --backend gloo --budget 0.1 --rounds 2 --quiet)
want bench && step bench_2 70 "${BENCH[@]}" --world-size 2 --algorithms builtin,ipc -b 4K -e 64M -f 4

# The lent GPU's own profile for predict's columns (an H100 or an H200 lease).
PROFILE=$(python3 -c "import torch; n = torch.cuda.get_device_name(0).upper(); print(next((p for k, p in (('H100', 'h100-sxm-nvlink'), ('A100', 'a100-sxm-nvlink'), ('4090', 'rtx4090-pcie4')) if k in n), 'h200-sxm-nvlink'))")

# Measured beside commlab.predict's columns for this GPU (issue #18): the roofline's
# compute against the real kernels.
want compare && step compare_1gpu 120 python3 -m commlab.compare --device cuda --gpus 1 --world-size 1 \
  --modes dp,ddp,ddp:noop --model resnet50 --batch-size 64 --iters 10 --warmup 3 --predict "$PROFILE"

# ZeRO-1 and FSDP2 on the GPU over NCCL (one rank: FSDP's whole path, its collectives
# timed from a profiled warm-up step), beside predict's columns for the same setup (#28, #30).
want sharded && step compare_sharded_1gpu 120 python3 -m commlab.compare --device cuda --gpus 1 --world-size 1 \
  --modes ddp,zero1,fsdp,fsdp:noreshard,ddp:noop --model transformer --batch-size 32 --iters 10 --warmup 3 \
  --predict "$PROFILE"

# Every all-gather algorithm that claims CUDA tensors, checked (#wrong) on two ranks sharing the GPU.
want gather && step gather_2 60 "${BENCH[@]}" --collective all_gather --world-size 2 --algorithms all \
  -b 4K -e 16M -f 16

want share && step compare_share 90 python3 -m commlab.compare --device cuda --share-gpu --world-size 2 \
  --modes ddp,ddp:ipc,ddp:ring,ddp:noop --model transformer --batch-size 32 --iters 8 --warmup 2

# Every other family's algorithms that claim CUDA tensors, checked (#wrong), two ranks sharing the GPU (#27).
want colls && step collectives_2 90 "${BENCH[@]}" --collective all --world-size 2 --algorithms all \
  -b 4K -e 1M -f 16

want bench4 && step bench_4 60 "${BENCH[@]}" --world-size 4 --algorithms builtin,ipc -b 4K -e 64M -f 16

before=$status
want probe && step p2p_shared_gpu_probe 45 env COMMLAB_IPC_PATH=peer python3 -m commlab.allreduce_bench --device cuda \
  --backend gloo --world-size 2 --algorithms ipc -b 4K -e 1M -f 16 --timeout 20 --budget 0.1 --rounds 1 --quiet
status=$before  # the probe's outcome is reported, not judged

# compare --trace on the GPU (#29): the host's compute spans written and read back (the collectives' time is
# the device's, from the profiled warm-up step, so no per-call spans there).
want trace && step compare_trace_1gpu 60 python3 -m commlab.compare --device cuda --gpus 1 --world-size 1 \
  --modes ddp,zero1,fsdp --model transformer --width 256 --depth 2 --batch-size 16 --iters 3 --warmup 1 \
  --trace /tmp/commlab-gpu-trace
echo "total $(( $(date +%s) - START ))s of a ${BUDGET}s budget" | tee -a "$SUMMARY"
cat "$SUMMARY"
echo "(p2p_shared_gpu_probe is an experiment: see all.log; rc 124 means it hung)"
exit $status
