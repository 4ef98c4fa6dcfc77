#!/usr/bin/env bash
# Runs ON THE GPU MACHINE, in one device call, from the repository root:
#
#   run(command="bash scripts/device-vllm-e2e.sh", carry=[".e2e"], timeout_s=420)
#
# Needs .e2e/ built here first by scripts/prepare-vllm-e2e.sh. Unpacks vLLM
# 0.33.0's Python tree and the carried wheels under /tmp, applies the stand-ins
# (scripts/vllm_e2e/apply_shims.py), then runs an offline LLM on the tiny
# dummy-weight Llama in configs/ once per case (no speculator, draft model,
# ngram), each in its own process, and prints a summary last. Logs and JSON
# results go to $OUT (or /tmp/vllm-e2e-out).
#
# Env knobs: CASES="base draft ngram"; per-case wall limits T_base, T_draft,
# T_ngram (seconds). The first case also pays vLLM's model-inspection
# subprocess and most Triton JIT compiles (the cache is shared afterwards).
set -uo pipefail

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUTDIR="${OUT:-/tmp/vllm-e2e-out}"
W=/tmp/vllm-e2e
CASES="${CASES:-base draft ngram}"
T_base="${T_base:-150}"
T_draft="${T_draft:-110}"
T_ngram="${T_ngram:-100}"
mkdir -p "$OUTDIR"

t0=$(date +%s)
rm -rf "$W" && mkdir -p "$W/site" "$W/tree"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$W/site" "$REPO"/.e2e/wheels/*.whl || { echo "wheel install failed"; exit 2; }
tar xzf "$REPO/.e2e/vllm-py.tar.gz" -C "$W/tree" || { echo "untar failed"; exit 2; }
python3 "$REPO/scripts/vllm_e2e/apply_shims.py" "$W/tree" || exit 2
echo "setup took $(( $(date +%s) - t0 )) s"

export PYTHONPATH="$W/tree:$W/site"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_V2_MODEL_RUNNER=1 VLLM_PLUGINS=
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1   # else xgrammar's tvm-ffi JIT-builds a torch addon
export VLLM_USE_FLASHINFER_SAMPLER=0      # MRV2's sampler imports flashinfer unguarded otherwise
export TRITON_CACHE_DIR="$W/triton-cache"  # shared by the processes below

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader

for case in $CASES; do
  echo "---------------- case: $case ----------------"
  tvar="T_$case"
  timeout -k 10 "${!tvar}" python3 "$REPO/scripts/vllm_e2e/run_llm.py" \
    --case "$case" --out "$OUTDIR/$case.json" > "$OUTDIR/$case.log" 2>&1
  rc=$?
  echo "case $case rc=$rc ($(( $(date +%s) - t0 )) s since start)"
  grep -E "Error|Traceback|CUDA graph|Graph capturing|KV cache|Model loading|Using V2|Using Attention|TRITON" \
    "$OUTDIR/$case.log" | cut -c1-400 | tail -20
done

python3 "$REPO/scripts/vllm_e2e/summarize.py" "$OUTDIR"
