"""The ``vllm serve`` runner's CPU side (scripts/vllm_e2e/serve.py): the engine settings as
``vllm serve`` flags, read back by vLLM 0.33.0's own parser; the ``openai`` client
against a stand-in server that answers ``/v1/completions`` as vLLM does with
``return_token_ids`` and pauses and resumes as vLLM's dev endpoints do; and the
check of the plugin's lines in a server log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tests.e2e_fakes import SCRIPTS, _load

serve = _load("serve")

ON_LOG = """\
(APIServer pid=10) INFO 12-02 01:02:03 [__init__.py:81] vllm-specgraph armed for vLLM 0.33.0
(EngineCore pid=11) INFO [cudagraph_utils.py:455] vllm-specgraph: CUDA graph memory profile: 1 MiB
(EngineCore pid=11) INFO [model_runner.py:165] vllm-specgraph: CUDA graph memory, estimate vs actual
"""
OFF_LOG = "(EngineCore pid=11) INFO [__init__.py:53] vllm-specgraph is installed but off\n"
READ_BACK = f"""
import json, sys
sys.path.insert(0, {os.path.join(SCRIPTS, "vllm_e2e")!r})
import run_llm, serve
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
kw = run_llm.llm_kwargs("1b", "eagle") | {{"worker_extension_cls": run_llm.WORKER_EXTENSION}}
flags = serve.server_flags(kw)
parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(flags[1:] + ["--model", flags[0]])
engine, out = AsyncEngineArgs.from_cli_args(parsed), {{}}
for key, value in kw.items():
    got = getattr(engine, key)
    if key == "attention_config":
        got = {{"backend": got.backend.name}}
    elif key == "kernel_config":
        priority = {{k: getattr(got.ir_op_priority, k) for k in value["ir_op_priority"]}}
        got = {{"ir_op_priority": priority}}
    elif key == "compilation_config":
        got = {{k: got.get(k) if isinstance(got, dict) else getattr(got, k) for k in value}}
        got["mode"] = int(got["mode"])
        got["cudagraph_mode"] = getattr(got["cudagraph_mode"], "name", got["cudagraph_mode"])
    out[key] = [got, value]
print(json.dumps(out, default=str))
"""


def test_engine_settings_become_flags_that_vllm_serve_reads_back():
    """Every ``LLM(...)`` argument of a run, through ``vllm serve``'s own parser (in a
    fresh interpreter, where vLLM resolves the CPU platform), is the engine argument it was."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", READ_BACK], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"speculative_config", "compilation_config", "enable_prefix_caching"} <= set(pairs)
    for key, (got, want) in pairs.items():
        assert got == want, key
    kw = {"model": "/m", "enforce_eager": False, "enable_prefix_caching": False, "seed": 0}
    kw |= {"skip_tokenizer_init": True, "speculative_config": None, "compilation_config": {"a": 3}}
    assert " ".join(serve.server_flags(kw)) == (
        '/m --no-enable-prefix-caching --seed 0 --skip-tokenizer-init --compilation-config {"a": 3}'
    )


class Completions(BaseHTTPRequestHandler):
    """``/v1/completions`` (the output is the prompt's last token counted up, ``max_tokens``
    long), ``/pause?mode=keep`` (completions are held until ``/resume``) and ``/resume``
    (failing ``resume_failures`` times first)."""

    events: ClassVar[list[str]] = []  # the server's record, reset per test
    bodies: ClassVar[list[dict]] = []
    running = threading.Event()
    token_ids, resume_failures = True, 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        cls = type(self)
        cls.events.append(self.path.split("?")[0].strip("/").split("/")[-1])
        if self.path.startswith("/pause"):
            assert self.path == "/pause?mode=keep&clear_cache=false"
            cls.running.clear()
            return self.reply({})
        if self.path == "/resume":
            cls.resume_failures -= 1
            if cls.resume_failures >= 0:
                return self.reply({}, 500)
            cls.running.set()
            return self.reply({})
        cls.bodies.append(body)
        assert cls.running.wait(10)
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
        if cls.token_ids:
            choice["token_ids"] = [body["prompt"][-1] + i + 1 for i in range(body["max_tokens"])]
        reply = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"]}
        self.reply(reply | {"choices": [choice]})

    def reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def server():
    Completions.events, Completions.bodies = [], []
    Completions.token_ids, Completions.resume_failures = True, 0
    Completions.running.set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_client_queues_every_request_while_paused_then_reads_token_ids(server):
    requests = serve.run_llm.load_requests(1000, 12, 256, seed=3)
    tokens, seconds = serve.complete_all(server, "m", requests, settle_s=1.0)
    assert tokens == [[ids[-1] + i + 1 for i in range(n)] for ids, n in requests] and seconds > 0
    assert len({len(ids) for ids, _ in requests}) > 1 and len({n for _, n in requests}) > 1
    # Every request reached the server before it resumed, in the requests' order: one
    # queue, one schedule.
    assert Completions.events == ["pause", *["completions"] * 12, "resume"]
    assert [(b["prompt"], b["max_tokens"]) for b in Completions.bodies] == requests
    sampling = [
        (b["temperature"], b["ignore_eos"], b["return_token_ids"]) for b in Completions.bodies
    ]
    assert set(sampling) == {(0.0, True, True)}


def test_client_refuses_a_reply_without_token_ids_and_resumes_the_server(server):
    Completions.token_ids = False
    with pytest.raises(RuntimeError, match="no token_ids"):
        serve.complete_all(server, "m", [([1, 2], 3)], settle_s=0.0)
    assert Completions.events[-1] == "resume"
    # A failed /resume raises at once, and the requests the paused server holds are let
    # go first (else the client would wait for them until its timeout).
    Completions.token_ids, Completions.resume_failures = True, 1
    t0 = time.perf_counter()
    with pytest.raises(urllib.error.HTTPError):
        serve.complete_all(server, "m", [([1, 2], 3), ([4], 2)], settle_s=0.0)
    assert time.perf_counter() - t0 < 5 and Completions.events.count("resume") == 3


def test_log_check_counts_vllms_own_lines_of_the_plugin():
    found, _ = serve.check_log(ON_LOG, "on")
    assert found == {"armed": True, "profile": True, "estimate vs actual": True, "off": False}
    # The run's tap copies the plugin's lines with a prefix; a log that has only those
    # did not get them through vLLM's logging.
    tapped = "".join(f"SPECGRAPH-LOG {line}\n" for line in ON_LOG.splitlines())
    partial = "\n".join(ON_LOG.splitlines()[:2])
    cases = [(ON_LOG, "on", True), (tapped, "on", False), (partial, "on", False)]
    cases += [(OFF_LOG, "off", True), (OFF_LOG + ON_LOG, "off", False), (OFF_LOG, "on", False)]
    assert [serve.check_log(log, switch)[1] for log, switch, _ in cases] == [c[2] for c in cases]
