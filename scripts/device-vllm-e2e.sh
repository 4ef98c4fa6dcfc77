#!/usr/bin/env bash
# Runs on the GPU machine (torch, no vLLM install), from the repository root of a
# copy that holds .e2e/ (built beforehand by scripts/prepare-vllm-e2e.sh):
#
#   bash scripts/device-vllm-e2e.sh                                     # tiny, 8 runs
#   SIZES=1b CASES="base draft eagle" PLUGIN="off on noest" \
#     bash scripts/device-vllm-e2e.sh                                   # 1B, 9 runs
#   MODE=load bash scripts/device-vllm-e2e.sh                           # 1B draft models, 256 requests
#   MODE=demo bash scripts/device-vllm-e2e.sh                           # make demo, through vLLM's tree
#   MODE=serve bash scripts/device-vllm-e2e.sh                          # vllm serve, 1B draft model
#   TP=2 SIZES=tiny CASES="base draft eagle" PLUGIN="off on" \
#     bash scripts/device-vllm-e2e.sh                                   # 2 GPUs per run, 6 runs
#
# Unpacks vLLM 0.33.0's Python tree and the carried wheels under /tmp, applies
# the stand-ins (scripts/vllm_e2e/apply_shims.py), installs this repository as a
# package into the same site dir (scripts/vllm_e2e/install_plugin.py: its
# vllm.general_plugins entry point must resolve to that copy), then runs an
# offline LLM with dummy weights once per (size, capture-size set, case, plugin
# switch), each in its own process with its own time limit, one run per GPU at a
# time and as many at once as there are GPUs, and prints a summary last
# (scripts/vllm_e2e/summarize.py). Logs and JSON files go to $OUT (or
# /tmp/vllm-e2e-out): SIZE-CASE-PLUGIN[-small][-compile][-peak|-load[-rN]][-expandable][-tpN].json
# and .log per run (-rN: round N > 1 of MODE=load), and
# bench/results/vllm_graph_memory.{json,md} (vllm_load.* in MODE=load).
#
# Env knobs:
#   MODE=bench                     bench: every run once, the WORKLOAD below
#                                  load: 256 mixed requests, timed; off and on of a case
#                                    run one after the other on the same GPU, in
#                                    LOAD_ROUNDS rounds
#                                  demo: python -m vllm_specgraph.demo.vllm_demo, then
#                                    the lane self-check
#                                  serve: vllm serve (API server and engine core in their
#                                    own processes), off then on, 64 concurrent
#                                    completions each (scripts/vllm_e2e/serve.py)
#   SIZES="tiny"                   tiny | 1b | 8b (default 1b in MODE=load)
#   CASES="base draft ngram eagle" no speculator | draft model | accept (the draft
#                                  model with the target's config: acceptance near 1)
#                                  | ngram | EAGLE (default base draft accept in
#                                  MODE=load)
#   GRAPHS="compile"               graph modes, one or both: compile (vLLM's default:
#                                  torch.compile, FULL_AND_PIECEWISE) | full (compilation
#                                  off, FULL graphs); "compile full" puts both in one
#                                  table
#   PLUGIN="off on"                off: plugin loaded, VLLM_SPECGRAPH=0 | on | none |
#                                  noest: off and VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0
#   CAPTURE="default"              capture-size sets, one or both: default (the size's:
#                                  vLLM's default for 1b) | small (1, 2, 4, 8, 16, 32)
#   ALLOCATOR=default              default: PyTorch's caching allocator as it comes
#                                  (PYTORCH_CUDA_ALLOC_CONF unset) | expandable:
#                                  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for
#                                  every run; run once with each into one OUT to put
#                                  both allocators side by side in the table
#   WORKLOAD=smoke                 MODE=bench: smoke (6 prompts) | peak (one full step
#                                  first, sampled; measured)
#   UTIL=                          gpu_memory_utilization of every run (default: the
#                                  size's); with WORKLOAD=peak, a run at the limit
#   MEMORY_HISTORY=0               1: every run dumps the allocator's history into
#                                  $OUT/NAME.pickle (torch's memory snapshot; TP=1 only)
#   GPUS=(every GPU nvidia-smi lists)  GPU indices to run on (default: those of
#                                  CUDA_VISIBLE_DEVICES if set); at TP=1 one run per
#                                  GPU at a time, at TP > 1 one run per TP GPUs at a time
#   LOAD_REQUESTS=256 LOAD_REPEATS=2   MODE=load: requests per generate, timed repeats
#   LOAD_ROUNDS=2                  MODE=load: rounds of a case's switches, each round
#                                  on one GPU, the order reversed every other round
#                                  (off on, on off, off on, ...), so that drift and
#                                  the host's load weigh on both switches alike; with
#                                  several GPUs the rounds run at once; the summary
#                                  pools the rounds
#   LOAD_CORES=8                   MODE=load on one GPU: every run is pinned to the
#                                  same this many cores (a decode step with an eager
#                                  draft model is bound by the host, whose speed
#                                  otherwise differs from one process to the next)
#   T_tiny=90 T_1b=150 T_8b=300    wall limit of one run (seconds)
#   T_FIRST_EXTRA=60               added to a run while no run of its size has ended
#                                  well: Triton JIT, cold caches
#   T_LOAD_EXTRA=60                added to a run in MODE=load
#   BUDGET=570                     seconds for the whole script, setup included; a
#                                  run's limit is cut to what is left, and a run
#                                  that would get less than 30 s is skipped, so the
#                                  summary is always written
#   TP=1                           tensor_parallel_size; above 1, vLLM's multiprocess
#                                  executor starts one worker process per GPU
#   T_TP_EXTRA=30                  added to every run's limit at TP > 1 (worker
#                                  start-up, process groups)
#   CUSTOM_AR=0                    1: at TP > 1, leave vLLM's custom all-reduce on
#   E2E_WORK=/tmp/vllm-e2e         where vLLM is unpacked (emptied first); one
#                                  script uses every GPU, so one is enough
set -uo pipefail

