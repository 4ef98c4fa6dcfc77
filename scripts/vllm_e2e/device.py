# SPDX-License-Identifier: Apache-2.0
"""The end-to-end harness on the GPU machine (``scripts/device-vllm-e2e.sh``, knobs in
docs/vllm-e2e.md): install vLLM's tree and the plugin, run the plan, summarize."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESERVE, MIN_RUN = 25, 30  # seconds kept for the summary; the shortest run worth starting
CHOICES = {  # knob: the values it may list
    "SIZES": "tiny 1b 8b",
    "CASES": "base draft accept ngram eagle",
    "GRAPHS": "full compile",
    "PLUGIN": "off on none once",
}
MODES = {  # MODE: the CHOICES knobs' defaults
    "bench": ("tiny", "base draft ngram eagle", "compile", "off on"),
    "load": ("1b", "base draft accept", "compile", "off on"),
    "demo": ("tiny", "draft", "compile", "on"),
    "serve": ("1b", "draft", "compile", "off on"),
}
COUNTS = {"TP": 1, "LOAD_CORES": 8, "LOAD_ROUNDS": 2, "LOAD_REQUESTS": 256, "LOAD_REPEATS": 2}
SECONDS = {"BUDGET": 570, "T_tiny": 90, "T_1b": 150, "T_8b": 300}
SECONDS |= {"T_FIRST_EXTRA": 60, "T_LOAD_EXTRA": 60, "T_TP_EXTRA": 30}
REPORTED = re.compile("Error|Traceback|graph|KV cache|Model loading|Using|Triton", re.IGNORECASE)
ENV = {  # every process's, vLLM's workers at TP > 1 included (run_llm.py sets the switch's)
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # CUDA_VISIBLE_DEVICES counts GPUs as nvidia-smi does
    "NCCL_NVLS_ENABLE": "0",  # NVLink multicast off, in NCCL, torch and NVSHMEM
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONHASHSEED": "0",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",  # else xgrammar's tvm-ffi JIT-builds a torch addon
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # MRV2's sampler imports flashinfer unguarded otherwise
}
ENV |= dict.fromkeys(("PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"), "1")
ENV |= dict.fromkeys(("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"), "1")
Run = namedtuple("Run", "name size script args out")  # out: the JSON it writes (``--out``)


def now() -> int:
    return int(time.time())


def refuse(message: str) -> SystemExit:
    print(message, flush=True)
    return SystemExit(2)


def knobs(env: dict[str, str]) -> SimpleNamespace:
    """The knobs from ``env``, each as an attribute named in lower case, and the GPUs and
    the core pin; a bad knob exits 2 and names itself, its value and what it may be."""
    mode = env.get("MODE") or "bench"
    if mode not in MODES:
        raise refuse(f"unknown MODE '{mode}' ({', '.join(MODES)})")
    k = SimpleNamespace(mode=mode, custom_ar=env.get("CUSTOM_AR") == "1")
    for (knob, allowed), default in zip(CHOICES.items(), MODES[mode], strict=True):
        values = (env.get(knob) or default).split()
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
    cache = env.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")
    k.markers = os.path.join(cache, "specgraph-e2e-compiled")  # the warm-ups'
    k.tp_suffix = f"-tp{k.tp}" * (k.tp > 1)  # the end of a run's name and of its table group
    k.tp_args = ["--tp", str(k.tp), *["--custom-all-reduce"] * k.custom_ar] * (k.tp > 1)
    listed = env.get("GPUS") or env.get("CUDA_VISIBLE_DEVICES", "").replace(",", " ")
    ids = (listed or " ".join(smi("--query-gpu=index")) or "0").split()
    if len(ids) < k.tp:
        raise refuse(f"TP={k.tp} needs {k.tp} GPUs, found {len(ids)}: '{' '.join(ids)}'")
    k.gpus = ",".join(ids[: k.tp])
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[: k.load_cores]))
    k.pin = ["taskset", "-c", cores] if mode == "load" and shutil.which("taskset") else []
    k.t0 = now()
    return k


def stem(size: str, case: str, plugin: str, graphs: str) -> str:
    return f"{size}-{case}-{plugin}" + "-compile" * (graphs == "compile")


def make_run(k: SimpleNamespace, graphs: str, size: str, case: str, plugin: str, n: int) -> Run:
    """serve.py in MODE=serve, else run_llm.py: the smoke generate, or load round ``n``."""
    name = stem(size, case, plugin, graphs)
    args = ["--size", size, "--case", case, "--plugin", plugin, "--graph-mode", graphs]
    if k.mode == "serve":
        out = f"{k.out}/serve/{name}-serve.json"
        return Run(f"{name}-serve", size, f"{HERE}/serve.py", args, out)
    args += ["--workload", "load" if n else "smoke"]
    if n:
        name += "-load" + f"-r{n}" * (n > 1)
        args += ["--load-requests", str(k.load_requests), "--load-repeats", str(k.load_repeats)]
        args += ["--load-round", str(n)]
    name += k.tp_suffix
    return Run(name, size, f"{HERE}/run_llm.py", [*args, *k.tp_args], f"{k.out}/{name}.json")


def plan(k: SimpleNamespace) -> list[Run]:
    """Per (graph mode, size, case) each switch in turn (load: LOAD_ROUNDS rounds, every other
    one reversed), after a warm-up without the plugin unless its marker says one ran here: it
    pays the JIT compiles (a first compile with an empty cache gave other greedy tokens)."""
    runs = []
    for graphs, size, case in itertools.product(k.graphs, k.sizes, k.cases):
        key = f"{size}-{case}-{graphs}{k.tp_suffix}"
        if not os.path.exists(os.path.join(k.markers, key)):
            args = ["--size", size, "--case", case, "--plugin", "none", "--graph-mode", graphs]
            out = f"{k.work}/warmup-{key}.json"
            runs.append(Run(f"warmup-{key}", size, f"{HERE}/run_llm.py", [*args, *k.tp_args], out))
        for n in range(1, k.load_rounds + 1) if k.mode == "load" else [0]:
            switches = k.plugin[::-1] if n % 2 == 0 < n else k.plugin
            runs += [make_run(k, graphs, size, case, plugin, n) for plugin in switches]
    return runs


def execute(k: SimpleNamespace, runs: list[Run]) -> None:
    """The runs in turn. A run's limit: its size's T_, plus T_LOAD_EXTRA in load mode
    (T_FIRST_EXTRA for a warm-up) and T_TP_EXTRA at TP > 1, cut to what is left of BUDGET
    (a serve run gets all: only serve.py can stop its server); under MIN_RUN s: skipped."""
    skipped = []
    for run in runs:
        warm_up, log = run.name.startswith("warmup-"), os.path.join(k.out, run.name + ".log")
        for path in (run.out, log):
            Path(path).unlink(missing_ok=True)
        left = k.budget - (now() - k.t0) - RESERVE
        extra = k.t_first_extra if warm_up else k.t_load_extra * (k.mode == "load")
        limit = min(getattr(k, f"t_{run.size}") + extra + k.t_tp_extra * (k.tp > 1), left)
        limit = left if k.mode == "serve" and not warm_up else limit
        if limit < MIN_RUN:
            print(f"---------------- {run.name}: skipped, {left} s left of BUDGET")
            if not warm_up:
                skipped.append(run.name)
            continue
        t1 = now()
        print(f"---------------- {run.name} on GPU {k.gpus} (limit {limit} s) " + "-" * 16)
        proc = launch(k, [run.script, *run.args, "--out", run.out], limit, log)
        rc = proc.wait()
        if k.tp > 1:  # vLLM's workers may outlive the run: kill them, wait for free GPUs
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for _ in range(20):
                if not smi("-i", k.gpus, "--query-compute-apps=pid"):
                    break
                time.sleep(1)
        if warm_up and rc == 0:
            os.makedirs(k.markers, exist_ok=True)
            Path(k.markers, run.name.removeprefix("warmup-")).touch()
        lines = Path(log).read_text(errors="replace").splitlines()
        shown = [line[:300] for line in lines if REPORTED.search(line)][-24:]
        done = f"{run.name} rc={rc} elapsed={now() - t1} s ({now() - k.t0} s since start)"
        print(done, *shown, sep="\n", flush=True)
    Path(k.out, "skipped.txt").write_text("".join(name + "\n" for name in skipped))


def launch(k: SimpleNamespace, argv: list[str], limit: int, log: str | None) -> subprocess.Popen:
    """``python3 ARGV`` under ``timeout``, which signals its own process group (vLLM's
    workers too) at the limit, output into ``log`` (else a pipe), in an empty directory:
    ``python -m`` puts it first on sys.path, where the checkout would shadow the plugin."""
    cmd = [*k.pin, "timeout", "-k", "10", str(limit), "python3", *argv]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": k.gpus}
    with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
        kw = {"stdout": out, "stderr": subprocess.STDOUT, "text": True}
        return subprocess.Popen(cmd, cwd=f"{k.work}/cwd", env=env, **kw)


def demo(k: SimpleNamespace) -> int:
    """The vLLM demo, then the lane self-check, printed and into $OUT/demo.log; the
    demo's exit status, or 1 where the self-check failed."""
    vllm_demo = ["-m", "vllm_specgraph.demo.vllm_demo", "--out-dir", f"{k.out}/demo"]
    rcs = []
    with open(os.path.join(k.out, "demo.log"), "w") as log:
        for argv in (vllm_demo, ["-m", "vllm_specgraph.selfcheck"]):
            proc = launch(k, argv, k.budget - (now() - k.t0) - RESERVE, None)
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rcs.append(proc.wait())
    return 1 if rcs[1] else rcs[0]


