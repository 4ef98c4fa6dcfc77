"""The ``vllm serve`` harness's CPU side (scripts/vllm_e2e/serve.py): the engine
settings as ``vllm serve`` flags (parsed by vLLM 0.33.0's own argument parser),
the ``openai`` client against a local stand-in server, the check of the plugin's
lines in a server log, and the off/on comparison. The server itself needs a GPU;
here a small HTTP server in a thread answers ``/v1/completions`` as vLLM does
with ``return_token_ids``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tests.test_vllm_e2e_harness import SCRIPTS, _load, summarize

serve = _load("serve")
run_llm = serve.run_llm

ON_LOG = (
    "(APIServer pid=10) INFO 12-02 01:02:03 [__init__.py:81] "
    "vllm-specgraph armed for vLLM 0.33.0: a, b\n"
    "(EngineCore pid=11) INFO 12-02 01:02:44 [cudagraph_utils.py:455] "
    "vllm-specgraph: CUDA graph memory profile: target 130.0 MiB\n"
    "(EngineCore pid=11) INFO 12-02 01:03:17 [model_runner.py:165] "
    "vllm-specgraph: CUDA graph memory, estimate vs actual: target 130.0 vs 130.0 MiB\n"
)
OFF_LOG = (
    "(EngineCore pid=11) INFO [__init__.py:53] vllm-specgraph is installed but off "
    "(VLLM_SPECGRAPH=0); vLLM runs unpatched\n"
)


def test_engine_settings_become_flags_that_vllm_serve_reads_back():
    """Every ``LLM(...)`` argument of a run, through ``vllm serve``'s own parser
    (in a fresh interpreter, where vLLM resolves the CPU platform), comes back as
    the engine argument it was."""
    code = f"""
import argparse, json, os, sys
sys.path.insert(0, {os.path.join(SCRIPTS, "vllm_e2e")!r})
import run_llm, serve
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
preset = run_llm.SIZES["1b"]
args = argparse.Namespace(case="eagle", graph_mode="compile", capture="default", num_spec=3,
                          tp=1, dtype="bfloat16", gpu_mem_util=0.5)
for key in ("model", "draft", "eagle"):
    setattr(args, key, os.path.join(run_llm.CONFIGS, preset[key]))
kw = run_llm.llm_kwargs(args, preset)
kw["worker_extension_cls"] = run_llm.WORKER_EXTENSION
flags = serve.server_flags(kw)
parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(flags[1:] + ["--model", flags[0]])
engine = AsyncEngineArgs.from_cli_args(parsed)
out = {{}}
for key, value in kw.items():
    got = getattr(engine, key)
    if key == "attention_config":
        got = {{"backend": got.backend.name}}
    elif key == "kernel_config":
        wanted = value["ir_op_priority"]
        got = {{"ir_op_priority": {{k: getattr(got.ir_op_priority, k) for k in wanted}}}}
    elif key == "compilation_config":
        read = got.get if isinstance(got, dict) else lambda k: getattr(got, k)
        got = {{k: read(k) for k in value}}
        got["mode"] = int(got["mode"])
        got["cudagraph_mode"] = getattr(got["cudagraph_mode"], "name", got["cudagraph_mode"])
    out[key] = [got, value]
