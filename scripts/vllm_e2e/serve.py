# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` with the plugin off or on, written to ``--out`` as JSON:

    python3 serve.py --size 1b --case draft --plugin on --graph-mode compile --out on.json

Starts ``python -m vllm.entrypoints.cli.main serve`` (the API server, and vLLM's
engine core in a process of its own) with run_llm.py's engine settings as flags,
refills the dummy weights by name through the dev endpoint ``/collective_rpc``
(run_llm.py's worker extension, which also reads the worker's figures back),
sends ``--requests`` token-id completions of mixed lengths through the ``openai``
client, all queued while the server is paused so that every run schedules the
same queue, then sends SIGINT and checks that no process of its session and no
GPU memory (``nvidia-smi``) is left, and that the server's own log holds the
plugin's lines. ``summarize.py --serve`` compares the off and on runs.
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
sys.path.insert(0, HERE)

import run_llm  # noqa: E402  (this directory, made importable just above)

OFF = "vllm-specgraph is installed but off"
PLUGIN_LINES = {
    "armed": "vllm-specgraph armed for vLLM 0.33",
    "profile": "vllm-specgraph: CUDA graph memory profile",
    "estimate vs actual": "vllm-specgraph: CUDA graph memory, estimate vs actual",
}
PAUSE = "/pause?mode=keep&clear_cache=false"  # queue new requests, keep the caches
REINIT_STD = "0.05"  # run_llm.py's --reinit-std


def server_flags(kw: dict[str, Any]) -> list[str]:
    """``LLM(**kw)``'s arguments as ``vllm serve`` flags: the model first, a dict as
    JSON, a true flag bare, a false one as ``--no-...`` where vLLM's default is
    true, None left out."""
    flags = [str(kw["model"])]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if key == "model" or value is None or (value is False and key != "enable_prefix_caching"):
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-enable-prefix-caching")
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return flags


def plugin_log_check(log: str) -> dict[str, bool]:
    """Which of the plugin's lines the server's log holds in vLLM's own format (the
    copies run_llm.py's tap prints with its prefix do not count)."""
    own = [line for line in log.splitlines() if not line.startswith(run_llm.PLUGIN_LOG_PREFIX)]
    found = {name: any(text in line for line in own) for name, text in PLUGIN_LINES.items()}
    return found | {"off": any(OFF in line for line in own)}


def log_ok(found: dict[str, bool], switch: str) -> bool:
    """On: every plugin line and not the off line; off: the off line alone."""
    lines = [found[name] for name in PLUGIN_LINES]
    return all(lines) and not found["off"] if switch == "on" else found["off"] and not any(lines)


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text else None


def complete_all(
    url: str,
    model: str,
    requests: list[run_llm.Request],
    settle_s: float = 2.0,
    stagger_s: float = 0.05,
) -> tuple[list[list[int]], float]:
    """Every request through the ``openai`` client (greedy, ``ignore_eos``, token ids
    returned): the tokens in request order, and the seconds from resuming the
    server to the last reply. The server is paused first (requests are queued),
    the requests go out ``stagger_s`` apart, in order, and it resumes ``settle_s``
    after the last, so the engine schedules the same queue in every run; without
    that the batches' make-up, and with it the greedy tokens, follow arrival times."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sent = threading.Semaphore(0)

    def one(request: run_llm.Request) -> list[int]:
        sent.release()
        extra = {"ignore_eos": True, "return_token_ids": True}
        out = client.completions.create(
            model=model, prompt=request[0], max_tokens=request[1], temperature=0.0, extra_body=extra
        )
        tokens = (out.choices[0].model_extra or {}).get("token_ids")
        if not isinstance(tokens, list):
            raise RuntimeError(f"the server's completion carried no token_ids: {out!r:.300}")
        return [int(t) for t in tokens]

    http(url + PAUSE, {})
    with ThreadPoolExecutor(max_workers=max(len(requests), 1)) as pool:
        try:
            futures = []
            for request in requests:
                futures.append(pool.submit(one, request))
                sent.acquire()
                time.sleep(stagger_s)  # first come, first served: the requests' order
            time.sleep(settle_s)
            t0 = time.perf_counter()
            http(url + "/resume", {})
        except BaseException:
            # Resumed before the pool waits for the requests a paused server holds.
            with contextlib.suppress(OSError):
                http(url + "/resume", {})
            raise
        tokens = [f.result() for f in futures]
    return tokens, time.perf_counter() - t0


def gpu_used_mib() -> int | None:
    """The first visible GPU's used memory as the driver reports it."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    query = ["-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid``: the server and every process it started."""
    pids = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            if os.getsid(int(name)) == sid and int(name) != os.getpid():
                pids.append(int(name))
    return pids


