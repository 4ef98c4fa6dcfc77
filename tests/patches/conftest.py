"""Fixtures for the patch tests.

``install_patch`` installs one patch module onto the real vLLM 0.33.0 module for a
test and undoes it after; ``disposable_pass`` is the core's disposable pass.
"""

import importlib
from collections.abc import Callable

import pytest

from vllm_specgraph.patches._patching import PatchSet

pytestmark = pytest.mark.vllm


@pytest.fixture
def install_patch() -> Callable[[str], object]:
    """``install_patch("vllm.v1.worker.workspace")`` -> the patched vLLM module."""
    patches = PatchSet()

    def install(vllm_module: str) -> object:
        module = importlib.import_module(vllm_module)
        patch = importlib.import_module(
            "vllm_specgraph.patches." + vllm_module.removeprefix("vllm.")
        )
        patch.install(patches, module)
        return module

    yield install
    patches.undo()


@pytest.fixture
def disposable_pass(monkeypatch) -> Callable[[], object]:
    """The core's ``disposable_graph_pass``, as the profile patch enters it.

    The CUDA calls the pass makes (pool handle, synchronise, cache release, free
    memory) are faked: this machine has no GPU.
    """
    import torch

    from vllm_specgraph.profile import disposable_graph_pass

    for name, fn in {
        "graph_pool_handle": lambda: (0, 1),
        "synchronize": lambda *args: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda *args: (1 << 30, 2 << 30),
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return disposable_graph_pass
