# SPDX-License-Identifier: Apache-2.0
"""The end-to-end harness on the GPU machine (``scripts/device-vllm-e2e.sh``; every
knob in docs/vllm-e2e.md): unpack vLLM's tree and install the plugin under
``E2E_WORK``, plan one process per run from the environment, run the plan on the
GPU lanes within ``BUDGET``, then summarize."""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import glob
import itertools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESERVE, MIN_RUN = 25, 30  # seconds kept for the summary; the shortest run worth starting
MODES = {  # MODE: the default SIZES, CASES, PLUGIN
    "bench": ("tiny", "base draft ngram eagle", "off on"),
    "load": ("1b", "base draft accept", "off on"),
    "demo": ("tiny", "draft", "on"),
    "serve": ("1b", "draft", "off on"),
}
LISTS = {  # knob: default (None: the MODE's), the values allowed; the first five take several
    "SIZES": (None, "tiny 1b 8b"),
    "CASES": (None, "base draft accept ngram eagle"),
    "GRAPHS": ("compile", "full compile"),
    "PLUGIN": (None, "off on none noest once"),
    "CAPTURE": ("default", "default small"),
    "ALLOCATOR": ("default", "default expandable"),
    "WORKLOAD": ("smoke", "smoke peak"),
    "MEMORY_HISTORY": ("0", "0 1"),
}
NUMBERS = {"TP": 1, "LOAD_CORES": 8, "LOAD_ROUNDS": 2}  # positive integers
SECONDS = {"T_tiny": 90, "T_1b": 150, "T_8b": 300, "T_FIRST_EXTRA": 60, "T_LOAD_EXTRA": 60}
SECONDS |= {"T_TP_EXTRA": 30, "BUDGET": 570}
UTIL = re.compile(r"0\.[0-9]*[1-9][0-9]*|1|1\.0*")
REPORTED = re.compile(
    "Error|Traceback|CUDA graph|Graph capturing|KV cache|Model loading|Using V2|Using Attention"
    "|TRITON"
)
RUN_ENV = {  # every run's, once the tree is unpacked
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",  # else xgrammar's tvm-ffi JIT-builds a torch addon
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # MRV2's sampler imports flashinfer unguarded otherwise
}


class Run(NamedTuple):
    name: str
    size: str
    case: str
    capture: str
    graphs: str
    args: list[str]  # run_llm.py's


def now() -> int:
    return int(time.time())


def refuse(message: str) -> SystemExit:
    print(message, flush=True)
    return SystemExit(2)