print(json.dumps(out, default=str))
"""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(pairs) >= {"speculative_config", "compilation_config", "enable_prefix_caching"}
    for key, (got, want) in pairs.items():
        assert got == want, key


def test_flags_of_false_and_missing_values():
    flags = serve.server_flags(
        {
            "model": "/m",
            "enforce_eager": False,
            "enable_prefix_caching": False,
            "skip_tokenizer_init": True,
            "speculative_config": None,
            "seed": 0,
            "compilation_config": {"mode": 3},
        }
    )
    assert flags == [
        "/m",
        "--no-enable-prefix-caching",
        "--skip-tokenizer-init",
        "--seed",
        "0",
        "--compilation-config",
        '{"mode": 3}',
    ]


class _Completions(BaseHTTPRequestHandler):
    """``/v1/completions`` as vLLM answers it with ``return_token_ids`` (the output
    is the prompt's last token counted up, ``max_tokens`` long), and ``/pause``
    (``mode=keep``) and ``/resume``: while paused, a completion is queued and
    answered once the server resumes."""

    bodies: ClassVar[list[dict]] = []
    events: ClassVar[list[str]] = []
    running = threading.Event()
    lock = threading.Lock()
    reply_token_ids = True
    resume_failures = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        cls = type(self)
        if self.path.startswith("/pause"):
            assert self.path == "/pause?mode=keep&clear_cache=false"
            cls.running.clear()
            cls.events.append("pause")
            return self._reply({"status": "paused"})
        if self.path == "/resume":
            cls.events.append("resume")
            if cls.resume_failures:
                cls.resume_failures -= 1
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            cls.running.set()
            return self._reply({"status": "resumed"})
        with cls.lock:
            cls.bodies.append(body)
            cls.events.append("completion")
        assert cls.running.wait(10)
        start = body["prompt"][-1]
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
        if cls.reply_token_ids:
            choice["token_ids"] = [start + i + 1 for i in range(body["max_tokens"])]
        self._reply(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": body["model"],
                "choices": [choice],
            }
        )

    def _reply(self, reply: dict) -> None:
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def completions_server():
    _Completions.bodies, _Completions.events = [], []
    _Completions.running.set()
    _Completions.reply_token_ids = True
    _Completions.resume_failures = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_client_queues_every_request_while_paused_then_reads_token_ids(completions_server):
    requests = serve.run_llm.load_requests(1000, 12, 256, seed=3)
    tokens, seconds = serve.complete_all(completions_server, "m", requests, settle_s=1.0)
    assert tokens == [[ids[-1] + i + 1 for i in range(n)] for ids, n in requests]
    assert len({len(ids) for ids, _ in requests}) > 1  # mixed prompt lengths
    assert len({n for _, n in requests}) > 1  # mixed output lengths
    # Every request reached the server before it resumed, in the requests' order:
    # one queue, one schedule.
    assert _Completions.events[0] == "pause"
    assert _Completions.events[1:13] == ["completion"] * 12
    assert _Completions.events[13] == "resume"
    assert [b["prompt"] for b in _Completions.bodies] == [ids for ids, _ in requests]
    assert seconds > 0
    for body, (ids, n) in zip(
        sorted(_Completions.bodies, key=lambda b: b["prompt"]), sorted(requests), strict=True
    ):
        assert body["prompt"] == ids and body["max_tokens"] == n
        assert body["temperature"] == 0.0
        assert body["ignore_eos"] is True and body["return_token_ids"] is True


def test_client_refuses_a_reply_without_token_ids_and_resumes_the_server(completions_server):
    _Completions.reply_token_ids = False
    with pytest.raises(RuntimeError, match="no token_ids"):
        serve.complete_all(completions_server, "m", [([1, 2], 3)], settle_s=0.0)
    assert _Completions.events[-1] == "resume"


def test_log_check_counts_vllms_own_lines_of_the_plugin():
    found = serve.plugin_log_check(ON_LOG, "on")
    assert found == {"armed": True, "profile": True, "estimate vs actual": True, "off": False}
    assert serve.log_ok(found, "on")
    # The harness's tap copies the plugin's lines with a prefix; a log that has
    # only those did not get them through vLLM's logging.
    tapped = "".join(f"{run_llm.PLUGIN_LOG_PREFIX} {line}\n" for line in ON_LOG.splitlines())
    assert not serve.log_ok(serve.plugin_log_check(tapped, "on"), "on")
    missing = "\n".join(ON_LOG.splitlines()[:2])
    assert not serve.log_ok(serve.plugin_log_check(missing, "on"), "on")
    assert serve.log_ok(serve.plugin_log_check(OFF_LOG, "off"), "off")
    assert not serve.log_ok(serve.plugin_log_check(OFF_LOG + ON_LOG, "off"), "off")
    assert not serve.log_ok(serve.plugin_log_check(OFF_LOG, "on"), "on")


def _run(plugin: str, tokens: list[list[int]], **extra: object) -> dict:
    return {
        "size": "1b",
        "case": "draft",
        "plugin": plugin,
        "graph_mode": "compile",
        "ok": True,
        "tokens": tokens,
        "requests": len(tokens or []),
        "startup_s": 40.0,
        "seconds": 3.0,
        "shutdown_s": 4.0,
        "gpu_left_mib": 0,
        "log_ok": True,
        "log_lines": {},
        "clean_shutdown": True,
        "commit": "abc1234",
        "measured_utc": "2026-12-02 01:30",
        **extra,
    }


def test_compare_passes_only_equal_tokens_logs_and_clean_exits():
    assert summarize.serve_row(_run("off", [[1, 2]]), _run("on", [[1, 2]]))["check"] == "PASS"
    row = summarize.serve_row(_run("off", [[1, 2]]), _run("on", [[1, 3]]))
    assert row["check"] == "FAIL (tokens equal)"
    on = _run("on", [[1]], clean_shutdown=False, log_ok=False)
    row = summarize.serve_row(_run("off", [[1]]), on)
    assert row["check"] == "FAIL (plugin lines in the server log, clean shutdown)"
    row = summarize.serve_row(_run("off", None, ok=False), _run("on", None))
    assert row["check"].startswith("FAIL (both ran, tokens equal")
    text = summarize.serve_markdown([summarize.serve_row(_run("off", [[1]]), _run("on", [[1]]))])
    assert "| 1b | compile | draft | 1 | 40.0 / 40.0 |" in text
    assert "2026-12-02 01:30, abc1234" in text


def test_client_resumes_the_server_before_waiting_when_resuming_failed(completions_server):
    """A failed /resume raises at once, and the requests held by the paused server
    are let go first (else the client would wait for them until its timeout)."""
    import urllib.error

    _Completions.resume_failures = 1
    t0 = time.perf_counter()
    with pytest.raises(urllib.error.HTTPError):
        serve.complete_all(completions_server, "m", [([1, 2], 3), ([4], 2)], settle_s=0.0)
    assert time.perf_counter() - t0 < 5
    assert _Completions.events.count("resume") == 2
