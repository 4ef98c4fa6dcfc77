"""The caching allocator's segment mode while the plugin measures and captures graphs.

PyTorch's caching allocator, as it comes, serves a request from the smallest
free block that fits and breaks ties between equal blocks by address; new
segments come from ``cudaMalloc`` wherever the driver puts them. The addresses
differ once the KV cache exists, so the profile (before it) and the production
capture (after it) can pack the same requests into different segments, one
segment apart (20 MiB on a 1B model). With expandable segments each pool grows
one segment per stream, so where a block lands follows the order of the
requests alone, and the profile's bytes are production's.

So the plugin turns expandable segments on for each ``capture_model`` call it
measures, profile and production alike, and puts the user's setting back
after. It leaves the setting alone where it may not change it: the user's
allocator config names ``expandable_segments`` (either way), graphs go to the
sleep-mode cuMem pool (a pluggable allocator's pool, which expandable segments
do not support), or a custom all-reduce registers captured buffers by CUDA IPC
(``cudaIpcGetMemHandle`` refuses memory that expandable segments map).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["expandable_segments_blocker", "expandable_segments_for_capture"]

_GROUPS = ("_TP", "_PP", "_DCP", "_DP", "_EP")


def expandable_segments_blocker(vllm_config: Any) -> str | None:
    """Why graph capture keeps the allocator's segment mode, or None if it may change it."""
    from vllm.device_allocator import alloc_conf

    user_conf = alloc_conf.alloc_conf_from_env()
    if any(
        f.partition(":")[0].strip() == alloc_conf.EXPANDABLE_SEGMENTS for f in user_conf.split(",")
    ):
        return f"the allocator config {user_conf!r} sets expandable_segments"
    if vllm_config.use_cumem_cudagraph_pool:
        return "graphs go to the sleep-mode cuMem pool, which expandable segments do not support"
    group = _group_registering_by_ipc()
    if group is not None:
        return (
            f"the {group} group's custom all-reduce registers captured buffers by CUDA IPC, "
            "which refuses memory that expandable segments map"
        )
    return None


@contextmanager
def expandable_segments_for_capture(vllm_config: Any) -> Iterator[bool]:
    """Run the block with expandable segments on, unless :func:`expandable_segments_blocker`
    says no; yields whether they are on in the block.

    *Requires*: no capture is active (a segment made under one mode stays in that
    mode; switching mid-capture would split a pool's blocks between both).
    *Guarantees*, on success and on error: the allocator config is what it was,
    every other option included, with ``expandable_segments`` written out even
    where it was unset.
    """
    from vllm.device_allocator import alloc_conf

    conf = alloc_conf.current_alloc_conf()
    was_on = alloc_conf.conf_flag_enabled(conf, alloc_conf.EXPANDABLE_SEGMENTS)
    if expandable_segments_blocker(vllm_config) is not None:
        yield was_on
        return
    alloc_conf.set_alloc_conf(alloc_conf.with_conf_flag(conf, alloc_conf.EXPANDABLE_SEGMENTS, True))
    try:
        yield True
    finally:
        # Torch resets every option a config string leaves out; an empty string may
        # leave the flag as it is, so write it out.
        alloc_conf.set_alloc_conf(
            alloc_conf.with_conf_flag(conf, alloc_conf.EXPANDABLE_SEGMENTS, was_on)
        )


def _group_registering_by_ipc() -> str | None:
    """The first parallel group whose custom all-reduce IPC-registers graph buffers."""
    from vllm.distributed import parallel_state

    for name in _GROUPS:
        communicator = getattr(getattr(parallel_state, name, None), "device_communicator", None)
        custom = getattr(communicator, "ca_comm", None)
        if custom is not None and not custom.disabled and custom._capture_registered:
            return name.lstrip("_")
    return None
