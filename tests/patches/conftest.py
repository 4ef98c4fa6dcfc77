"""Install one patch module onto the real vLLM 0.33.0 module for a test, and undo it after."""

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
