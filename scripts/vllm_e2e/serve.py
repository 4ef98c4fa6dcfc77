# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` with the plugin off or on, written to ``--out`` as JSON
(``python3 serve.py --size 1b --case draft --plugin on --out on.json``): the API server
and vLLM's engine core in a process of its own, run_llm.py's engine settings as flags;
the dummy weights refilled by name through ``/collective_rpc`` (run_llm.py's worker
extension, which also reads the worker's figures back); token-id completions of mixed
lengths through the ``openai`` client, queued while the server is paused; then SIGINT,
and checks that no process of its session and no GPU memory is left and that the
server's own log holds the plugin's lines. ``summarize.py --serve`` compares off and on."""

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
PORT, REQUESTS, STARTUP_LIMIT_S, SHUTDOWN_LIMIT_S = 8765, 64, 300, 60


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


def check_log(log: str, switch: str) -> tuple[dict[str, bool], bool]:
    """Which of the plugin's lines the server's log holds in vLLM's own format (the
    copies run_llm.py's tap prints with its prefix do not count), and whether they are
    the switch's: on, every plugin line and not the off line; off, the off line alone."""
    own = [line for line in log.splitlines() if not line.startswith(run_llm.PLUGIN_LOG_PREFIX)]
    found = {name: any(text in line for line in own) for name, text in PLUGIN_LINES.items()}
    found["off"] = any(OFF in line for line in own)
    lines = [found[name] for name in PLUGIN_LINES]
    ok = all(lines) and not found["off"] if switch == "on" else found["off"] and not any(lines)
    return found, ok


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text else None


def complete_all(
    url: str, model: str, requests: list[run_llm.Request], settle_s: float = 2.0
) -> tuple[list[list[int]], float]:
    """Every request through the ``openai`` client (greedy, ``ignore_eos``, token ids
    returned): the tokens in request order, and the seconds from resuming the server to
    the last reply. Sent one by one to the paused server, resumed ``settle_s`` after the
    last, the same queue is scheduled in every run (else the batches, and with them the
    greedy tokens, follow arrival times)."""
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
                time.sleep(0.05)  # first come, first served: the requests' order
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


def rpc(url: str, method: str, arg: str, timeout: float) -> list[dict] | None:
    """Every worker's answer to a worker extension method (vLLM's dev endpoint)."""
    body = {"method": method, "args": [arg]}
    return (http(url + "/collective_rpc", body, timeout) or {}).get("results")


def stop(server: subprocess.Popen, result: dict[str, Any]) -> None:
    """SIGINT to the API server, then what it left: processes of its session (killed
    once counted) and GPU memory above the reading before it started."""
    t0 = time.perf_counter()
    if server.poll() is None:
        os.kill(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=SHUTDOWN_LIMIT_S)
        except subprocess.TimeoutExpired:
            result["shutdown_timed_out"] = True
    result["shutdown_s"] = round(time.perf_counter() - t0, 2)
    result["server_rc"] = server.poll()
    time.sleep(2)  # the engine core's exit after the API server's
    result["processes_left"] = left = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            if os.getsid(int(name)) == server.pid and int(name) != os.getpid():
                left.append(int(name))
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    before, after = result["gpu_used_before_mib"], gpu_used_mib()
    gpu_left = None if before is None or after is None else after - before
    result |= {"gpu_used_after_mib": after, "gpu_left_mib": gpu_left}
    result["clean_shutdown"] = not left and gpu_left is not None and gpu_left <= 2


def run(args: argparse.Namespace) -> int:
    env = run_llm.set_env(args.plugin)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /pause, /resume
    os.environ[run_llm.PLUGIN_LOG_ECHO_ENV] = "0"  # the plugin's lines in vLLM's own format
    run_llm.prepare_workers(args.out)  # the extension importable, an empty rank directory
    kw = run_llm.llm_kwargs(args.size, args.case, args.graph_mode)
    kw["worker_extension_cls"] = run_llm.WORKER_EXTENSION
    url = f"http://127.0.0.1:{PORT}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *server_flags(kw)]
    cmd += ["--host", "127.0.0.1", "--port", str(PORT), "--served-model-name", "m"]
    result: dict[str, Any] = {"size": args.size, "case": args.case, "plugin": args.plugin}
    result |= {"graph_mode": args.graph_mode, "env": env, "cmd": cmd}
    result["commit"] = os.environ.get(run_llm.COMMIT_ENV)
    result["measured_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    result |= {"gpu_used_before_mib": gpu_used_mib(), "ok": False, "startup_s": None}
    log_path = args.out.removesuffix(".json") + ".log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.perf_counter()
        while server.poll() is None and time.perf_counter() - t0 < STARTUP_LIMIT_S:
            with contextlib.suppress(OSError, ValueError):  # not answering yet
                http(url + "/health", timeout=2)
                result["startup_s"] = time.perf_counter() - t0
                break
            time.sleep(0.5)
        if result["startup_s"] is None:
            raise TimeoutError(f"not ready within {STARTUP_LIMIT_S} s (rc {server.poll()})")
        refill = rpc(url, "e2e_reinit_weights", str(run_llm.REINIT_STD), 120)
        if not refill or min(r.get("params", 0) for r in refill) <= 0:
            raise RuntimeError(f"the weight refill refilled nothing: {refill!r:.300}")
        vocab, most = run_llm.vocab_size(args.size), run_llm.SIZES[args.size]["max_model_len"]
        requests = run_llm.load_requests(vocab, REQUESTS, most, run_llm.LOAD_SEED)
        tokens, seconds = complete_all(url, "m", requests)
        result |= {"tokens": tokens, "requests": len(requests), "seconds": round(seconds, 2)}
        result["output_tokens"] = sum(len(t) for t in tokens)
        result["ranks"] = rpc(url, "e2e_rank_record", args.plugin, 60)
        result["ok"] = True
    except Exception as e:  # recorded; the server is stopped all the same
        result["error"] = f"{type(e).__name__}: {e}"
    stop(server, result)
    with open(log_path, errors="replace") as f:
        result["log_lines"], result["log_ok"] = check_log(f.read(), args.plugin)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["ok"] and result["log_ok"] and result["clean_shutdown"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(run_llm.SIZES), default="1b")
    ap.add_argument("--case", choices=run_llm.CASES, default="draft")
    ap.add_argument("--plugin", choices=("off", "on"), required=True)
    ap.add_argument("--graph-mode", choices=tuple(run_llm.GRAPH_MODES), default="compile")
    ap.add_argument("--out", required=True)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