# Exported, so every process below inherits them, vLLM's worker processes at
# TP > 1 included (spawned or forked, they start with this environment; each
# run records what its workers saw, under ranks[].env).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA_VISIBLE_DEVICES then counts as nvidia-smi does
export PYTHONHASHSEED=0  # the same iteration order of every set and dict in every run
REPO="$(cd "$(dirname "$0")/.." && pwd)"
E2E="$REPO/scripts/vllm_e2e"
OUTDIR="${OUT:-/tmp/vllm-e2e-out}"
W="${E2E_WORK:-/tmp/vllm-e2e}"  # work dir, emptied first: site dir, vLLM tree, run cwd
MODE="${MODE:-bench}"
case "$MODE" in
  bench) d_sizes=tiny; d_cases="base draft ngram eagle"; d_plugin="off on"; d_graphs=compile ;;
  load) d_sizes=1b; d_cases="base draft accept"; d_plugin="off on"; d_graphs=compile ;;
  demo) d_sizes=tiny; d_cases=draft; d_plugin=on; d_graphs=compile ;;
  serve) d_sizes=1b; d_cases=draft; d_plugin="off on"; d_graphs=compile ;;
  *) echo "unknown MODE '$MODE' (bench, load, demo, serve)"; exit 2 ;;
esac
SIZES="${SIZES:-$d_sizes}"
CASES="${CASES:-$d_cases}"
PLUGIN="${PLUGIN:-$d_plugin}"
CAPTURE="${CAPTURE:-default}"
GRAPHS="${GRAPHS:-$d_graphs}"
LOAD_CORES="${LOAD_CORES:-8}"
ALLOCATOR="${ALLOCATOR:-default}"
MEMORY_HISTORY="${MEMORY_HISTORY:-0}"
WORKLOAD="${WORKLOAD:-smoke}"
UTIL="${UTIL:-}"
# Default: the GPUs CUDA_VISIBLE_DEVICES names, if set, else every GPU nvidia-smi lists.
visible="${CUDA_VISIBLE_DEVICES:-}"
GPUS="${GPUS:-${visible//,/ }}"
GPUS="${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')}"
GPUS="${GPUS:-0}"
LOAD_REQUESTS="${LOAD_REQUESTS:-256}"
LOAD_REPEATS="${LOAD_REPEATS:-2}"
LOAD_ROUNDS="${LOAD_ROUNDS:-2}"
T_tiny="${T_tiny:-90}"
T_1b="${T_1b:-150}"
T_8b="${T_8b:-300}"
T_FIRST_EXTRA="${T_FIRST_EXTRA:-60}"
T_LOAD_EXTRA="${T_LOAD_EXTRA:-60}"
BUDGET="${BUDGET:-570}"
TP="${TP:-1}"
T_TP_EXTRA="${T_TP_EXTRA:-30}"
CUSTOM_AR="${CUSTOM_AR:-0}"
RESERVE=25   # seconds kept for the kill grace period and the summary
MIN_RUN=30

