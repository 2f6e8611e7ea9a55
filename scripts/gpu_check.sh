#!/usr/bin/env bash
# The one prepared GPU check (issues #3, #6, #13, #18, #19), for a machine with one NVIDIA GPU:
#   scripts/gpu_check.sh [PART ...]      PARTs: build tests bench probe compare (default: all)
# Results land in $OUT (the device tool's folder) or /tmp/commlab-gpu-check. All parts
# take about 6-8 minutes on an H100/H200; the device tool allows 10 minutes a command,
# so run `build tests bench` and then `probe compare` (the build stays on a warm machine).
# Builds commlab._C for this GPU only, runs the GPU tests (ipc's P2P kernels in one
# process, their deadline, 64-bit flags across 2^31 and 2^32 calls, Ctrl-C stopping the
# kernels, the host-staged path with 2 and 4 processes on the GPU; DDP hooks on CUDA
# streams against DDP's own allreduce),
# times ipc next to gloo with CUDA tensors, and runs the DP/DDP comparison on one
# GPU plus the --share-gpu functional check. Each step has its own time limit and a
# failed step does not stop the next; everything lands in OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/commlab-gpu-check}
PARTS=" ${*:-build tests bench probe compare} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo
status=0
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUTDIR/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

# At most one file per step plus summary.txt: the device tool returns 8 files.
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"; } 2>&1 | tee -a "$OUTDIR/summary.txt"

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
  export TORCH_CUDA_ARCH_LIST
fi
[ -n "${CUDA_HOME:-}" ] || { [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda; }
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
want build && step build 240 python3 setup.py -q build_ext --inplace
python3 -c "import commlab._C as C; assert C.has_cuda(), 'built without CUDA kernels'" || { echo "no CUDA build"; exit 1; }

want tests && step tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_ipc.py tests/test_reduce_kernels.py \
  tests/test_hooks_cuda.py

want bench && for p in 2 4; do
  step "bench_$p" 100 python3 -m commlab.allreduce_bench --device cuda --backend gloo --world-size "$p" \
    --algorithms builtin,ipc -b 4K -e 64M -f 4 --budget 0.2 --rounds 2 --quiet
done

# Experiment, not a pass/fail check: the P2P kernels forced onto two processes that
# share this GPU. Either time-slicing lets the barriers complete, or the kernels'
# 20 s deadline must fire and name the rank; a hang past the step's limit is a bug.
before=$status
want probe && step p2p_shared_gpu_probe 60 env COMMLAB_IPC_PATH=peer python3 -m commlab.allreduce_bench --device cuda --backend gloo \
  --world-size 2 --algorithms ipc -b 4K -e 1M -f 16 --timeout 20 --budget 0.1 --rounds 1 --quiet
status=$before  # the probe's outcome is reported, not judged

# Measured beside commlab.predict's columns for this GPU (issue #18): the roofline's
# compute against the real kernels.
want compare && step compare_1gpu 150 python3 -m commlab.compare --device cuda --gpus 1 --world-size 1 --modes dp,ddp,ddp:noop \
  --model resnet50 --batch-size 64 --iters 10 --warmup 3 --predict h200-sxm-nvlink
want compare && step compare_share 120 python3 -m commlab.compare --device cuda --share-gpu --world-size 2 --modes ddp,ddp:ipc,ddp:ring,ddp:noop \
  --model transformer --batch-size 32 --iters 8 --warmup 2
cat "$OUTDIR/summary.txt" 2>/dev/null
echo "(p2p_shared_gpu_probe is an experiment: see its log, rc 124 means it hung)"
exit $status