def knobs(env: dict[str, str]) -> SimpleNamespace:
    """The knobs from ``env``, checked: a bad one exits 2 and says why."""
    mode = env.get("MODE") or "bench"
    if mode not in MODES:
        raise refuse(f"unknown MODE '{mode}' ({', '.join(MODES)})")
    k = SimpleNamespace(mode=mode, util=env.get("UTIL", ""), custom_ar=env.get("CUSTOM_AR", "0"))
    defaults = dict(zip(("SIZES", "CASES", "PLUGIN"), MODES[mode], strict=True))
    for i, (knob, (default, allowed)) in enumerate(LISTS.items()):
        value = env.get(knob) or default or defaults[knob]
        for one in value.split() if i < 5 else [value]:
            if one not in allowed.split():
                raise refuse(f"unknown {knob} '{one}' ({allowed.replace(' ', ', ')})")
        setattr(k, knob.lower(), value.split() if i < 5 else value)
    for knob, default in NUMBERS.items():
        value = env.get(knob) or str(default)
        if not (value.isascii() and value.isdigit() and int(value) > 0):
            raise refuse(f"{knob} must be a positive integer, got '{value}'")
        setattr(k, knob.lower(), int(value))
    for knob, default in SECONDS.items():
        setattr(k, knob.lower(), int(env.get(knob) or default))
    if k.memory_history == "1" and k.tp > 1:
        raise refuse(f"MEMORY_HISTORY=1 records at TP=1 only, got TP={k.tp}")
    if k.util and not UTIL.fullmatch(k.util):
        raise refuse(f"UTIL must be a gpu_memory_utilization in (0, 1], got '{k.util}'")
    if mode == "serve" and k.plugin != ["off", "on"]:
        raise refuse(f"MODE=serve runs PLUGIN=\"off on\" only, got '{' '.join(k.plugin)}'")
    if mode == "serve" and (k.tp > 1 or k.capture != ["default"] or k.allocator != "default"):
        raise refuse("MODE=serve runs TP=1, CAPTURE=default and ALLOCATOR=default only")
    if mode == "serve" and (k.util or k.memory_history == "1"):
        raise refuse("MODE=serve takes neither UTIL nor MEMORY_HISTORY")
    k.out = os.path.abspath(env.get("OUT") or "/tmp/vllm-e2e-out")
    k.work = os.path.abspath(env.get("E2E_WORK") or "/tmp/vllm-e2e")
    k.load_requests = env.get("LOAD_REQUESTS") or "256"
    k.load_repeats = env.get("LOAD_REPEATS") or "2"
    # The end of a run's name and of its table group: -expandable-utilU-tpN.
    k.suffix = "-expandable" * (k.allocator == "expandable") + f"-util{k.util}" * bool(k.util)
    k.suffix += f"-tp{k.tp}" * (k.tp > 1)
    k.run_args = ["--tp", str(k.tp)] + ["--custom-all-reduce"] * (k.custom_ar == "1")
    k.run_args = k.run_args * (k.tp > 1) + ["--allocator", k.allocator]
    k.run_args += ["--gpu-mem-util", k.util] * bool(k.util)
    return k


def stem(size: str, case: str, plugin: str, capture: str, graphs: str) -> str:
    return (
        f"{size}-{case}-{plugin}"
        + "-small" * (capture == "small")
        + "-compile" * (graphs == "compile")
    )


def plan(k: SimpleNamespace) -> list[list[Run]]:
    """Jobs, each a list of runs for one lane, one after the other: per (graph mode,
    size, capture set, case) each switch a job of its own; in load mode each round's
    switches one job, in reverse order every other round (off on, on off, ...)."""
    jobs = []
    for graphs, size, capture, case in itertools.product(k.graphs, k.sizes, k.capture, k.cases):
        for n in range(1, k.load_rounds + 1) if k.mode == "load" else [0]:
            job = []
            for plugin in k.plugin if n % 2 or not n else k.plugin[::-1]:
                workload = "load" if n else k.workload
                name = stem(size, case, plugin, capture, graphs) + f"-{workload}" * (
                    workload != "smoke"
                )
                name += f"-r{n}" * (n > 1) + k.suffix
                args = ["--size", size, "--case", case, "--plugin", plugin, "--capture", capture]
                args += ["--workload", workload, "--graph-mode", graphs]
                if n:
                    args += ["--load-requests", k.load_requests, "--load-repeats", k.load_repeats]
                    args += ["--load-round", str(n)]
                args += ["--memory-history", f"{k.out}/{name}.pickle"] * (k.memory_history == "1")
                args += [*k.run_args, "--out", f"{k.out}/{name}.json"]
                job.append(Run(name, size, case, capture, graphs, args))
            jobs += [job] if n else [[run] for run in job]
    return jobs