t0=$(date +%s)
for s in $SIZES; do
  case "$s" in tiny|1b|8b) ;; *) echo "unknown size '$s' (tiny, 1b, 8b)"; exit 2 ;; esac
done
for c in $CASES; do
  case "$c" in base|draft|accept|ngram|eagle) ;; *) echo "unknown case '$c'"; exit 2 ;; esac
done
for g in $GRAPHS; do
  case "$g" in full|compile) ;; *) echo "unknown graph mode '$g' (full, compile)"; exit 2 ;; esac
done
for p in $PLUGIN; do
  case "$p" in off|on|none|noest) ;; *) echo "unknown plugin switch '$p' (off, on, none, noest)"; exit 2 ;; esac
done
for c in $CAPTURE; do
  case "$c" in default|small) ;; *) echo "unknown capture-size set '$c' (default, small)"; exit 2 ;; esac
done
case "$ALLOCATOR" in
  default|expandable) ;; *) echo "unknown ALLOCATOR '$ALLOCATOR' (default, expandable)"; exit 2 ;;
esac
case "$TP" in ''|*[!0-9]*|0) echo "TP must be a positive integer, got '$TP'"; exit 2 ;; esac
case "$MEMORY_HISTORY" in
  0) ;; 1) [ "$TP" = 1 ] || { echo "MEMORY_HISTORY=1 records at TP=1 only, got TP=$TP"; exit 2; } ;;
  *) echo "MEMORY_HISTORY must be 0 or 1, got '$MEMORY_HISTORY'"; exit 2 ;;
esac
case "$WORKLOAD" in
  smoke|peak) ;; *) echo "unknown WORKLOAD '$WORKLOAD' (smoke, peak)"; exit 2 ;;
esac
[[ -z "$UTIL" || "$UTIL" =~ ^(0\.[0-9]*[1-9][0-9]*|1|1\.0*)$ ]] \
  || { echo "UTIL must be a gpu_memory_utilization in (0, 1], got '$UTIL'"; exit 2; }
if [ "$MODE" = serve ]; then
  [ "$PLUGIN" = "off on" ] || { echo "MODE=serve runs PLUGIN=\"off on\" only, got '$PLUGIN'"; exit 2; }
  [ "$TP" = 1 ] && [ "$CAPTURE" = default ] && [ "$ALLOCATOR" = default ] \
    || { echo "MODE=serve runs TP=1, CAPTURE=default and ALLOCATOR=default only"; exit 2; }
  [ -z "$UTIL" ] && [ "$MEMORY_HISTORY" = 0 ] \
    || { echo "MODE=serve takes neither UTIL nor MEMORY_HISTORY"; exit 2; }
fi
case "$LOAD_CORES" in
  ''|*[!0-9]*|0) echo "LOAD_CORES must be a positive integer, got '$LOAD_CORES'"; exit 2 ;;
esac
case "$LOAD_ROUNDS" in
  ''|*[!0-9]*|0) echo "LOAD_ROUNDS must be a positive integer, got '$LOAD_ROUNDS'"; exit 2 ;;
esac
RUN_ARGS=()
SUFFIX=""
if [ "$TP" -gt 1 ]; then
  RUN_ARGS=(--tp "$TP")
  [ "$CUSTOM_AR" = 1 ] && RUN_ARGS+=(--custom-all-reduce)
  SUFFIX="-tp$TP"
fi
RUN_ARGS+=(--allocator "$ALLOCATOR")
if [ -n "$UTIL" ]; then
  RUN_ARGS+=(--gpu-mem-util "$UTIL")
  SUFFIX="-util$UTIL$SUFFIX"  # its own runs and table group, beside the size's own
