# SPDX-License-Identifier: Apache-2.0
"""The end-to-end harness on the GPU machine (``scripts/device-vllm-e2e.sh``; every
knob in docs/vllm-e2e.md): read the knobs, plan one process per run, unpack vLLM's
tree and install the plugin under ``E2E_WORK``, run the plan on the GPU lanes within
``BUDGET``, then summarize."""

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
CHOICES = {  # knob: its default (None: the MODE's), the values it may list
    "SIZES": (None, "tiny 1b 8b"),
    "CASES": (None, "base draft accept ngram eagle"),
    "GRAPHS": ("compile", "full compile"),
    "PLUGIN": (None, "off on none once"),
}
COUNTS = {"TP": 1, "LOAD_CORES": 8, "LOAD_ROUNDS": 2, "LOAD_REQUESTS": 256, "LOAD_REPEATS": 2}
SECONDS = {"BUDGET": 570, "T_tiny": 90, "T_1b": 150, "T_8b": 300}
SECONDS |= {"T_FIRST_EXTRA": 60, "T_LOAD_EXTRA": 60, "T_TP_EXTRA": 30}
REPORTED = re.compile(
    "Error|Traceback|CUDA graph|Graph capturing|KV cache|Model loading|Using V2|Using Attention"
    "|TRITON"
)
ENV = {  # every process's, vLLM's workers at TP > 1 included
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # CUDA_VISIBLE_DEVICES counts GPUs as nvidia-smi does
    "NCCL_NVLS_ENABLE": "0",  # NVLink multicast off, in NCCL, torch and NVSHMEM
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONHASHSEED": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",  # else xgrammar's tvm-ffi JIT-builds a torch addon
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # MRV2's sampler imports flashinfer unguarded otherwise
}
SWITCH_ENV = ("VLLM_PLUGINS", "VLLM_SPECGRAPH", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")


class Run(NamedTuple):
    name: str
    size: str
    case: str
    graphs: str
    args: list[str]  # the script's, ``--out`` JSON last
    script: str  # run_llm.py or serve.py


def now() -> int:
    return int(time.time())


def refuse(message: str) -> SystemExit:
    print(message, flush=True)
    return SystemExit(2)


def knobs(env: dict[str, str]) -> SimpleNamespace:
    """The knobs from ``env``, each as an attribute named in lower case; a bad one exits
    2 and names the knob, its value and what it may be."""
    mode = env.get("MODE") or "bench"
    if mode not in MODES:
        raise refuse(f"unknown MODE '{mode}' ({', '.join(MODES)})")
    k = SimpleNamespace(mode=mode, custom_ar=env.get("CUSTOM_AR") == "1")
    mode_defaults = dict(zip(("SIZES", "CASES", "PLUGIN"), MODES[mode], strict=True))
    for knob, (default, allowed) in CHOICES.items():
        values = (env.get(knob) or default or mode_defaults[knob]).split()
        if bad := [value for value in values if value not in allowed.split()]:
            raise refuse(f"unknown {knob} '{bad[0]}' ({allowed.replace(' ', ', ')})")
        setattr(k, knob.lower(), values)
    for knob, default in (COUNTS | SECONDS).items():
        value, least = env.get(knob) or str(default), 0 if knob in SECONDS else 1
        if not (value.isascii() and value.isdigit() and int(value) >= least):
            kind = "a whole number of seconds" if least == 0 else "a positive integer"
            raise refuse(f"{knob} must be {kind}, got '{value}'")
        setattr(k, knob.lower(), int(value))
    if mode == "serve" and (k.plugin != ["off", "on"] or k.tp > 1):
        raise refuse(f"MODE=serve runs PLUGIN=\"off on\" at TP=1 only, got '{' '.join(k.plugin)}'")
    k.out = os.path.abspath(env.get("OUT") or "/tmp/vllm-e2e-out")
    k.work = os.path.abspath(env.get("E2E_WORK") or "/tmp/vllm-e2e")
    k.tp_suffix = f"-tp{k.tp}" * (k.tp > 1)  # the end of a run's name and of its table group
    k.tp_args = ["--tp", str(k.tp), *["--custom-all-reduce"] * k.custom_ar] * (k.tp > 1)
    return k


# ---- the plan, the lanes, the budget ----------------------------------------------


def stem(size: str, case: str, plugin: str, graphs: str) -> str:
    return f"{size}-{case}-{plugin}" + "-compile" * (graphs == "compile")


def make_run(k: SimpleNamespace, graphs: str, size: str, case: str, plugin: str, n: int) -> Run:
    """One process: serve.py in MODE=serve, else run_llm.py with the smoke generate or,
    with ``n``, round n of MODE=load."""
    name = stem(size, case, plugin, graphs)
    args = ["--size", size, "--case", case, "--plugin", plugin]
    if k.mode == "serve":
        args += ["--graph-mode", graphs, "--out", f"{k.out}/serve/{name}-serve.json"]
        return Run(name + "-serve", size, case, graphs, args, "serve.py")
    args += ["--workload", "load" if n else "smoke", "--graph-mode", graphs]
    if n:
        name += "-load" + f"-r{n}" * (n > 1)
        args += ["--load-requests", str(k.load_requests), "--load-repeats", str(k.load_repeats)]
        args += ["--load-round", str(n)]
    name += k.tp_suffix
    args += [*k.tp_args, "--out", f"{k.out}/{name}.json"]
    return Run(name, size, case, graphs, args, "run_llm.py")


def plan(k: SimpleNamespace) -> list[list[Run]]:
    """Jobs, each a list of runs for one lane, one after the other. Per (graph mode, size,
    case) each switch is a job of its own, queued together so that finished pairs come
    first; in load mode each round's switches are one job, in reverse order every other
    round (off on, on off, ...), so that both find the lane alike; in serve mode all is
    one job, one server at a time (serve.py's port)."""
    jobs = []
    for graphs, size, case in itertools.product(k.graphs, k.sizes, k.cases):
        for n in range(1, k.load_rounds + 1) if k.mode == "load" else ():
            switches = k.plugin if n % 2 else k.plugin[::-1]
            jobs.append([make_run(k, graphs, size, case, plugin, n) for plugin in switches])
        if k.mode != "load":
            jobs += [[make_run(k, graphs, size, case, plugin, 0)] for plugin in k.plugin]
    return [[run for job in jobs for run in job]] if k.mode == "serve" else jobs


def lanes_and_pins(k: SimpleNamespace, env: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    """The lanes (TP consecutive GPUs of GPUS each, as CUDA_VISIBLE_DEVICES lists them;
    GPUs left over go unused) and each lane's taskset prefix: with several lanes each
    its share of the cores; in load mode on one lane the first LOAD_CORES cores."""
    gpus = env.get("GPUS") or env.get("CUDA_VISIBLE_DEVICES", "").replace(",", " ")
    ids = (gpus or " ".join(smi("--query-gpu=index")) or "0").split()
    lanes = [",".join(ids[i : i + k.tp]) for i in range(0, len(ids) - k.tp + 1, k.tp)]
    if not lanes:
        raise refuse(f"TP={k.tp} needs {k.tp} GPUs, GPUS lists '{gpus}'")
    cpus, n = sorted(os.sched_getaffinity(0)), len(lanes)
    if k.mode == "load" and n == 1:
        cores = [cpus[: k.load_cores]]
    elif n > 1 and (share := len(cpus) // n) >= 2:
        cores = [cpus[i * share : (i + 1) * share] for i in range(n)]
    else:
        cores = [[]] * n
    taskset = shutil.which("taskset")
    return lanes, [["taskset", "-c", ",".join(map(str, c))] if taskset and c else [] for c in cores]


class Device:
    """Runs jobs on lanes. A run's limit is its size's T_ plus the extras that apply,
    cut to what is left of BUDGET when it starts (so limits hold with runs side by
    side); a run that would get less than MIN_RUN seconds is skipped and listed."""

    def __init__(self, k: SimpleNamespace, lanes: list[str], pins: list[list[str]], t0: int):
        self.k, self.lanes, self.pins, self.t0 = k, lanes, pins, t0
        self.warm: set[tuple[str, str]] = set()  # (size, graphs) of runs that ended well
        self.failed_warm_ups: set[str] = set()
        self.lock = threading.Lock()
        self.cwd = os.path.join(k.work, "cwd")
        cache = os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")
        self.markers = os.path.join(cache, "specgraph-e2e-compiled")

    def left(self) -> int:
        return self.k.budget - (now() - self.t0) - RESERVE

    def limit(self, run: Run) -> int:
        """A serve run gets what is left: serve.py keeps its own start-up and shutdown
        limits, and only it can stop the server it started in a session of its own."""
        k = self.k
        if run.script == "serve.py":
            return self.left()
        limit = getattr(k, f"t_{run.size}") + k.t_load_extra * (k.mode == "load")
        limit += k.t_first_extra * ((run.size, run.graphs) not in self.warm)  # cold caches
        return min(limit + k.t_tp_extra * (k.tp > 1), self.left())

    def skip(self, name: str) -> None:
        self.say(f"---------------- run {name}: skipped, {self.left()} s left of BUDGET")
        with self.lock, open(os.path.join(self.k.out, "skipped.txt"), "a") as f:
            f.write(name + "\n")

    def execute(self, jobs: list[list[Run]]) -> None:
        """Each lane takes the next job whenever it is free and runs its runs in turn."""
        todo: queue.SimpleQueue[list[Run]] = queue.SimpleQueue()
        for job in jobs:
            todo.put(job)

        def lane_loop(lane: int) -> None:
            with contextlib.suppress(queue.Empty):
                while True:
                    for run in todo.get_nowait():
                        self.run(lane, run)

        threads = [threading.Thread(target=lane_loop, args=(i,)) for i in range(len(self.lanes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def run(self, lane: int, run: Run) -> None:
        log = os.path.join(self.k.out, run.name + ".log")
        for path in (run.args[-1], log):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        if run.graphs == "compile" and (limit := self.limit(run)) >= MIN_RUN:
            self.warm_up(lane, run.size, run.case, limit)
        if (limit := self.limit(run)) < MIN_RUN:
            return self.skip(run.name)
        gpus, t1 = self.lanes[lane], now()
        self.say(f"---------------- run {run.name} on GPU {gpus} (limit {limit} s) " + "-" * 16)
        proc = self.launch(lane, [f"{HERE}/{run.script}", *run.args], limit, log)
        rc = proc.wait()
        if self.k.tp > 1:
            self.release(proc, gpus)
        if rc == 0:
            self.warm.add((run.size, run.graphs))
        with open(log, errors="replace") as f:
            lines = [line.rstrip("\n")[:300] for line in f]
        self.say(
            f"run {run.name} rc={rc} elapsed={now() - t1} s ({now() - self.t0} s since start)",
            *[line for line in lines if REPORTED.search(line)][-12:],
            *[line for line in lines if "specgraph" in line.lower()][-20:],
        )

    def warm_up(self, lane: int, size: str, case: str, limit: int) -> None:
        """A first compile with an empty cache gave other greedy tokens than later runs
        that loaded from it, so one unmeasured run without the plugin fills the cache
        first, once per (size, case, TP) on this machine (the marker lies in vLLM's cache
        root); one at a time, across invocations too; one that failed is not tried again
        in this invocation."""
        key = f"{size}-{case}{self.k.tp_suffix}"
        os.makedirs(self.markers, exist_ok=True)
        with open(os.path.join(self.markers, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(os.path.join(self.markers, key)) or key in self.failed_warm_ups:
                return
            t1 = now()
            args = [f"{HERE}/run_llm.py", "--size", size, "--case", case, "--plugin", "none"]
            args += ["--graph-mode", "compile", *self.k.tp_args]
            args += ["--out", os.path.join(self.k.work, f"compile-warmup-{key}.json")]
            log = os.path.join(self.k.out, f"compile-warmup-{key}.txt")
            if rc := self.launch(lane, args, limit, log).wait():
                self.failed_warm_ups.add(key)
            else:
                open(os.path.join(self.markers, key), "w").close()
            self.say(f"compile cache warm-up {key} rc={rc} elapsed={now() - t1} s")

    def launch(self, lane: int, argv: list[str], limit: int, log: str | None) -> subprocess.Popen:
        """``python3 ARGV`` on ``lane`` under ``timeout``, which leads a process group of
        its own and signals all of it (vLLM's workers too) when the limit runs out;
        the output into ``log``, else a pipe."""
        cmd = [*self.pins[lane], "timeout", "-k", "10", str(limit), "python3", *argv]
        env = os.environ | {"CUDA_VISIBLE_DEVICES": self.lanes[lane]}
        with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
            kw = {"stdout": out, "stderr": subprocess.STDOUT, "text": True}
            return subprocess.Popen(cmd, cwd=self.cwd, env=env, **kw)

    def release(self, proc: subprocess.Popen, gpus: str) -> None:
        """At TP > 1 vLLM's workers may outlive the run: the lane is free once what is left
        of its process group is stopped and nvidia-smi lists no process on its GPUs (20 s
        at most)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
                time.sleep(2 * (sig == signal.SIGTERM))
        rows = [row.split(", ") for row in smi("--query-gpu=index,uuid")]
        uuids = [uuid for index, uuid in rows if index in gpus.split(",")]
        for _ in range(20):
            apps = smi("--query-compute-apps=gpu_uuid") if uuids else []
            if not (busy := sum(app in uuids for app in apps)):
                return
            time.sleep(1)
        self.say(f"{busy} processes still on GPU {gpus}")

    def say(self, *lines: str) -> None:
        with self.lock:
            print(*lines, sep="\n", flush=True)

    def demo(self) -> int:
        """The vLLM demo, then the lane self-check, printed and also into $OUT/demo.log;
        the demo's exit status, or 1 where the self-check failed."""
        demo = ["-m", "vllm_specgraph.demo.vllm_demo", "--out-dir", f"{self.k.out}/demo"]
        rcs = []
        with open(os.path.join(self.k.out, "demo.log"), "w") as log:
            for argv in (demo, ["-m", "vllm_specgraph.selfcheck"]):
                proc = self.launch(0, argv, self.left(), None)
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                rcs.append(proc.wait())
        return 1 if rcs[1] else rcs[0]


def remove_stale_rounds(k: SimpleNamespace) -> None:
    """The load summary pools every round it finds in OUT: remove the rounds an earlier
    invocation left under the names of this one's runs."""
    runs = itertools.product(k.graphs, k.sizes, k.cases, k.plugin)
    heads = "|".join(re.escape(stem(s, c, p, g) + "-load-r") for g, s, c, p in runs)
    stale = re.compile(rf"({heads})[0-9]+{re.escape(k.tp_suffix)}\.(json|log)")
    for name in filter(stale.fullmatch, os.listdir(k.out)):
        os.remove(os.path.join(k.out, name))


def compare_serve_runs(k: SimpleNamespace) -> int:
    """summarize.py --serve on each (graph mode, size, case)'s off and on runs; results
    under $OUT/serve/SIZE-CASE-GRAPHS/."""
    failed = 0
    for graphs, size, case in itertools.product(k.graphs, k.sizes, k.cases):
        pair = [f"{k.out}/serve/{stem(size, case, p, graphs)}-serve.json" for p in ("off", "on")]
        results = f"{k.out}/serve/{size}-{case}-{graphs}"
        failed |= call(["python3", f"{HERE}/summarize.py", "--serve", *pair, "--results", results])
    return int(bool(failed))


# ---- what the GPU machine tells -----------------------------------------------------


def call(cmd: list[str], **kw: object) -> int:
    return subprocess.run(cmd, **kw).returncode


def smi(*query: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True)
    except OSError:
        return []
    return [line.strip() for line in out.stdout.decode().splitlines() if line.strip()]


def git(*args: str) -> str:
    """git's output in the repository; "" where git is missing (the GPU machine may lack it)."""
    with contextlib.suppress(OSError):
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout
    return ""


def commit() -> str:
    """The plugin commit every run measures: COMMIT, else the checkout's (-dirty with
    changes); the copy on the GPU machine may have no git metadata."""
    head = git("rev-parse", "--short=12", "HEAD").strip()
    return os.environ.get("COMMIT") or head + "-dirty" * bool(head and git("status", "--porcelain"))


# ---- setup: vLLM's tree, the stand-ins, the plugin ----------------------------------

FA_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n"  # vllm/vllm_flash_attn/__init__.py
FA_WARN = "    import warnings as _w  # vllm-e2e shim: no FA .so carried\n    _w.warn(\n"
NAMESPACES = "_C|_C_cache_ops|_C_cuda_utils|_C_custom_ar"
OP_REF = re.compile(rf"torch\.ops\.({NAMESPACES})\.([A-Za-z_0-9]+)")
OP_PROBE = re.compile(rf"hasattr\(\s*torch\.ops\.({NAMESPACES})\s*,\s*[\"']([A-Za-z_0-9]+)[\"']")
PIP = "python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile"
PIP += " --no-cache-dir --disable-pip-version-check --target"
STAGED = ("pyproject.toml", "LICENSE", "docs/package.md")  # what pyproject.toml names
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
    shutil.copyfile(f"{HERE}/_C_stable_libtorch.py", f"{tree}/vllm/_C_stable_libtorch.py")
    refs, probed = set(), set()
    for path in glob.glob(f"{tree}/vllm/**/*.py", recursive=True):
        with open(path, encoding="utf-8") as f:
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


def setup(k: SimpleNamespace) -> None:
    """vLLM's tree under E2E_WORK (emptied first) with the stand-ins; the carried wheels
    and the plugin installed into its site dir with pip, the plugin from a staged copy,
    so that no build/ or *.egg-info of the checkout leaks into it; then checked."""
    site, tree, src = (os.path.join(k.work, d) for d in ("site", "tree", "plugin"))
    shutil.rmtree(k.work, ignore_errors=True)
    for path in (site, tree, f"{src}/docs", f"{k.work}/cwd"):
        os.makedirs(path)
    for name in STAGED:
        shutil.copy2(f"{REPO}/{name}", f"{src}/{name}")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(f"{REPO}/vllm_specgraph", f"{src}/vllm_specgraph", ignore=ignore)
    if call([*PIP.split(), site, *sorted(glob.glob(f"{REPO}/.e2e/wheels/*.whl")), src]):
        raise refuse("pip install failed")
    try:
        with tarfile.open(os.path.join(REPO, ".e2e", "vllm-py.tar.gz")) as tar:
            tar.extractall(tree, filter="data")
    except (OSError, tarfile.TarError) as e:
        raise refuse(f"untar failed: {e}") from e
    apply_shims(tree)
    check_plugin(site, cwd=f"{k.work}/cwd")


def check_plugin(site: str, cwd: str) -> None:
    """The plugin as a run finds it (CHECK, in a fresh interpreter in the runs' empty
    working directory), and every installed .py file equal to the repository's."""
    env = os.environ | {"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"}
    checked = subprocess.run(["python3", "-c", CHECK, site], cwd=cwd, env=env)
    package, installed = f"{REPO}/vllm_specgraph", f"{site}/vllm_specgraph"
    files = sorted(glob.glob("**/*.py", root_dir=package, recursive=True))
    _, differ, missing = filecmp.cmpfiles(package, installed, files, shallow=False)
    if differ or missing:
        print(f"installed copy differs from the repository in: {differ + missing}")
    if checked.returncode or differ or missing:
        raise refuse("plugin install failed")
    print(f"{len(files)} .py files installed, identical to the repository's")


def main() -> int:
    t0 = now()
    os.environ.update(ENV)
    # Shared by every run and kept for the next invocation.
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/vllm-e2e-triton-cache")
    for key in SWITCH_ENV:
        os.environ.pop(key, None)  # run_llm.py sets them per switch
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
    os.environ["PYTHONPATH"] = f"{k.work}/tree:{k.work}/site"
    gpu = smi("--query-gpu=index,name,memory.total,memory.used,driver_version")
    print(*gpu, sep="\n", flush=True)
    with open(os.path.join(k.out, "gpu.txt"), "w") as f:
        f.write("".join(line + "\n" for line in gpu))
    device = Device(k, lanes, pins, t0)
    if k.mode == "demo":
        return device.demo()
    if k.mode == "load":
        remove_stale_rounds(k)
    device.execute(plan(k))
    if k.mode == "serve":
        return compare_serve_runs(k)
    summarize = ["python3", f"{HERE}/summarize.py", k.out, "--results", f"{k.out}/bench/results"]
    return call([*summarize, "--previous", f"{REPO}/bench/results/vllm_graph_memory.json"])


if __name__ == "__main__":
    sys.exit(main())
