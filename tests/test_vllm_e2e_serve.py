"""serve.py on a CPU: its flags read back by vLLM 0.33.0's parser, its ``openai`` client against
a stand-in server that pauses and resumes as vLLM's does, its check of the server's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.e2e_fakes import SCRIPTS, _load

serve = _load("serve")
READ_BACK = f"""import sys
sys.path.insert(0, {os.path.join(SCRIPTS, "vllm_e2e")!r})
import run_llm, serve
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
for graphs in ("compile", "full"):
    kw = run_llm.llm_kwargs("1b", "eagle", graphs) | {{"worker_extension_cls": "m.X"}}
    flags = serve.server_flags(kw)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args([*flags[1:], "--model", flags[0]])
    served, offline = AsyncEngineArgs.from_cli_args(parsed), AsyncEngineArgs(**kw)
    print("differ:", *sorted(key for key in kw if getattr(served, key) != getattr(offline, key)))
"""


def test_engine_settings_become_flags_that_vllm_serve_reads_back():
    # vllm serve's engine arguments are LLM(**kw)'s (a fresh interpreter, vLLM's CPU platform).
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": ""}
    done = subprocess.run([sys.executable, "-c", READ_BACK], capture_output=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:].decode()
    assert done.stdout.decode().splitlines()[-2:] == ["differ:"] * 2  # graph modes compile, full
    kw = {"model": "/m", "enforce_eager": False, "enable_prefix_caching": False, "seed": 0}
    kw |= {"skip_tokenizer_init": True, "speculative_config": None, "compilation_config": {"a": 3}}
    assert " ".join(serve.server_flags(kw)) == (
        '/m --no-enable-prefix-caching --seed 0 --skip-tokenizer-init --compilation-config {"a": 3}'
    )


class Completions(BaseHTTPRequestHandler):
    """Completions counting up from the prompt's last token, held while paused; /resume fails."""

    events, bodies, running = [], [], threading.Event()
    token_ids, resume_failures = True, 0

    def do_POST(self) -> None:
        cls, body = type(self), json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls.events.append(self.path.split("?")[0].strip("/").split("/")[-1])
        status = 200
        if self.path == "/pause?mode=keep&clear_cache=false":
            cls.running.clear()
        elif self.path == "/resume" and cls.resume_failures > 0:
            cls.resume_failures, status = cls.resume_failures - 1, 500
        elif self.path == "/resume":
            cls.running.set()
        else:
            cls.bodies.append(body)
            assert cls.running.wait(10)
            ids = [body["prompt"][-1] + i + 1 for i in range(body["max_tokens"])]
            body = {"choices": [{"token_ids": ids} if cls.token_ids else {"text": ""}]}
        self.send_response(status)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args: object) -> None:  # quiet
        pass


def test_client_queues_every_request_while_paused_reads_token_ids_and_resumes():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    requests = serve.run_llm.load_requests(1000, 12, 256, seed=3)  # of mixed lengths
    tokens, seconds = serve.complete_all(url, requests, settle_s=1.0)
    assert tokens == [[ids[-1] + i + 1 for i in range(n)] for ids, n in requests] and seconds > 0
    assert Completions.events == ["pause", *["completions"] * 12, "resume"]  # one queue
    assert [(b.pop("prompt"), b.pop("max_tokens")) for b in Completions.bodies] == requests
    greedy = {"model": "m", "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    assert Completions.bodies == [greedy] * 12  # in order, greedy
    Completions.token_ids = False
    with pytest.raises(RuntimeError, match="no token_ids"):
        serve.complete_all(url, [([1, 2], 3)], settle_s=0.0)
    assert Completions.events[-1] == "resume"
    # A failed /resume raises at once, the paused server's requests let go first.
    Completions.token_ids, Completions.resume_failures, t0 = True, 1, time.perf_counter()
    with pytest.raises(urllib.error.HTTPError):
        serve.complete_all(url, [([1, 2], 3), ([4], 2)], settle_s=0.0)
    assert time.perf_counter() - t0 < 5 and Completions.events.count("resume") == 4
    httpd.shutdown()
    httpd.server_close()


def test_log_check_counts_vllms_own_lines_of_the_plugin():
    on = [f"INFO [x.py:1] {line}: 1 MiB" for line in list(serve.PLUGIN_LINES.values())[1:]]
    found, ok = serve.check_log("\n".join(on), "on")
    assert ok and found == dict.fromkeys(serve.PLUGIN_LINES, True) | {"off": False}
    off = f"(EngineCore pid=11) INFO [__init__.py:53] {serve.PLUGIN_LINES['off']}"
    tapped = [f"{serve.run_llm.PLUGIN_LOG_PREFIX} {line}" for line in on]  # run_llm.py's copies
    logs = {"on": on, "tapped": tapped, "partial": on[:2], "off": [off], "both": [off, *on]}
    checks = [(name, switch) for name in logs for switch in ("on", "off")]
    passed = [f"{n} {s}" for n, s in checks if serve.check_log("\n".join(logs[n]), s)[1]]
    assert passed == ["on on", "off off"]