def lanes_and_pins(k: SimpleNamespace, env: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """The lanes (TP consecutive GPUs of GPUS each, as CUDA_VISIBLE_DEVICES lists
    them) and each lane's taskset prefix: with several lanes each its share of the
    cores, in load mode on one lane the first LOAD_CORES cores for every run."""
    gpus = env.get("GPUS") or env.get("CUDA_VISIBLE_DEVICES", "").replace(",", " ")
    gpus = gpus or " ".join(smi("--query-gpu=index")) or "0"
    ids = gpus.split()
    lanes = [",".join(ids[i : i + k.tp]) for i in range(0, len(ids) - k.tp + 1, k.tp)]
    if not lanes:
        raise refuse(f"TP={k.tp} needs {k.tp} GPUs, GPUS lists '{gpus}'")
    cpus = sorted(os.sched_getaffinity(0))
    share, pins = len(cpus) // len(lanes), []
    for i in range(len(lanes)):
        cores = cpus[i * share : (i + 1) * share] if len(lanes) > 1 and share >= 2 else []
        cores = cpus[: k.load_cores] if k.mode == "load" and len(lanes) == 1 else cores
        pin = ["taskset", "-c", ",".join(map(str, cores))]
        ok = cores and shutil.which("taskset")
        pins.append(pin if ok and not call([*pin, "true"], stderr=subprocess.DEVNULL) else [])
    return lanes, pins


def call(cmd: list[str], **kw: object) -> int:
    return subprocess.run(cmd, **kw).returncode


def smi(*query: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True)
    except OSError:
        return []
    return [line.strip() for line in out.stdout.decode().splitlines() if line.strip()]


def commit() -> str:
    """The plugin commit every run measures: COMMIT, else the checkout's (-dirty with
    changes); the copy on the GPU machine may have no git metadata."""

    def git(*args: str) -> str:
        with contextlib.suppress(OSError):
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True).stdout.decode()
        return ""

    head = git("rev-parse", "--short=12", "HEAD").strip()
    return os.environ.get("COMMIT") or head + "-dirty" * bool(head and git("status", "--porcelain"))