def remove_stale_rounds(k: SimpleNamespace) -> None:
    """Remove the load rounds of this plan's runs left by earlier invocations (all are pooled)."""
    runs = itertools.product(k.graphs, k.sizes, k.cases, k.plugin)
    heads = "|".join(re.escape(stem(s, c, p, g) + "-load-r") for g, s, c, p in runs)
    stale = re.compile(rf"({heads})[0-9]+{re.escape(k.tp_suffix)}\.(json|log)")
    for name in filter(stale.fullmatch, os.listdir(k.out)):
        os.remove(os.path.join(k.out, name))


def compare_serve_runs(k: SimpleNamespace) -> int:
    """summarize.py --serve on each (graph mode, size, case)'s off and on runs; 1 if any failed."""
    failed = 0
    for graphs, size, case in itertools.product(k.graphs, k.sizes, k.cases):
        pair = [f"{k.out}/serve/{stem(size, case, p, graphs)}-serve.json" for p in ("off", "on")]
        results = ["--results", f"{k.out}/serve/{size}-{case}-{graphs}"]
        failed |= subprocess.call(["python3", f"{HERE}/summarize.py", "--serve", *pair, *results])
    return int(bool(failed))


def smi(*query: str) -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True)
    except OSError:
        return []
    return [line.strip() for line in out.stdout.decode().splitlines() if line.strip()]