fi
[ "$ALLOCATOR" = expandable ] && SUFFIX="-expandable$SUFFIX"  # a name ends in its TP part

# Lanes: the GPUs one run uses, as CUDA_VISIBLE_DEVICES lists them (one GPU at
# TP=1, TP consecutive ones of GPUS above). Driver-level memory readings are per
# GPU, so two runs never share one. With more than one lane each gets its own
# share of the CPU cores, so that runs side by side do not slow each other.
LANES=()
group=()
for g in $GPUS; do
  group+=("$g")
  if [ "${#group[@]}" -eq "$TP" ]; then LANES+=("$(IFS=,; echo "${group[*]}")"); group=(); fi
done
[ "${#LANES[@]}" -gt 0 ] || { echo "TP=$TP needs $TP GPUs, GPUS lists '$GPUS'"; exit 2; }
# The cores this script may use (a container's may not start at 0), dealt out
# in equal runs; a lane whose list taskset refuses is not pinned.
read -r -a CPUS <<< "$(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))' 2>/dev/null)"
per_lane=$(( ${#CPUS[@]} / ${#LANES[@]} ))
PIN=()
for i in "${!LANES[@]}"; do
  PIN[$i]=""
  if [ "${#LANES[@]}" -gt 1 ] && [ "$per_lane" -ge 2 ] && command -v taskset >/dev/null; then
    cores=$(IFS=,; echo "${CPUS[*]:$(( i * per_lane )):$per_lane}")
    taskset -c "$cores" true 2>/dev/null && PIN[$i]="taskset -c $cores"
  elif [ "$MODE" = load ] && [ "${#LANES[@]}" -eq 1 ] && command -v taskset >/dev/null; then
    cores=$(IFS=,; echo "${CPUS[*]:0:$LOAD_CORES}")
    taskset -c "$cores" true 2>/dev/null && PIN[$i]="taskset -c $cores"
  fi
done
# The plugin commit every run measures (its result keeps it): COMMIT, else this checkout's.
# A checkout with changes is measured as such: its commit carries -dirty.
head=$(git -C "$REPO" rev-parse --short=12 HEAD 2>/dev/null || true)
[ -n "$head" ] && [ -n "$(git -C "$REPO" status --porcelain 2>/dev/null)" ] && head+="-dirty"
export SPECGRAPH_COMMIT="${COMMIT:-$head}"
[ -n "$SPECGRAPH_COMMIT" ] \
  || echo "no plugin commit known (no git here): set COMMIT, or a later table drops these rows"
echo "mode $MODE; lanes (CUDA_VISIBLE_DEVICES): ${LANES[*]}; pinned to: ${PIN[*]:-(not pinned)}"
mkdir -p "$OUTDIR"
rm -f "$OUTDIR/skipped.txt"

rm -rf "$W" && mkdir -p "$W/site" "$W/tree" "$W/cwd"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$W/site" "$REPO"/.e2e/wheels/*.whl || { echo "wheel install failed"; exit 2; }
tar xzf "$REPO/.e2e/vllm-py.tar.gz" -C "$W/tree" || { echo "untar failed"; exit 2; }
python3 "$E2E/apply_shims.py" "$W/tree" || exit 2
python3 "$E2E/install_plugin.py" "$REPO" "$W/site" || { echo "plugin install failed"; exit 2; }
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
# Shared by every run below, and kept for the next invocation on this machine
# (entries are keyed by kernel source and options).
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/vllm-e2e-triton-cache}"
unset VLLM_PLUGINS VLLM_SPECGRAPH VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS  # run_llm.py sets them

nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader \
  | tee "$OUTDIR/gpu.txt"

if [ "$MODE" = demo ]; then
  left=$(( BUDGET - ($(date +%s) - t0) - RESERVE ))
  ( cd "$W/cwd" && CUDA_VISIBLE_DEVICES="${LANES[0]}" exec timeout -k 10 "$left" \
      python3 -m vllm_specgraph.demo.vllm_demo --out-dir "$OUTDIR/demo" ) \
    2>&1 | tee "$OUTDIR/demo.log"
  rc=${PIPESTATUS[0]}
  ( cd "$W/cwd" && CUDA_VISIBLE_DEVICES="${LANES[0]}" exec python3 -m vllm_specgraph.selfcheck ) \
    2>&1 | tee -a "$OUTDIR/demo.log"
  [ "${PIPESTATUS[0]}" = 0 ] && exit "$rc"
  exit 1
fi

# Processes still on the GPUs of lane $1 ("0,1"); nvidia-smi lists them by GPU UUID.
lane_gpu_processes() {
  local pattern=() index uuid
  while IFS=', ' read -r index uuid; do
    case ",$1," in *",$index,"*) pattern+=(-e "$uuid") ;; esac
  done < <(nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null)
  [ "${#pattern[@]}" -gt 0 ] || { echo 0; return; }
  nvidia-smi --query-compute-apps=gpu_uuid --format=csv,noheader 2>/dev/null | grep -c -F "${pattern[@]}"
}

run_stem() {  # size case plugin capture graphs: SIZE-CASE-PLUGIN[-small][-compile], where a run's name starts
  local stem="$1-$2-$3"
  [ "$4" = small ] && stem+="-small"
  [ "${5:-full}" = compile ] && stem+="-compile"
  echo "$stem"
}

# torch.compile's first compile of a configuration, with an empty cache, gave
# other greedy tokens than every later run that loaded its graphs from the cache,
# plugin or not. So before the first measured compile run of a (size, case) on
# this machine, one unmeasured run (plugin not loaded) fills the cache, and every
# measured run loads from it. Its marker, per (size, case, capture set,
# allocator, TP) as the cache is keyed, lives in vLLM's cache root, so it goes
# when the cache goes. Lane $1, size $2, case $3, capture set $4, limit $5.
COMPILED="${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/specgraph-e2e-compiled"
compile_cache_warmup() {
  local key="$2-$3-$4$SUFFIX"
  mkdir -p "$COMPILED"
  (
    # One warm-up at a time: lanes side by side wait, then find the marker.
    command -v flock >/dev/null && flock 9
    [ -e "$COMPILED/$key" ] && exit 0
    [ -e "$W/warm-up-failed-$key" ] && exit 0  # tried once in this invocation
    t1=$(date +%s)
    ( cd "$W/cwd" && export CUDA_VISIBLE_DEVICES="${LANES[$1]}" \
        && exec ${PIN[$1]} timeout -k 10 "$5" python3 "$E2E/run_llm.py" \
          --size "$2" --case "$3" --plugin none --capture "$4" --graph-mode compile \
          ${RUN_ARGS[@]+"${RUN_ARGS[@]}"} --out "$W/compile-warmup-$key.json" ) \
      > "$OUTDIR/compile-warmup-$key.txt" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then touch "$COMPILED/$key"; else touch "$W/warm-up-failed-$key"; fi
    echo "compile cache warm-up $key rc=$rc elapsed=$(( $(date +%s) - t1 )) s"
  ) 9> "$COMPILED/.lock"
}

# One run: "size:case:plugin:capture:workload:round:graphs", on lane $1.
run_one() {
  local lane_index=$1 lane=${LANES[$1]} size case plugin capture workload round graphs stale
  IFS=: read -r size case plugin capture workload round graphs <<< "$2"
  local name args=(--capture "$capture" --workload "$workload" --graph-mode "$graphs")
  name=$(run_stem "$size" "$case" "$plugin" "$capture" "$graphs")
  [ "$workload" != smoke ] && name+="-$workload"
  if [ "$workload" = load ]; then
    args+=(--load-requests "$LOAD_REQUESTS" --load-repeats "$LOAD_REPEATS" --load-round "$round")
    # Round 1 keeps the name of the runs from before rounds existed.
    [ "$round" -gt 1 ] && name+="-r$round"
  fi
  name+="$SUFFIX"
  rm -f "$OUTDIR/$name.json" "$OUTDIR/$name.log" "$OUTDIR/$name.pickle"
  [ "$MEMORY_HISTORY" = 1 ] && args+=(--memory-history "$OUTDIR/$name.pickle")
  local tvar="T_$size" left limit
  left=$(( BUDGET - ($(date +%s) - t0) - RESERVE ))
  limit="${!tvar}"
  [ -e "$W/warm-$size-$graphs" ] || limit=$(( limit + T_FIRST_EXTRA ))
  [ "$workload" = load ] && limit=$(( limit + T_LOAD_EXTRA ))
  [ "$TP" -gt 1 ] && limit=$(( limit + T_TP_EXTRA ))
  [ "$limit" -gt "$left" ] && limit="$left"
  if [ "$limit" -lt "$MIN_RUN" ]; then
    echo "---------------- run $name: skipped, ${left} s left of BUDGET=${BUDGET}"
    echo "$name" >> "$OUTDIR/skipped.txt"
    return
  fi
  local t1 rc run_pid
  if [ "$graphs" = compile ]; then
    compile_cache_warmup "$lane_index" "$size" "$case" "$capture" "$limit"
    left=$(( BUDGET - ($(date +%s) - t0) - RESERVE ))
    [ "$limit" -gt "$left" ] && limit="$left"
    if [ "$limit" -lt "$MIN_RUN" ]; then
      echo "---------------- run $name: skipped, ${left} s left of BUDGET=${BUDGET}"
      echo "$name" >> "$OUTDIR/skipped.txt"
      return
    fi
  fi
  echo "---------------- run $name on GPU $lane (limit ${limit} s) ----------------"
  t1=$(date +%s)
  # timeout leads its own process group: when it fires it signals the whole
  # group, vLLM's worker processes included; after the run, whatever of that
  # group is still alive (workers of a run that exited without shutting them
  # down) is stopped too, so the next run on this lane starts on free GPUs.
  ( cd "$W/cwd" && export CUDA_VISIBLE_DEVICES="$lane" \
      && exec ${PIN[$lane_index]} timeout -k 10 "$limit" python3 "$E2E/run_llm.py" \
        --size "$size" --case "$case" --plugin "$plugin" "${args[@]}" \
        ${RUN_ARGS[@]+"${RUN_ARGS[@]}"} --out "$OUTDIR/$name.json" ) > "$OUTDIR/$name.log" 2>&1 &
  run_pid=$!
  wait "$run_pid"
  rc=$?
  if [ "$TP" -gt 1 ]; then
    kill -TERM -- "-$run_pid" 2>/dev/null && sleep 2
    kill -KILL -- "-$run_pid" 2>/dev/null
    local gpu_left=0
    for _ in $(seq 1 20); do
      gpu_left=$(lane_gpu_processes "$lane")
      [ "$gpu_left" = 0 ] && break
      sleep 1
    done
    [ "$gpu_left" = 0 ] || echo "after $name: $gpu_left processes still on GPU $lane"
  fi
  [ "$rc" = 0 ] && touch "$W/warm-$size-$graphs"
  # One write per finished run, so that lanes running side by side do not interleave.
  local report
  report=$(
    echo "run $name rc=$rc elapsed=$(( $(date +%s) - t1 )) s ($(( $(date +%s) - t0 )) s since start)"
    grep -aE "Error|Traceback|CUDA graph|Graph capturing|KV cache|Model loading|Using V2|Using Attention|TRITON" \
      "$OUTDIR/$name.log" | cut -c1-300 | tail -12
    grep -ai "specgraph" "$OUTDIR/$name.log" | cut -c1-300 | tail -20
  )
  printf '%s\n' "$report"
}

# Runs the jobs in JOBS, each on the first free lane; a job is one or more runs
# (space-separated), run one after the other on that lane. Returns when all ended.
run_jobs() {
  local lane_pid=() job i free
  for job in "${JOBS[@]}"; do
    free=""
    while [ -z "$free" ]; do
      for i in "${!LANES[@]}"; do
        if [ -z "${lane_pid[$i]:-}" ] || ! kill -0 "${lane_pid[$i]}" 2>/dev/null; then
          free=$i
          break
        fi
      done
      [ -n "$free" ] || sleep 1
    done
    (
      for spec in $job; do run_one "$free" "$spec"; done
    ) &
    lane_pid[$free]=$!
  done
  wait
}

# Jobs of one phase: every (graph mode, size, capture set, case); $1 is the workload, $2 the
# plugin switches. With $3 = N rounds, the switches of a
# case form one job per round (they run one after the other on one GPU), every
# other round in reverse order (ABBA: off on, on off, ...), so that with several
# GPUs the rounds run at once and share the host alike; else each run is a job of
# its own.
make_jobs() {
  local graphs size capture case plugin job round order reversed=""
  for plugin in $2; do reversed="$plugin $reversed"; done
  JOBS=()
  for graphs in $GRAPHS; do
    for size in $SIZES; do
      for capture in $CAPTURE; do
        for case in $CASES; do
          if [ -z "${3:-}" ]; then
            for plugin in $2; do JOBS+=("$size:$case:$plugin:$capture:$1:1:$graphs"); done
            continue
          fi
          for round in $(seq 1 "$3"); do
            order=$2
            [ $(( round % 2 )) = 0 ] && order=$reversed
            job=""
            for plugin in $order; do job+="$size:$case:$plugin:$capture:$1:$round:$graphs "; done
            JOBS+=("$job")
          done
        done
      done
    done
  done
}

# vllm serve, per (graph mode, size, case): the plugin switches one after the
# other on the first lane, then the off and on runs compared. Results go to
# $OUT/serve/ (not beside the offline runs, which the summary reads).
serve_runs() {
  local graphs size case plugin name left failed=0
  mkdir -p "$OUTDIR/serve"
  for graphs in $GRAPHS; do
    for size in $SIZES; do
      for case in $CASES; do
        left=$(( BUDGET - ($(date +%s) - t0) - RESERVE ))
        [ "$graphs" = compile ] && compile_cache_warmup 0 "$size" "$case" default "$left"
        for plugin in $PLUGIN; do
          name="$(run_stem "$size" "$case" "$plugin" default "$graphs")-serve"
          left=$(( BUDGET - ($(date +%s) - t0) - RESERVE ))
          [ "$left" -ge "$MIN_RUN" ] || { echo "serve $name: skipped, ${left} s left"; continue; }
          echo "---------------- serve $name on GPU ${LANES[0]} (limit ${left} s) ----------------"
          ( cd "$W/cwd" && export CUDA_VISIBLE_DEVICES="${LANES[0]}" \
              && exec ${PIN[0]} timeout -k 10 "$left" python3 "$E2E/serve.py" run \
                --size "$size" --case "$case" --plugin "$plugin" --graph-mode "$graphs" \
                --out "$OUTDIR/serve/$name.json" ) 2>&1 | tail -5
          echo "serve $name rc=${PIPESTATUS[0]}"
          grep -a "vllm-specgraph" "$OUTDIR/serve/$name.log" | grep -av "^SPECGRAPH-LOG" | cut -c1-300
        done
        python3 "$E2E/serve.py" compare \
          "$OUTDIR/serve/$(run_stem "$size" "$case" off default "$graphs")-serve.json" \
          "$OUTDIR/serve/$(run_stem "$size" "$case" on default "$graphs")-serve.json" \
          --results "$OUTDIR/serve/$size-$case-$graphs" || failed=1
      done
    done
  done
  return "$failed"
}

case "$MODE" in
  serve)
    serve_runs
    exit $?
    ;;
  bench)
    make_jobs "$WORKLOAD" "$PLUGIN"
    run_jobs
    ;;
  load)
    make_jobs load "$PLUGIN" "$LOAD_ROUNDS"
    # The summary pools every round it finds, so the later rounds of an earlier
    # invocation must not stay behind; rounds run at once, so clear them first.
    for graphs in $GRAPHS; do
      for size in $SIZES; do
        for capture in $CAPTURE; do
          for case in $CASES; do
            for plugin in $PLUGIN; do
              name="$(run_stem "$size" "$case" "$plugin" "$capture" "$graphs")"
              for stale in "$OUTDIR/$name-load"-r*; do
                [[ ${stale#"$OUTDIR/$name-load"-r} =~ ^[0-9]+$SUFFIX\.(json|log)$ ]] && rm -f "$stale"
              done
            done
          done
        done
      done
    done
    run_jobs
    ;;
esac

python3 "$E2E/summarize.py" "$OUTDIR" \
  --results "$OUTDIR/bench/results" \
  --previous "$REPO/bench/results/vllm_graph_memory.json"
