# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` with the plugin off or on (``serve.py --plugin on --out on.json``): token-id
completions through the ``openai`` client, then SIGINT, the processes and GPU memory left
and the plugin's lines in the server's own log, as JSON. ``summarize.py --serve`` compares."""

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
from pathlib import Path
from typing import Any

from openai import OpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_llm  # from this directory, made importable just above

PLUGIN_LINES = {  # the off line, then the on ones
    "off": "vllm-specgraph is installed but off",
    "armed": "vllm-specgraph armed for vLLM 0.33",
    "profile": "vllm-specgraph: CUDA graph memory profile",
    "estimate vs actual": "vllm-specgraph: CUDA graph memory, estimate vs actual",
}
PORT, REQUESTS, STARTUP_LIMIT_S, SHUTDOWN_LIMIT_S = 8765, 64, 300, 60
SAMPLING = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def server_flags(kw: dict[str, Any]) -> list[str]:
    """``LLM(**kw)``'s arguments as ``vllm serve`` flags: the model first, a dict as JSON, True
    bare, False left out but for prefix caching (``--no-...``: vLLM's default is on)."""
    flags = [str(kw["model"])]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True or (value is False and key == "enable_prefix_caching"):
            flags.append(flag if value else "--no-" + flag[2:])
        elif key != "model" and value is not None and value is not False:
            flags += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return flags


def check_log(log: str, switch: str) -> tuple[dict[str, bool], bool]:
    """The plugin's lines in the log in vLLM's own format (not run_llm.py's prefixed copies),
    and whether they are the switch's: on, all but the off line; off, the off line alone."""
    own = [line for line in log.splitlines() if not line.startswith(run_llm.PLUGIN_LOG_PREFIX)]
    found = {name: any(text in line for line in own) for name, text in PLUGIN_LINES.items()}
    on = [found[name] for name in PLUGIN_LINES if name != "off"]
    ok = all(on) and not found["off"] if switch == "on" else found["off"] and not any(on)
    return found, ok


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or "null")


def complete_all(url: str, requests: list, settle_s: float = 2.0) -> tuple[list, float]:
    """The requests' tokens (greedy, ``ignore_eos``), sent in order to the paused server, and
    the seconds from resuming it to the last reply: one queue, so one schedule every run."""
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    sent = threading.Semaphore(0)

    def one(prompt: list[int], n: int) -> list[int]:
        sent.release()
        out = client.completions.create(model="m", prompt=prompt, max_tokens=n, **SAMPLING)
        tokens = (out.choices[0].model_extra or {}).get("token_ids")
        if not isinstance(tokens, list):
            raise RuntimeError(f"the server's completion carried no token_ids: {out!r:.300}")
        return [int(t) for t in tokens]

    http(url + "/pause?mode=keep&clear_cache=false", {})  # queue new requests, keep caches
    with ThreadPoolExecutor(max_workers=max(len(requests), 1)) as pool:
        try:
            futures = []
            for request in requests:
                futures.append(pool.submit(one, *request))
                sent.acquire()
                time.sleep(0.05)  # first come, first served: the requests' order
            time.sleep(settle_s)
            t0 = time.perf_counter()
            http(url + "/resume", {})
        except BaseException:  # resumed, or the pool would wait for what the server holds
            with contextlib.suppress(OSError):
                http(url + "/resume", {})
            raise
        tokens = [f.result() for f in futures]
    return tokens, time.perf_counter() - t0


def gpu_used_mib() -> int | None:
    """The first visible GPU's used memory as the driver reports it."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    query = ["nvidia-smi", "-i", gpu, "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    with contextlib.suppress(OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return int(subprocess.run(query, capture_output=True, timeout=30).stdout.split()[0])
    return None


def stop(server: subprocess.Popen, result: dict[str, Any]) -> None:
    """SIGINT, then what the server left: its session's processes (killed) and GPU memory."""
    t0 = time.perf_counter()
    server.send_signal(signal.SIGINT)  # unless it has exited
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=SHUTDOWN_LIMIT_S)
    result |= {"shutdown_s": round(time.perf_counter() - t0, 2), "server_rc": server.poll()}
    time.sleep(2)  # the engine core's exit after the API server's
    left = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        with contextlib.suppress(OSError):  # gone
            if os.getsid(pid) == server.pid:
                left.append(pid)
                os.kill(pid, signal.SIGKILL)
    before, after = result["gpu_used_before_mib"], gpu_used_mib()
    gpu_left = None if before is None or after is None else after - before
    result |= {"processes_left": left, "gpu_used_after_mib": after, "gpu_left_mib": gpu_left}
    result["clean_shutdown"] = not left and gpu_left is not None and gpu_left <= 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(run_llm.SIZES), default="1b")
    ap.add_argument("--case", choices=run_llm.CASES, default="draft")
    ap.add_argument("--plugin", choices=("off", "on"), required=True)
    ap.add_argument("--graph-mode", choices=tuple(run_llm.GRAPH_MODES), default="compile")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = run_llm.set_env(args.plugin)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /pause, /resume
    os.environ[run_llm.PLUGIN_LOG_ECHO_ENV] = "0"  # the plugin's lines in vLLM's own format
    run_llm.prepare_workers(args.out)  # the worker extension importable
    kw = run_llm.llm_kwargs(args.size, args.case, args.graph_mode)
    kw["worker_extension_cls"] = run_llm.WORKER_EXTENSION
    url = f"http://127.0.0.1:{PORT}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *server_flags(kw)]
    cmd += ["--host", "127.0.0.1", "--port", str(PORT), "--served-model-name", "m"]
    result = vars(args) | {"env": env, "cmd": cmd, "commit": os.environ.get(run_llm.COMMIT_ENV)}
    result["measured_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    result |= {"gpu_used_before_mib": gpu_used_mib(), "ok": False, "startup_s": None}
    log = Path(args.out).with_suffix(".log")  # the server's
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.perf_counter()
        while result["startup_s"] is None:
            if server.poll() is not None or time.perf_counter() - t0 > STARTUP_LIMIT_S:
                raise TimeoutError(f"not ready within {STARTUP_LIMIT_S} s (rc {server.poll()})")
            time.sleep(0.5)
            with contextlib.suppress(OSError, ValueError):  # not answering yet
                http(url + "/health", timeout=2)
                result["startup_s"] = time.perf_counter() - t0
        body = {"method": "e2e_reinit_weights", "args": [str(run_llm.REINIT_STD)]}
        refill = (http(url + "/collective_rpc", body, timeout=120) or {}).get("results")
        if not refill or min(r.get("params", 0) for r in refill) <= 0:
            raise RuntimeError(f"the weight refill refilled nothing: {refill!r:.300}")
        vocab, most = run_llm.vocab_size(args.size), run_llm.SIZES[args.size]["max_model_len"]
        requests = run_llm.load_requests(vocab, REQUESTS, most, run_llm.LOAD_SEED)
        result["tokens"], seconds = complete_all(url, requests)
        result |= {"requests": len(requests), "seconds": round(seconds, 2), "ok": True}
    except Exception as e:  # recorded; the server is stopped all the same
        result["error"] = f"{type(e).__name__}: {e}"
    stop(server, result)
    result["log_lines"], result["log_ok"] = check_log(log.read_text(errors="replace"), args.plugin)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] and result["log_ok"] and result["clean_shutdown"] else 1


if __name__ == "__main__":
    sys.exit(main())