class Device:
    """Runs jobs on lanes, each run with its own limit, cut to what is left of BUDGET
    when it starts; torch.compile's cache warmed first where a run needs it."""

    def __init__(self, k: SimpleNamespace, lanes: list[str], pins: list[list[str]], t0: int):
        self.k, self.lanes, self.pins, self.t0 = k, lanes, pins, t0
        self.warm: set[tuple[str, str]] = set()  # (size, graphs) of runs that ended well
        self.failed_warmups: set[str] = set()
        self.lock = threading.Lock()
        self.cwd = os.path.join(k.work, "cwd")
        cache = os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")
        self.markers = os.path.join(cache, "specgraph-e2e-compiled")

    def left(self) -> int:
        return self.k.budget - (now() - self.t0) - RESERVE

    def say(self, *lines: str) -> None:
        with self.lock:
            print(*lines, sep="\n", flush=True)

    def launch(self, lane: int, argv: list[str], limit: int, log: str | None) -> subprocess.Popen:
        """``python3 ARGV`` on ``lane`` under ``timeout``, which leads a process group of
        its own and signals all of it (vLLM's workers too) when the limit runs out;
        the output into ``log``, else a pipe."""
        cmd = [*self.pins[lane], "timeout", "-k", "10", str(limit), "python3", *argv]
        env = os.environ | {"CUDA_VISIBLE_DEVICES": self.lanes[lane]}
        with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
            kw = {"stdout": out, "stderr": subprocess.STDOUT, "text": True}
            return subprocess.Popen(cmd, cwd=self.cwd, env=env, **kw)

    def skip(self, name: str, left: int) -> None:
        self.say(f"---------------- run {name}: skipped, {left} s left of BUDGET={self.k.budget}")
        with self.lock, open(os.path.join(self.k.out, "skipped.txt"), "a") as f:
            f.write(name + "\n")

    def warm_up(self, lane: int, size: str, case: str, capture: str, limit: int) -> None:
        """A first compile with an empty cache gave other greedy tokens than later runs
        that loaded from it, so one unmeasured run without the plugin fills the cache
        first, once per (size, case, capture set, allocator, TP) on this machine (the
        marker lies in vLLM's cache root); one at a time, across invocations too; one
        that failed is not tried again in this invocation."""
        key = f"{size}-{case}-{capture}{self.k.suffix}"
        os.makedirs(self.markers, exist_ok=True)
        with open(os.path.join(self.markers, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(os.path.join(self.markers, key)) or key in self.failed_warmups:
                return
            t1, run_llm = now(), os.path.join(HERE, "run_llm.py")
            args = [run_llm, "--size", size, "--case", case, "--plugin", "none", "--capture"]
            args += [capture, "--graph-mode", "compile", *self.k.run_args, "--out"]
            args += [os.path.join(self.k.work, f"compile-warmup-{key}.json")]
            log = os.path.join(self.k.out, f"compile-warmup-{key}.txt")
            if rc := self.launch(lane, args, limit, log).wait():
                self.failed_warmups.add(key)
            else:
                open(os.path.join(self.markers, key), "w").close()
            self.say(f"compile cache warm-up {key} rc={rc} elapsed={now() - t1} s")

    def run(self, lane: int, run: Run) -> None:
        k, out, gpus = self.k, os.path.join(self.k.out, run.name), self.lanes[lane]
        for ext in (".json", ".log", ".pickle"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(out + ext)
        limit = getattr(k, f"t_{run.size}") + k.t_first_extra * (
            (run.size, run.graphs) not in self.warm
        )
        limit += k.t_load_extra * (k.mode == "load") + k.t_tp_extra * (k.tp > 1)
        limit = min(limit, left := self.left())
        if limit >= MIN_RUN and run.graphs == "compile":
            self.warm_up(lane, run.size, run.case, run.capture, limit)
            limit = min(limit, left := self.left())
        if limit < MIN_RUN:
            return self.skip(run.name, left)
        self.say(f"---------------- run {run.name} on GPU {gpus} (limit {limit} s) " + "-" * 16)
        t1 = now()
        proc = self.launch(lane, [os.path.join(HERE, "run_llm.py"), *run.args], limit, out + ".log")
        rc = proc.wait()
        if k.tp > 1:  # stop what is left of its process group; wait for its GPUs to be free
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                    time.sleep(2 * (sig == signal.SIGTERM))
            for _ in range(20):
                if not (busy := self.gpu_processes(gpus)):
                    break
                time.sleep(1)
            if busy:
                self.say(f"after {run.name}: {busy} processes still on GPU {gpus}")
        if rc == 0:
            self.warm.add((run.size, run.graphs))
        with open(out + ".log", errors="replace") as f:
            lines = [line.rstrip("\n")[:300] for line in f]
        self.say(
            f"run {run.name} rc={rc} elapsed={now() - t1} s ({now() - self.t0} s since start)",
            *[line for line in lines if REPORTED.search(line)][-12:],
            *[line for line in lines if "specgraph" in line.lower()][-20:],
        )

    def gpu_processes(self, lane: str) -> int:
        gpus = [row.split(", ") for row in smi("--query-gpu=index,uuid")]
        uuids = [uuid for index, uuid in gpus if index in lane.split(",")]
        apps = smi("--query-compute-apps=gpu_uuid") if uuids else []
        return sum(any(uuid in app for uuid in uuids) for app in apps)

    def execute(self, jobs: list[list[Run]]) -> None:
        """Each job on the first lane free, its runs one after the other."""
        free: queue.Queue[int] = queue.Queue()
        for lane in range(len(self.lanes)):
            free.put(lane)

        def work(lane: int, job: list[Run]) -> None:
            try:
                for run in job:
                    self.run(lane, run)
            finally:
                free.put(lane)

        threads = []
        for job in jobs:
            threads.append(threading.Thread(target=work, args=(free.get(), job)))
            threads[-1].start()
        for thread in threads:
            thread.join()

    def serve(self) -> int:
        """Per (graph mode, size, case): vllm serve with each switch on the first lane,
        then the off and on runs compared; results under $OUT/serve/."""
        k, failed, here = self.k, 0, os.path.join(self.k.out, "serve")
        os.makedirs(here, exist_ok=True)
        for graphs, size, case in itertools.product(k.graphs, k.sizes, k.cases):
            if graphs == "compile":
                self.warm_up(0, size, case, "default", self.left())
            stems = {
                p: os.path.join(here, stem(size, case, p, "default", graphs)) for p in k.plugin
            }
            for plugin, out in stems.items():
                name, left = os.path.basename(out) + "-serve", self.left()
                if left < MIN_RUN:
                    print(f"serve {name}: skipped, {left} s left", flush=True)
                    continue
                self.say(f"---------------- serve {name} on GPU {self.lanes[0]} (limit {left} s)")
                args = ["--size", size, "--case", case, "--plugin", plugin, "--graph-mode", graphs]
                argv = [os.path.join(HERE, "serve.py"), *args, "--out", out + "-serve.json"]
                proc = self.launch(0, argv, left, None)
                print(
                    *proc.communicate()[0].splitlines()[-5:],
                    f"serve {name} rc={proc.returncode}",
                    sep="\n",
                )
                with contextlib.suppress(OSError), open(out + "-serve.log", errors="replace") as f:
                    lines = [line.rstrip("\n")[:300] for line in f if "vllm-specgraph" in line]
                    print(
                        *(line for line in lines if not line.startswith("SPECGRAPH-LOG")), sep="\n"
                    )
            pair = [stems[p] + "-serve.json" for p in ("off", "on")]
            results = os.path.join(here, f"{size}-{case}-{graphs}")
            summarize = ["python3", os.path.join(HERE, "summarize.py"), "--serve", *pair]
            failed |= bool(call([*summarize, "--results", results]))
        return failed

    def demo(self) -> int:
        """The vLLM demo, then the lane self-check, both also into $OUT/demo.log."""
        env = os.environ | {"CUDA_VISIBLE_DEVICES": self.lanes[0]}
        demo = f"timeout -k 10 {self.left()} python3 -m vllm_specgraph.demo.vllm_demo --out-dir"
        rcs = []
        with open(os.path.join(self.k.out, "demo.log"), "w") as log:
            for cmd in (
                [*demo.split(), os.path.join(self.k.out, "demo")],
                ["python3", "-m", "vllm_specgraph.selfcheck"],
            ):
                kw = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
                proc = subprocess.Popen(cmd, cwd=self.cwd, env=env, **kw)
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                rcs.append(proc.wait())
        return rcs[0] if rcs[1] == 0 else 1


# ---- setup: vLLM's tree, the stand-ins, the plugin ----------------------------------

FA_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n"  # vllm/vllm_flash_attn/__init__.py
FA_WARN = "    import warnings as _w  # vllm-e2e shim: no FA .so carried\n    _w.warn(\n"
NAMESPACES = "_C|_C_cache_ops|_C_cuda_utils|_C_custom_ar"
OP_REF = re.compile(rf"torch\.ops\.({NAMESPACES})\.([A-Za-z_0-9]+)")
OP_PROBE = re.compile(rf"hasattr\(\s*torch\.ops\.({NAMESPACES})\s*,\s*[\"']([A-Za-z_0-9]+)[\"']")
# The package's build staged from a clean copy, so that no build/ or *.egg-info of
# the repository leaks into it; the readme is pyproject.toml's.
STAGED = ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "README.md", "docs/package.md")
CHECK = """import sys
from importlib.metadata import entry_points
from importlib.util import find_spec
site = sys.argv[1]
eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "specgraph"]
assert len(eps) == 1, f"expected one 'specgraph' entry point, found {eps}"
loc, origin = str(eps[0].dist.locate_file("")), find_spec(eps[0].module).origin
assert loc.startswith(site), f"entry point's distribution is at {loc}, not under {site}"
assert origin.startswith(site), f"{eps[0].module} would be imported from {origin}"
print(f"entry point {eps[0].value} ({eps[0].dist.name} {eps[0].dist.version}) -> {origin}")
"""  # found, not run: the package may import vLLM, which is not on this interpreter's path


def apply_shims(tree: str) -> None:
    """The stand-in for vllm._C_stable_libtorch; the list of every torch.ops name
    vLLM's Python refers to without a hasattr probe (defining a probed one would
    flip a guard), which the stand-in defines as ops that raise; and the FA guard
    turned into a warning (an exact edit that must match once)."""
    shutil.copyfile(
        os.path.join(HERE, "_C_stable_libtorch.py"), f"{tree}/vllm/_C_stable_libtorch.py"
    )
    refs, probed = set(), set()
    for top, _, files in os.walk(f"{tree}/vllm"):
        for name in (f for f in files if f.endswith(".py")):
            with open(os.path.join(top, name), encoding="utf-8") as f:
                text = f.read()
            refs.update(OP_REF.findall(text))
            probed.update(OP_PROBE.findall(text))
    names = sorted(f"{ns}::{name}" for ns, name in refs - probed)
    with open(f"{tree}/vllm/_C_stable_libtorch_placeholders.txt", "w") as f:
        f.write("\n".join(names) + "\n")
    print(f"placeholders: {len(names)} op names referenced without a hasattr probe")
    with open(path := f"{tree}/vllm/vllm_flash_attn/__init__.py") as f:
        text = f.read()
    old = FA_GUARD + "    raise ImportError(\n"
    if (n := text.count(old)) != 1:
        raise refuse(f"{path}: expected 1 match, found {n}")
    with open(path, "w") as f:  # no FA .so is carried: the Triton backend is selected
        f.write(text.replace(old, FA_GUARD + FA_WARN))


def install_plugin(site: str) -> bool:
    """The repository's package into ``site`` with pip (or, where pip cannot build it,
    copied with a dist-info written from pyproject.toml), then checked in a fresh
    interpreter outside the repository: one entry point, resolving under ``site``,
    and every installed .py file equal to the repository's."""
    import tomllib

    with tempfile.TemporaryDirectory() as src:
        for name in [*STAGED, *map(os.path.basename, glob.glob(f"{REPO}/LICEN[CS]E*"))]:
            if os.path.exists(os.path.join(REPO, name)):
                os.makedirs(os.path.dirname(os.path.join(src, name)), exist_ok=True)
                shutil.copy2(os.path.join(REPO, name), os.path.join(src, name))
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(f"{REPO}/vllm_specgraph", f"{src}/vllm_specgraph", ignore=ignore)
        pip = "python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile"
        pip += " --no-cache-dir --disable-pip-version-check --target"
        done = subprocess.run([*pip.split(), site, src], capture_output=True, text=True)
        if done.returncode:
            print(
                f"pip install failed (rc={done.returncode}):", (done.stdout + done.stderr)[-3000:]
            )
            with open(f"{src}/pyproject.toml", "rb") as f:
                project = tomllib.load(f)["project"]
            shutil.rmtree(f"{site}/vllm_specgraph", ignore_errors=True)
            shutil.copytree(f"{src}/vllm_specgraph", f"{site}/vllm_specgraph")
            info = f"{site}/{project['name'].replace('-', '_')}-{project['version']}.dist-info"
            shutil.rmtree(info, ignore_errors=True)
            os.makedirs(info)
            with open(f"{info}/METADATA", "w") as f:
                f.write(f"Metadata-Version: 2.1\nName: {project['name']}\n")
                f.write(f"Version: {project['version']}\n")
            with open(f"{info}/entry_points.txt", "w") as f:
                for group, eps in project.get("entry-points", {}).items():
                    f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
            with open(f"{info}/INSTALLER", "w") as f:
                f.write("vllm-e2e copy\n")
        print(f"plugin installed into {site} by {'copy' if done.returncode else 'pip'}")
    env = os.environ | {"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory() as cwd:
        checked = subprocess.run(["python3", "-c", CHECK, site], cwd=cwd, env=env)
    files = glob.glob("**/*.py", root_dir=f"{REPO}/vllm_specgraph", recursive=True)
    differ = [
        f
        for f in sorted(files)
        if not os.path.exists(f"{site}/vllm_specgraph/{f}")
        or not filecmp.cmp(
            f"{REPO}/vllm_specgraph/{f}", f"{site}/vllm_specgraph/{f}", shallow=False
        )
    ]
    if differ:
        print(f"installed copy differs from the repository in: {differ}")
    else:
        print(f"{len(files)} .py files installed, identical to the repository's")
    return not checked.returncode and not differ


def setup(k: SimpleNamespace) -> None:
    """Wheels and vLLM's tree under E2E_WORK (emptied first), the stand-ins, the plugin."""
    site, tree = os.path.join(k.work, "site"), os.path.join(k.work, "tree")
    shutil.rmtree(k.work, ignore_errors=True)
    for path in (site, tree, os.path.join(k.work, "cwd")):
        os.makedirs(path)
    pip = "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target"
    if call([*pip.split(), site, *sorted(glob.glob(f"{REPO}/.e2e/wheels/*.whl"))]):
        raise refuse("wheel install failed")
    try:
        with tarfile.open(os.path.join(REPO, ".e2e", "vllm-py.tar.gz")) as tar:
            tar.extractall(tree, filter="data")
    except (OSError, tarfile.TarError) as e:
        raise refuse(f"untar failed: {e}") from e
    apply_shims(tree)
    if not install_plugin(site):
        raise refuse("plugin install failed")


def main() -> int:
    t0 = now()
    # Inherited by every process below, vLLM's workers at TP > 1 included;
    # CUDA_VISIBLE_DEVICES then counts the GPUs as nvidia-smi does.
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    os.environ.update(NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    k = knobs(dict(os.environ))
    lanes, pins = lanes_and_pins(k, dict(os.environ))
    os.environ["SPECGRAPH_COMMIT"] = sha = commit()
    if not sha:
        print("no plugin commit known (no git here): set COMMIT, or a later table drops these rows")
    pinned = " ".join(pin[2] for pin in pins if pin) or "(not pinned)"
    print(f"mode {k.mode}; lanes (CUDA_VISIBLE_DEVICES): {' '.join(lanes)}; pinned to: {pinned}")
    os.makedirs(k.out, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(k.out, "skipped.txt"))
    setup(k)
    print(f"setup took {now() - t0} s; commit {sha or '-'}", flush=True)
    # The runs start in an empty directory: `python -m` puts the working directory
    # first on sys.path, where the repository would shadow the installed plugin.
    os.environ.update(RUN_ENV, PYTHONPATH=f"{k.work}/tree:{k.work}/site")
    triton = os.environ.get("TRITON_CACHE_DIR") or "/tmp/vllm-e2e-triton-cache"
    os.environ["TRITON_CACHE_DIR"] = triton  # shared by every run, kept for the next invocation
    for key in ("VLLM_PLUGINS", "VLLM_SPECGRAPH", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"):
        os.environ.pop(key, None)  # run_llm.py sets them per switch
    gpu = smi("--query-gpu=index,name,memory.total,memory.used,driver_version")
    print(*gpu, sep="\n", flush=True)
    with open(os.path.join(k.out, "gpu.txt"), "w") as f:
        f.write("".join(line + "\n" for line in gpu))
    device = Device(k, lanes, pins, t0)
    if k.mode in ("demo", "serve"):
        return device.demo() if k.mode == "demo" else device.serve()
    if k.mode == "load":  # the summary pools every round it finds: none may be stale
        for g, s, cap, case, p in itertools.product(
            k.graphs, k.sizes, k.capture, k.cases, k.plugin
        ):
            name = stem(s, case, p, cap, g) + "-load-r"
            for path in glob.glob(os.path.join(k.out, glob.escape(name) + "*")):
                rest = os.path.basename(path)[len(name) :]
                if re.fullmatch(r"[0-9]+" + re.escape(k.suffix) + r"\.(json|log)", rest):
                    os.remove(path)
    device.execute(plan(k))
    summarize = ["python3", os.path.join(HERE, "summarize.py"), k.out, "--results"]
    previous = os.path.join(REPO, "bench", "results", "vllm_graph_memory.json")
    return call([*summarize, os.path.join(k.out, "bench", "results"), "--previous", previous])


if __name__ == "__main__":
    sys.exit(main())
