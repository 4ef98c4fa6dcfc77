"""The wheel as pip builds it: its entry point, its description, its vLLM requirement."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_metadata(tmp_path_factory) -> tuple[str, str, list[str]]:
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-w", str(out), str(ROOT)], check=True, cwd=out)
    (wheel,) = out.glob("vllm_specgraph-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    return metadata, entry_points, names


def test_wheel_registers_the_vllm_plugin_entry_point(wheel_metadata):
    _, entry_points, _ = wheel_metadata
    assert "[vllm.general_plugins]" in entry_points
    assert "specgraph = vllm_specgraph:register" in entry_points


def test_wheel_description_has_no_links_into_the_source_tree(wheel_metadata):
    metadata, _, _ = wheel_metadata
    description = metadata.split("\n\n", 1)[1]
    assert "vllm-specgraph" in description and "VLLM_SPECGRAPH=0" in description
    targets = re.findall(r"\]\(([^)]+)\)", description)
    assert all(t.startswith(("http://", "https://")) for t in targets), targets


def test_wheel_leaves_vllm_to_the_user_and_pins_it_as_an_extra(wheel_metadata):
    metadata, _, _ = wheel_metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(line.startswith("Requires-Dist: torch") for line in requires)
    vllm = [line for line in requires if "vllm" in line]
    assert vllm and all('extra == "vllm"' in line for line in vllm), vllm


def test_wheel_carries_the_demo_models_so_the_demo_runs_from_an_install(wheel_metadata):
    _, _, names = wheel_metadata
    for model in ("tiny-llama", "tiny-llama-draft"):
        assert f"vllm_specgraph/demo/configs/{model}/config.json" in names