def run(args: argparse.Namespace) -> int:
    preset = run_llm.SIZES[args.size]
    for key in ("model", "draft", "eagle"):
        setattr(args, key, os.path.join(run_llm.CONFIGS, preset[key]))
    args.dtype, args.gpu_mem_util = preset["dtype"], preset["gpu_memory_utilization"]
    args.tp = 1
    env = run_llm.set_env(args.plugin)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /pause, /resume
    os.environ[run_llm.PLUGIN_LOG_ECHO_ENV] = "0"  # the plugin's lines in vLLM's own format
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *paths])
    os.makedirs(rank_dir := args.out + ".ranks", exist_ok=True)
    os.environ[run_llm.RANK_DIR_ENV] = rank_dir
    kw = run_llm.llm_kwargs(args, preset) | {"worker_extension_cls": run_llm.WORKER_EXTENSION}
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
    log_path = args.out.removesuffix(".json") + ".log"
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    requests = run_llm.load_requests(vocab, args.requests, preset["max_model_len"], args.seed)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0, result["startup_s"] = time.perf_counter(), None
        while server.poll() is None and time.perf_counter() - t0 < args.startup_limit:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                result["startup_s"] = time.perf_counter() - t0
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        if result["startup_s"] is None:
            result["error"] = f"not ready within {args.startup_limit} s (rc {server.poll()})"
        else:
            rpc = {"method": "e2e_reinit_weights", "args": [REINIT_STD]}
            refill = http(url + "/collective_rpc", rpc, 120)
            refilled = [r.get("params", 0) for r in (refill or {}).get("results") or ()]
            if not refilled or min(refilled) <= 0:
                raise RuntimeError(f"the weight refill refilled nothing: {refill!r:.300}")
            tokens, seconds = complete_all(url, "m", requests)
            result |= {"tokens": tokens, "requests": len(requests)}
            result |= {"output_tokens": sum(len(t) for t in tokens), "seconds": round(seconds, 2)}
            rpc = {"method": "e2e_rank_record", "args": [args.plugin]}
            result["ranks"] = (http(url + "/collective_rpc", rpc, 60) or {}).get("results")
            result["ok"] = True
    except Exception as e:  # recorded; the server is stopped all the same
        result["error"] = f"{type(e).__name__}: {e}"
    # SIGINT to the API server, then what it left: processes of its session, and GPU
    # memory above the reading before it started.
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
    result["processes_left"] = left = session_pids(server.pid)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    result["gpu_used_after_mib"] = after = gpu_used_mib()
    before = result["gpu_used_before_mib"]
    result["gpu_left_mib"] = None if before is None or after is None else after - before
    with open(log_path, errors="replace") as f:
        result["log_lines"] = plugin_log_check(f.read())
    result["log_ok"] = log_ok(result["log_lines"], args.plugin)
    result["clean_shutdown"] = (
        not left and result["gpu_left_mib"] is not None and (result["gpu_left_mib"] <= 2)
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["ok"] and result["log_ok"] and result["clean_shutdown"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(run_llm.SIZES), default="1b")
    ap.add_argument("--case", choices=run_llm.CASES, default="draft")
    ap.add_argument("--plugin", choices=("off", "on"), required=True)
    ap.add_argument("--graph-mode", choices=tuple(run_llm.GRAPH_MODES), default="compile")
    ap.add_argument("--capture", choices=run_llm.CAPTURE_SETS, default="default")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--startup-limit", type=float, default=300)
    ap.add_argument("--shutdown-limit", type=float, default=60)
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--out", required=True)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