def commit() -> str:
    """The commit the runs measure: COMMIT, else HEAD (-dirty with changes); "" without git."""
    git = "git rev-parse --short=12 HEAD && git status --porcelain"
    out = subprocess.run(git, shell=True, cwd=REPO, capture_output=True, text=True).stdout
    head, *changes = out.splitlines() or [""]
    return os.environ.get("COMMIT") or head + "-dirty" * bool(changes)


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
(ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "specgraph"]
origin = find_spec(ep.module).origin
assert origin.startswith(sys.argv[1]), f"{ep.module} would be imported from {origin}"
print(f"entry point {ep.value} ({ep.dist.version}) -> {origin}")
"""  # found, not imported: the package may import vLLM, which this interpreter lacks


def apply_shims(tree: str) -> None:
    """The stand-in for vllm._C_stable_libtorch with the torch.ops names vLLM refers to
    unprobed (defining a probed one flips a guard); the FA guard made a warning, once."""
    shutil.copyfile(f"{HERE}/_C_stable_libtorch.py", f"{tree}/vllm/_C_stable_libtorch.py")
    refs, probed = set(), set()
    for path in glob.glob(f"{tree}/vllm/**/*.py", recursive=True):
        text = Path(path).read_text(encoding="utf-8")
        refs.update(OP_REF.findall(text))
        probed.update(OP_PROBE.findall(text))
    names = sorted(f"{ns}::{name}" for ns, name in refs - probed)
    Path(f"{tree}/vllm/_C_stable_libtorch_placeholders.txt").write_text("\n".join(names) + "\n")
    print(f"placeholders: {len(names)} op names referenced without a hasattr probe")
    text = (guard := Path(f"{tree}/vllm/vllm_flash_attn/__init__.py")).read_text()
    old = FA_GUARD + "    raise ImportError(\n"
    if (n := text.count(old)) != 1:
        raise refuse(f"{guard}: expected 1 match, found {n}")
    guard.write_text(text.replace(old, FA_GUARD + FA_WARN))  # the Triton backend is selected


def setup(k: SimpleNamespace) -> None:
    """OUT, and vLLM's tree under E2E_WORK (emptied first) with the stand-ins; the wheels and
    a staged copy of the plugin (no build/ or *.egg-info) installed into its site dir, then
    checked as a run finds it: in a fresh interpreter in the runs' empty directory."""
    site, tree, src = (os.path.join(k.work, d) for d in ("site", "tree", "plugin"))
    shutil.rmtree(k.work, ignore_errors=True)
    for path in (site, tree, f"{src}/docs", f"{k.work}/cwd", k.out):
        os.makedirs(path, exist_ok=True)
    for name in STAGED:
        shutil.copy2(f"{REPO}/{name}", f"{src}/{name}")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(f"{REPO}/vllm_specgraph", f"{src}/vllm_specgraph", ignore=ignore)
    if subprocess.call([*PIP.split(), site, *sorted(glob.glob(f"{REPO}/.e2e/wheels/*.whl")), src]):
        raise refuse("pip install failed")
    with tarfile.open(os.path.join(REPO, ".e2e", "vllm-py.tar.gz")) as tar:
        tar.extractall(tree, filter="data")
    apply_shims(tree)
    env = os.environ | {"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"}
    if subprocess.call(["python3", "-c", CHECK, site], cwd=f"{k.work}/cwd", env=env):
        raise refuse("plugin install failed")


def main() -> int:
    os.environ.update(ENV)
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/vllm-e2e-triton-cache")  # kept for later
    k = knobs(dict(os.environ))
    os.environ["SPECGRAPH_COMMIT"] = sha = commit()
    print(f"mode {k.mode}; CUDA_VISIBLE_DEVICES={k.gpus}; pinned to: {k.pin[2] if k.pin else '-'}")
    setup(k)
    print(f"setup took {now() - k.t0} s; commit {sha or '- (none: set COMMIT)'}", flush=True)
    os.environ["PYTHONPATH"] = f"{k.work}/tree:{k.work}/site"
    print(*smi("--query-gpu=index,name,memory.total,memory.used,driver_version"), sep="\n")
    if k.mode == "demo":
        return demo(k)
    if k.mode == "load":
        remove_stale_rounds(k)
    execute(k, plan(k))
    if k.mode == "serve":
        return compare_serve_runs(k)
    previous = f"{REPO}/bench/results/vllm_graph_memory.json"
    summarize = [f"{HERE}/summarize.py", k.out, "--results", f"{k.out}/bench/results"]
    return subprocess.call(["python3", *summarize, "--previous", previous])


if __name__ == "__main__":
    sys.exit(main())
