#!/usr/bin/env bash
# Runs the whole test suite, GPU tests included, on a machine that has CUDA,
# torch and pytest but nothing else (the GPU machine: Python 3.12, torch 2.11,
# no package registry). Installs nothing. vLLM tests skip there with a reason.
#
#   bash scripts/gpu-tests.sh            # all tests
#   bash scripts/gpu-tests.sh tests/gpu  # GPU tests only
#
# When $OUT is set, the log and the JUnit XML land there too.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Never enable NVLink multicast on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out="${OUT:-/tmp/specgraph-gpu}"
mkdir -p "$out"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")'
python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/gpu-tests.xml" "${@:-tests}" \
  2>&1 | tee "$out/gpu-tests.log"
