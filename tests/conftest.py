"""Skip tests whose hardware or packages are missing, with the reason stated; shared fakes."""

import importlib.util
import weakref

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


class FakeSymmMem:
    """Records what the faked symmetric-memory calls made; ``fail_rendezvous`` makes them fail."""

    def __init__(self) -> None:
        self.buffers: list[weakref.ref] = []  # each channel buffer "allocated"
        self.handles: list[weakref.ref] = []  # each rendezvous handle
        self.fail_rendezvous = False


class _FakeHandle:
    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer_ptr = buffer.data_ptr()
        self.group_name = group_name


@pytest.fixture
def fake_symm_mem(monkeypatch: pytest.MonkeyPatch) -> FakeSymmMem:
    """Fakes what needs GPUs in vllm_specgraph.symm_mem_channel: torch's symmetric-memory
    allocation (CPU bytes instead) and rendezvous (a handle that only records the buffer and
    the group); the factory's own code runs as is."""
    from vllm_specgraph import symm_mem_channel

    made = FakeSymmMem()

    def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
        assert device.type == "cuda", device
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        made.buffers.append(weakref.ref(buffer))
        return buffer

    def rendezvous(buffer: torch.Tensor, group_name: str) -> _FakeHandle:
        if made.fail_rendezvous:
            raise RuntimeError("rendezvous failed on purpose")
        handle = _FakeHandle(buffer, group_name)
        made.handles.append(weakref.ref(handle))
        return handle

    monkeypatch.setattr(symm_mem_channel, "_allocate", allocate)
    monkeypatch.setattr(symm_mem_channel, "_rendezvous", rendezvous)
    return made
