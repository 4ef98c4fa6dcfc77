"""Expandable segments around graph capture, through vLLM 0.33.0's own ``alloc_conf``.

Writing torch's allocator config needs a CUDA build, so the write is faked
(``allocator_conf``); reading and editing the config string is vLLM's.
"""

import inspect
from types import SimpleNamespace

import pytest

from vllm_specgraph.patches._capture_allocator import (
    expandable_segments_blocker,
    expandable_segments_for_capture,
)

pytestmark = pytest.mark.vllm

CONFIG = SimpleNamespace(use_cumem_cudagraph_pool=False)


def test_capture_turns_expandable_segments_on_and_puts_every_other_option_back(
    allocator_conf, monkeypatch
):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with expandable_segments_for_capture(CONFIG) as expandable:
        assert expandable and allocator_conf["expandable"]()
    assert allocator_conf["writes"] == [
        "max_split_size_mb:512,expandable_segments:True",
        "max_split_size_mb:512,expandable_segments:False",
    ]


def test_capture_error_puts_the_setting_back_and_propagates(allocator_conf):
    with pytest.raises(KeyError, match="capture failed"), expandable_segments_for_capture(CONFIG):
        raise KeyError("capture failed")
    assert allocator_conf["writes"][-1] == "expandable_segments:False"
    assert not allocator_conf["expandable"]()


@pytest.mark.parametrize("user_conf", ["expandable_segments:True", "expandable_segments:False"])
def test_capture_leaves_a_setting_the_user_made(allocator_conf, monkeypatch, user_conf):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", user_conf)
    with expandable_segments_for_capture(CONFIG) as expandable:
        assert expandable == user_conf.endswith("True")
    assert allocator_conf["writes"] == []
    assert user_conf in expandable_segments_blocker(CONFIG)


def test_capture_leaves_the_setting_when_graphs_go_to_the_sleep_mode_pool(allocator_conf):
    config = SimpleNamespace(use_cumem_cudagraph_pool=True)
    with expandable_segments_for_capture(config) as expandable:
        assert not expandable
    assert allocator_conf["writes"] == []
    assert "cuMem pool" in expandable_segments_blocker(config)


@pytest.mark.parametrize(
    ("disabled", "registers", "blocked"),
    [(False, True, True), (True, True, False), (False, False, False)],
)
def test_capture_leaves_the_setting_while_a_custom_all_reduce_registers_by_ipc(
    allocator_conf, monkeypatch, disabled, registers, blocked
):
    """The communicator is faked (it needs several GPUs); the group name is vLLM's."""
    from vllm.distributed import parallel_state

    custom = SimpleNamespace(disabled=disabled, _capture_registered=registers)
    group = SimpleNamespace(device_communicator=SimpleNamespace(ca_comm=custom))
    monkeypatch.setattr(parallel_state, "_PP", group)
    with expandable_segments_for_capture(CONFIG) as expandable:
        assert expandable != blocked
    assert (allocator_conf["writes"] == []) == blocked
    assert (expandable_segments_blocker(CONFIG) is not None) == blocked


def test_the_vllm_names_the_blocker_reads_exist():
    from vllm.config import VllmConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    assert isinstance(VllmConfig.use_cumem_cudagraph_pool, property)
    assert "self._capture_registered = register_graph_buffers" in inspect.getsource(
        CustomAllreduce.__init__
    )
    assert hasattr(parallel_state, "_TP") and hasattr(parallel_state, "_PP")
