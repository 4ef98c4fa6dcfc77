"""Skip tests whose hardware or packages are missing, with the reason stated."""

import importlib.util

import pytest
import torch


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM 0.33.0 is not installed (make test installs it)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    num_gpus = torch.cuda.device_count() if cuda else 0
    reasons = {
        "gpu": None if cuda else "needs a CUDA GPU; run scripts/gpu-tests.sh on one",
        "multigpu": None if num_gpus >= 2 else f"needs 2+ CUDA GPUs, found {num_gpus}",
        "vllm": _vllm_missing(),
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
                break
