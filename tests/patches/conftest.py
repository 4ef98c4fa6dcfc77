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
    memory, the allocator's segments) are faked: this machine has no GPU.
    """
    import torch

    from vllm_specgraph.profile import disposable_graph_pass

    for name, fn in {
        "graph_pool_handle": lambda: (0, 1),
        "synchronize": lambda *args: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda *args: (1 << 30, 2 << 30),
        "current_device": lambda: 0,
        "memory_snapshot": lambda: [],
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    return disposable_graph_pass


@pytest.fixture
def allocator_conf(monkeypatch) -> dict:
    """PyTorch's live allocator config, as vLLM's ``alloc_conf`` reads and writes it.

    Faked: writing it needs a CUDA build of torch. ``state["conf"]`` is the live
    string, ``state["writes"]`` every string written. The environment starts with
    no allocator config; a test sets one with ``monkeypatch.setenv``.
    """
    from vllm.device_allocator import alloc_conf

    for name in alloc_conf.ALLOC_CONF_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    state: dict = {"conf": "", "writes": []}

    def set_alloc_conf(conf: str) -> None:
        state["conf"] = conf
        state["writes"].append(conf)

    monkeypatch.setattr(alloc_conf, "set_alloc_conf", set_alloc_conf)
    monkeypatch.setattr(
        alloc_conf, "current_alloc_conf", lambda: state["conf"] or alloc_conf.alloc_conf_from_env()
    )
    state["expandable"] = lambda: alloc_conf.conf_flag_enabled(
        state["conf"] or alloc_conf.alloc_conf_from_env(), alloc_conf.EXPANDABLE_SEGMENTS
    )
    return state
