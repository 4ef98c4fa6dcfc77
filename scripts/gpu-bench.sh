#!/usr/bin/env bash
# Runs the GPU benchmarks (bench/*.py) on a machine with CUDA and torch; installs nothing.
# bench/allreduce.py runs only where two GPUs are visible.
# Results land in bench/results/ and, when $OUT is set, in $OUT too.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 bench/graph_memory.py
if [ -n "${OUT:-}" ]; then cp bench/results/graph_memory.* "$OUT"/; fi
if python3 -c 'import sys, torch; sys.exit(torch.cuda.device_count() < 2)'; then
  python3 bench/allreduce.py
  if [ -n "${OUT:-}" ]; then cp bench/results/allreduce.* "$OUT"/; fi
fi
