#!/usr/bin/env bash
# Runs on the GPU machine (torch, no vLLM install), from the repository root of a
# copy that holds .e2e/ (built beforehand by scripts/prepare-vllm-e2e.sh):
#
#   bash scripts/device-vllm-e2e.sh                                     # tiny, 8 runs
#   SIZES=1b CASES="base draft eagle" bash scripts/device-vllm-e2e.sh   # 1B, 6 runs
#   TP=2 SIZES=tiny CASES="base draft eagle" PLUGIN="off on" \
#     bash scripts/device-vllm-e2e.sh                                   # 2 GPUs, 6 runs
#
# Unpacks vLLM 0.33.0's Python tree and the carried wheels under /tmp, applies
# the stand-ins (scripts/vllm_e2e/apply_shims.py), installs this repository as a
# package into the same site dir (scripts/vllm_e2e/install_plugin.py: its
# vllm.general_plugins entry point must resolve to that copy), then runs an
# offline LLM with dummy weights once per (size, case, plugin switch), each in
# its own process with its own time limit, and prints a summary last
# (scripts/vllm_e2e/summarize.py), with the plugin off and on side by side.
# Logs and JSON files go to $OUT (or /tmp/vllm-e2e-out): SIZE-CASE-PLUGIN.json
# and .log per run (SIZE-CASE-PLUGIN-tpN.* at TP > 1), and
# bench/results/vllm_graph_memory.{json,md}.
#
# Env knobs:
#   SIZES="tiny"                   tiny | 1b (configs/tiny-llama, configs/llama-1b)
#   CASES="base draft ngram eagle" no speculator | draft model | ngram | EAGLE
#   PLUGIN="off on"                off: plugin loaded, VLLM_SPECGRAPH=0 | on | none
#   T_tiny=90 T_1b=150             wall limit of one run (seconds)
#   T_FIRST_EXTRA=60               added to the first run: Triton JIT, cold caches
#   BUDGET=570                     seconds for the whole script, setup included; a
#                                  run's limit is cut to what is left, and a run
#                                  that would get less than 30 s is skipped, so the
#                                  summary is always written
#   TP=1                           tensor_parallel_size; above 1, vLLM's multiprocess
#                                  executor starts one worker process per GPU
#   T_TP_EXTRA=30                  added to every run's limit at TP > 1 (worker
#                                  start-up, process groups)
#   CUSTOM_AR=0                    1: at TP > 1, leave vLLM's custom all-reduce on
#   E2E_WORK=/tmp/vllm-e2e         where vLLM is unpacked; give each of two scripts
#                                  run at once (say, one per GPU) its own
set -uo pipefail

# Exported, so every process below inherits them, vLLM's worker processes at
# TP > 1 included (spawned or forked, they start with this environment; each
# run records what its workers saw, under ranks[].env).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUTDIR="${OUT:-/tmp/vllm-e2e-out}"
W="${E2E_WORK:-/tmp/vllm-e2e}"
SIZES="${SIZES:-tiny}"
CASES="${CASES:-base draft ngram eagle}"
PLUGIN="${PLUGIN:-off on}"
T_tiny="${T_tiny:-90}"
T_1b="${T_1b:-150}"
T_FIRST_EXTRA="${T_FIRST_EXTRA:-60}"
BUDGET="${BUDGET:-570}"
TP="${TP:-1}"
T_TP_EXTRA="${T_TP_EXTRA:-30}"
CUSTOM_AR="${CUSTOM_AR:-0}"
RESERVE=25   # seconds kept for the kill grace period and the summary
MIN_RUN=30

t0=$(date +%s)
for s in $SIZES; do
  case "$s" in tiny|1b) ;; *) echo "unknown size '$s' (tiny, 1b)"; exit 2 ;; esac
done
for c in $CASES; do
  case "$c" in base|draft|ngram|eagle) ;; *) echo "unknown case '$c'"; exit 2 ;; esac
done
for p in $PLUGIN; do
  case "$p" in off|on|none) ;; *) echo "unknown plugin switch '$p' (off, on, none)"; exit 2 ;; esac
done
case "$TP" in ''|*[!0-9]*|0) echo "TP must be a positive integer, got '$TP'"; exit 2 ;; esac
TP_ARGS=()
SUFFIX=""
if [ "$TP" -gt 1 ]; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  if [ "$ngpu" -lt "$TP" ]; then echo "TP=$TP needs $TP GPUs, nvidia-smi lists $ngpu"; exit 2; fi
  TP_ARGS=(--tp "$TP")
  [ "$CUSTOM_AR" = 1 ] && TP_ARGS+=(--custom-all-reduce)
  SUFFIX="-tp$TP"
