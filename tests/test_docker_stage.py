"""The Docker image's test stage, replayed on this machine: its files, the package installed.

The stage's ``COPY`` lines are read from ``docker/Dockerfile`` and replayed into an
empty directory; the package is importable from elsewhere only, as from the
image's site-packages. The whole suite must collect there, and the tests that
read files of the source tree must pass there. (The image itself, on vLLM's
0.33.0 serving image, is not built here: that needs a Docker daemon.)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_TREE_TESTS = (
    "tests/test_e2e_run_llm.py",
    "tests/test_e2e_summarize.py",
    "tests/test_e2e_device.py",
    "tests/test_vllm_demo.py",
    "tests/test_readme_results.py",
)


def stage_copies(dockerfile: str, stage: str) -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of every ``COPY`` in ``stage`` of ``dockerfile``."""
    copies, current = [], None
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["FROM"]:
            current = words[-1] if "AS" in words else None
        elif words[:1] == ["COPY"] and current == stage:
            copies.append((words[1:-1], words[-1]))
    return copies


def replay(copies: list[tuple[list[str], str]], workdir: Path) -> None:
    for sources, destination in copies:
        for source in sources:
            src = ROOT / source
            dst = workdir / destination
            if destination.endswith("/") or len(sources) > 1:
                dst = dst / src.name
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)


def test_stage_copies_are_read_from_the_dockerfile():
    copies = stage_copies((ROOT / "docker" / "Dockerfile").read_text(), "test")
    assert (["tests"], "./tests") in copies
    assert not any("vllm_specgraph" in s for sources, _ in copies for s in sources)


def test_plugin_stage_copies_what_the_package_build_reads():
    """pip builds the package from the plugin stage's copy: its readme must be there."""
    import tomllib

    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    copies = stage_copies((ROOT / "docker" / "Dockerfile").read_text(), "plugin")
    copied = {s for sources, _ in copies for s in sources}
    assert {"pyproject.toml", "LICENSE", "vllm_specgraph", readme} <= copied, copied


@pytest.mark.vllm
def test_test_stage_layout_collects_and_runs_the_source_tree_tests(tmp_path):
    workdir, site = tmp_path / "work", tmp_path / "site"
    workdir.mkdir()
    replay(stage_copies((ROOT / "docker" / "Dockerfile").read_text(), "test"), workdir)
    shutil.copytree(ROOT / "vllm_specgraph", site / "vllm_specgraph")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run(
        [*pytest_cmd, "--collect-only"], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    ran = subprocess.run(
        [*pytest_cmd, *SOURCE_TREE_TESTS], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
