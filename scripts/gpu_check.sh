#!/usr/bin/env bash
# The one prepared GPU check (issues #3 and #6), for a machine with one NVIDIA GPU:
#   scripts/gpu_check.sh [OUTDIR]        (about 6-8 minutes on an H100/H200)
# Builds commlab._C for this GPU only, runs the GPU tests (ipc's P2P kernels in one
# process, their deadline, the host-staged path with 2 and 4 processes on the GPU),
# times ipc next to gloo with CUDA tensors, and runs the DP/DDP comparison on one
# GPU plus the --share-gpu functional check. Each step has its own time limit and a
# failed step does not stop the next; everything lands in OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-/tmp/commlab-gpu-check}}
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

nvidia-smi -L > "$OUTDIR/env.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))" >> "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability(0))")
  export TORCH_CUDA_ARCH_LIST
fi
[ -n "${CUDA_HOME:-}" ] || { [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda; }
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
step build 300 python3 setup.py -q build_ext --inplace
python3 -c "import commlab._C as C; assert C.has_cuda(), 'built without CUDA kernels'" || { echo "no CUDA build"; exit 1; }

step tests 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_ipc.py tests/test_reduce_kernels.py

for p in 2 4; do
  step "bench_$p" 150 python3 -m commlab.allreduce_bench --device cuda --backend gloo --world-size "$p" \
    --algorithms builtin,ipc -b 4K -e 64M -f 4 --budget 0.2 --rounds 2 --quiet --json "$OUTDIR/bench_$p.json"
done

step compare_1gpu 240 python3 -m commlab.compare --device cuda --gpus 1 --world-size 1 --modes dp,ddp,ddp:noop \
  --model resnet50 --batch-size 64 --iters 10 --warmup 3 --json "$OUTDIR/compare_1gpu.json"
step compare_share 200 python3 -m commlab.compare --device cuda --share-gpu --world-size 2 --modes ddp,ddp:ipc,ddp:ring,ddp:noop \
  --model transformer --batch-size 32 --iters 8 --warmup 2 --json "$OUTDIR/compare_share.json"
cat "$OUTDIR/summary.txt"
exit $status