fi
mkdir -p "$OUTDIR"
rm -f "$OUTDIR/skipped.txt"

rm -rf "$W" && mkdir -p "$W/site" "$W/tree" "$W/cwd"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$W/site" "$REPO"/.e2e/wheels/*.whl || { echo "wheel install failed"; exit 2; }
tar xzf "$REPO/.e2e/vllm-py.tar.gz" -C "$W/tree" || { echo "untar failed"; exit 2; }
python3 "$REPO/scripts/vllm_e2e/apply_shims.py" "$W/tree" || exit 2
python3 "$REPO/scripts/vllm_e2e/install_plugin.py" "$REPO" "$W/site" \
  || { echo "plugin install failed"; exit 2; }
echo "setup took $(( $(date +%s) - t0 )) s"

# The runs start in $W/cwd, not in the repository: vLLM's model-inspection
# subprocess is started with `python -m`, which puts the working directory first
# on sys.path, and the repository root would then shadow the installed plugin.
# At TP > 1 the worker processes start there too and inherit PYTHONPATH, so they
# find vLLM's tree and the plugin's entry point in $W/site the same way (and
# run_llm.py adds its own directory, for the worker extension).
export PYTHONPATH="$W/tree:$W/site"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_V2_MODEL_RUNNER=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1   # else xgrammar's tvm-ffi JIT-builds a torch addon
export VLLM_USE_FLASHINFER_SAMPLER=0      # MRV2's sampler imports flashinfer unguarded otherwise
export TRITON_CACHE_DIR="$W/triton-cache"  # shared by every run below
unset VLLM_PLUGINS VLLM_SPECGRAPH          # run_llm.py sets them from --plugin

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
  | tee "$OUTDIR/gpu.txt"

first=1
for size in $SIZES; do
  tvar="T_$size"
  for case in $CASES; do
    for plugin in $PLUGIN; do
      name="$size-$case-$plugin$SUFFIX"
      rm -f "$OUTDIR/$name.json" "$OUTDIR/$name.log"
      left=$(( BUDGET - ($(date +%s) - t0) - RESERVE ))
      limit="${!tvar}"
      [ "$first" = 1 ] && limit=$(( limit + T_FIRST_EXTRA ))
      [ "$TP" -gt 1 ] && limit=$(( limit + T_TP_EXTRA ))
      [ "$limit" -gt "$left" ] && limit="$left"
      if [ "$limit" -lt "$MIN_RUN" ]; then
        echo "---------------- run $name: skipped, ${left} s left of BUDGET=${BUDGET}"
        echo "$name" >> "$OUTDIR/skipped.txt"
        continue
      fi
      first=0
      echo "---------------- run $name (limit ${limit} s) ----------------"
      t1=$(date +%s)
      # timeout leads its own process group: when it fires it signals the whole
      # group, vLLM's worker processes included; after the run, whatever of that
      # group is still alive (workers of a run that exited without shutting
      # them down) is stopped too, so the next run starts on free GPUs.
      ( cd "$W/cwd" && exec timeout -k 10 "$limit" python3 "$REPO/scripts/vllm_e2e/run_llm.py" \
          --size "$size" --case "$case" --plugin "$plugin" ${TP_ARGS[@]+"${TP_ARGS[@]}"} \
          --out "$OUTDIR/$name.json" ) > "$OUTDIR/$name.log" 2>&1 &
      run_pid=$!
      wait "$run_pid"
      rc=$?
      if [ "$TP" -gt 1 ]; then
        kill -TERM -- "-$run_pid" 2>/dev/null && sleep 2
        kill -KILL -- "-$run_pid" 2>/dev/null
        for _ in $(seq 1 20); do
          gpu_left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c .)
          [ "$gpu_left" = 0 ] && break
          sleep 1
        done
        [ "$gpu_left" = 0 ] || echo "after $name: $gpu_left GPU processes still listed by nvidia-smi"
      fi
      echo "run $name rc=$rc elapsed=$(( $(date +%s) - t1 )) s ($(( $(date +%s) - t0 )) s since start)"
      grep -aE "Error|Traceback|CUDA graph|Graph capturing|KV cache|Model loading|Using V2|Using Attention|TRITON" \
        "$OUTDIR/$name.log" | cut -c1-300 | tail -12
      grep -ai "specgraph" "$OUTDIR/$name.log" | cut -c1-300 | tail -20
    done
  done
done

python3 "$REPO/scripts/vllm_e2e/summarize.py" "$OUTDIR" \
  --results "$OUTDIR/bench/results" \
  --previous "$REPO/bench/results/vllm_graph_memory.json"
