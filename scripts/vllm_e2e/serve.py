# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` with the plugin off or on: start-up, concurrent completions
through the ``openai`` client, the server's own log, and a clean SIGINT.

    python3 serve.py --size 1b --case draft --plugin on --out on.json

It starts ``python -m vllm.entrypoints.cli.main serve`` (the API server,
and vLLM's engine core in a process of its own) with run_llm.py's engine
settings as command-line flags, the same dummy weights refilled by name
(through the dev endpoint ``/collective_rpc`` and run_llm.py's worker extension,
which also records the worker's memory figures), then sends ``--requests``
completions with token-id prompts of mixed lengths, all at once (queued while
the server is paused, so that every run schedules the same queue), greedy and to
their full length. It reads the engine's figures back, sends the
server SIGINT and checks that no process of it is left and that the GPU's used
memory is back where it was before the server started (driver level, through
``nvidia-smi``). ``summarize.py --serve`` compares the off and on runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import run_llm  # noqa: E402  (this directory, made importable just above)

ARMED = "vllm-specgraph armed for vLLM 0.33"
OFF = "vllm-specgraph is installed but off"
PLUGIN_LINES = {
    "armed": ARMED,
    "profile": "vllm-specgraph: CUDA graph memory profile",
    "estimate vs actual": "vllm-specgraph: CUDA graph memory, estimate vs actual",
}
PAUSE = "/pause?mode=keep&clear_cache=false"  # queue new requests, keep the caches
REINIT_STD = "0.05"  # run_llm.py's --reinit-std
MiB = 1 << 20


def server_flags(kw: dict[str, Any]) -> list[str]:
    """``LLM(**kw)``'s arguments as ``vllm serve`` flags: the model first, a dict
    as JSON, a true flag bare, a false one as ``--no-...`` where vLLM's default
    is true, None left out."""
    flags = [str(kw["model"])]
    for key, value in kw.items():
        if key == "model" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif key == "enable_prefix_caching":
                flags.append("--no-enable-prefix-caching")
            continue
        flags += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return flags


def plugin_log_check(log: str, switch: str) -> dict[str, bool]:
    """Which of the plugin's lines the server's log holds, in vLLM's own format
    (run_llm.py's tap copies them with a prefix; those are not counted)."""
    own = [line for line in log.splitlines() if not line.startswith(run_llm.PLUGIN_LOG_PREFIX)]
    found = {name: any(text in line for line in own) for name, text in PLUGIN_LINES.items()}
    found["off"] = any(OFF in line for line in own)
    return found


def log_ok(found: dict[str, bool], switch: str) -> bool:
    if switch == "on":
        return all(found[name] for name in PLUGIN_LINES) and not found["off"]
    return found["off"] and not any(found[name] for name in PLUGIN_LINES)


def complete_all(
    url: str,
    model: str,
    requests: list[run_llm.Request],
    settle_s: float = 2.0,
    stagger_s: float = 0.05,
    client_factory: Any = None,
) -> tuple[list[list[int]], float]:
    """Send every request at once through the ``openai`` client: greedy,
    ``ignore_eos``, token ids returned. The tokens in request order, and the
    seconds from resuming to the last reply.

    The server is paused first (``/pause?mode=keep``: requests are accepted and
    queued), the requests go out ``stagger_s`` apart, in order, and the server
    resumes ``settle_s`` after the last: so the engine schedules the same queue,
    in the same order, in every run. Otherwise the batches' make-up follows
    arrival times, and with it the numerics and the greedy tokens."""
    if client_factory is None:
        from openai import OpenAI

        def client_factory() -> Any:
            return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

    client = client_factory()
    sent = threading.Semaphore(0)

    def one(request: run_llm.Request) -> list[int]:
        ids, max_tokens = request
        sent.release()
        out = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        tokens = (out.choices[0].model_extra or {}).get("token_ids")
        if not isinstance(tokens, list):
            raise RuntimeError(f"the server's completion carried no token_ids: {out!r:.300}")
        return [int(t) for t in tokens]

    _http(url + PAUSE, {})
    with ThreadPoolExecutor(max_workers=max(len(requests), 1)) as pool:
        try:
            futures = []
            for request in requests:
                futures.append(pool.submit(one, request))
                sent.acquire()
                time.sleep(stagger_s)  # FCFS: the queue's order is the requests' order
            time.sleep(settle_s)
            t0 = time.perf_counter()
            _http(url + "/resume", {})
        except BaseException:
            # Resumed before the pool waits for its requests, which a paused
            # server would hold until the client's timeout.
            with contextlib.suppress(OSError):
                _http(url + "/resume", {})
            raise
        tokens = [f.result() for f in futures]
    return tokens, time.perf_counter() - t0


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text else None


def _wait_ready(url: str, server: subprocess.Popen, limit: float) -> float | None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        if server.poll() is not None:
            return None
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
            return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    return None


def gpu_used_mib() -> int | None:
    """The first visible GPU's used memory as the driver reports it."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return int(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (the server and every process it started)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getsid(int(name)) == sid and int(name) != os.getpid():
                pids.append(int(name))
        except OSError:
            continue
    return pids


def run(args: argparse.Namespace) -> int:
    preset = run_llm.SIZES[args.size]
    for key in ("model", "draft", "eagle"):
        setattr(args, key, os.path.join(run_llm.CONFIGS, preset[key]))
    args.dtype = args.dtype or preset["dtype"]
    args.gpu_mem_util = args.gpu_mem_util or preset["gpu_memory_utilization"]
    args.tp = 1
    env = run_llm.set_env(args.plugin)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /pause, /resume
    os.environ[run_llm.PLUGIN_LOG_ECHO_ENV] = "0"  # the plugin's lines in vLLM's own format
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    rank_dir = args.out + ".ranks"
    os.makedirs(rank_dir, exist_ok=True)
    os.environ[run_llm.RANK_DIR_ENV] = rank_dir
    kw = run_llm.llm_kwargs(args, preset)
    kw["worker_extension_cls"] = run_llm.WORKER_EXTENSION
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *server_flags(kw)]
    cmd += ["--host", "127.0.0.1", "--port", str(args.port), "--served-model-name", "m"]
    result: dict[str, Any] = {
        "size": args.size,
        "case": args.case,
        "plugin": args.plugin,
        "graph_mode": args.graph_mode,
        "env": env,
        "cmd": cmd,
        "commit": os.environ.get(run_llm.COMMIT_ENV),
        "measured_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "gpu_used_before_mib": gpu_used_mib(),
        "ok": False,
    }
    log_path = (
        args.out[: -len(".json")] + ".log" if args.out.endswith(".json") else args.out + ".log"
    )
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    requests = run_llm.load_requests(vocab, args.requests, preset["max_model_len"], args.seed)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        result["startup_s"] = _wait_ready(url, server, args.startup_limit)
        if result["startup_s"] is None:
            result["error"] = f"not ready within {args.startup_limit} s (rc {server.poll()})"
            return _finish(result, server, log_path, args)
        refill = _http(
            url + "/collective_rpc", {"method": "e2e_reinit_weights", "args": [REINIT_STD]}, 120
        )
        refilled = [r.get("params", 0) for r in (refill or {}).get("results") or ()]
        if not refilled or min(refilled) <= 0:
            raise RuntimeError(f"the weight refill refilled nothing: {refill!r:.300}")
        tokens, seconds = complete_all(url, "m", requests)
        result["tokens"] = tokens
        result["requests"] = len(requests)
        result["output_tokens"] = sum(len(t) for t in tokens)
        result["seconds"] = round(seconds, 2)
        ranks = _http(
            url + "/collective_rpc", {"method": "e2e_rank_record", "args": [args.plugin]}, 60
        )
        result["ranks"] = (ranks or {}).get("results")
        result["ok"] = True
    except Exception as e:  # recorded, then the server is stopped all the same
        result["error"] = f"{type(e).__name__}: {e}"
    return _finish(result, server, log_path, args)


def _finish(result: dict[str, Any], server: subprocess.Popen, log_path: str, args: Any) -> int:
    """SIGINT to the API server, then what it left: processes of its session and
    GPU memory above the reading taken before it started."""
    sid = server.pid
    t0 = time.perf_counter()
    if server.poll() is None:
        os.kill(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=args.shutdown_limit)
        except subprocess.TimeoutExpired:
            result["shutdown_timed_out"] = True
    result["shutdown_s"] = round(time.perf_counter() - t0, 2)
    result["server_rc"] = server.poll()
    time.sleep(2)  # the engine core's exit after the API server's
    left = _session_pids(sid)
    result["processes_left"] = left
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    result["gpu_used_after_mib"] = gpu_used_mib()
    before, after = result["gpu_used_before_mib"], result["gpu_used_after_mib"]
    result["gpu_left_mib"] = None if before is None or after is None else after - before
    with open(log_path, errors="replace") as f:
        log = f.read()
    result["log_lines"] = plugin_log_check(log, result["plugin"])
    result["log_ok"] = log_ok(result["log_lines"], result["plugin"])
    result["clean_shutdown"] = (
        not left and result["gpu_left_mib"] is not None and (result["gpu_left_mib"] <= 2)
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["ok"] and result["log_ok"] and result["clean_shutdown"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    r = ap
    r.add_argument("--size", choices=sorted(run_llm.SIZES), default="1b")
    r.add_argument("--case", choices=run_llm.CASES, default="draft")
    r.add_argument("--plugin", choices=("off", "on"), required=True)
    r.add_argument("--graph-mode", choices=tuple(run_llm.GRAPH_MODES), default="compile")
    r.add_argument("--capture", choices=run_llm.CAPTURE_SETS, default="default")
    r.add_argument("--requests", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--port", type=int, default=8765)
    r.add_argument("--startup-limit", type=float, default=300)
    r.add_argument("--shutdown-limit", type=float, default=60)
    r.add_argument("--num-spec", type=int, default=3)
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    args.dtype = args.gpu_mem_util = None
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
