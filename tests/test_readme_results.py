"""The README's results are the files under bench/results, as generated."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "readme_results", ROOT / "bench" / "readme_results.py"
)
readme_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_results)


def test_readme_results_block_is_what_bench_results_hold():
    readme = (ROOT / "README.md").read_text()
    assert readme_results.with_block(readme, readme_results.block()) == readme, (
        "README.md's results differ from bench/results: run python3 bench/readme_results.py"
    )


def test_a_changed_figure_in_bench_results_changes_the_block(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    memory = json.loads((results / "vllm_graph_memory.json").read_text())
    shown = next(r for r in memory["rows"] if not r["size"].startswith("tiny"))
    shown["plugin_estimate_bytes"] += 5 << 20
    (results / "vllm_graph_memory.json").write_text(json.dumps(memory))
    assert readme_results.block(results) != readme_results.block()


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="no results block"):
        readme_results.with_block("# a README\n", readme_results.block())
