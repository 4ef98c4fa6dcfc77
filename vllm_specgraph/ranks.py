"""Decisions every rank of a group takes alike.

A rank that decides from its own readings (free memory, say) may decide
otherwise than its peers; if the branch it takes runs collectives (warm-up
all-reduces, a channel's rendezvous, barriers), ranks that disagree wait for
each other for good. :func:`on_any_rank` makes one decision of them first.

Torch only: this module never imports vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["on_any_rank"]


def on_any_rank(flag: bool, group: Any | None) -> bool:
    """Whether ``flag`` holds on at least one rank of ``group``; the same on every rank.

    ``group`` is a CPU (gloo) process group, or None for a process alone; a group
    of one rank asks nobody. Collective over ``group``: every rank must call it,
    in the same order as its other collectives. Not legal during capture.
    """
    # By truth, a count or a one-element tensor would pass as a flag unseen.
    numpy_bool = type(flag).__module__ == "numpy" and type(flag).__name__ in ("bool", "bool_")
    if not (isinstance(flag, bool) or numpy_bool):
        raise TypeError(
            f"flag must be a bool, got {flag!r} ({type(flag).__name__}); pass this rank's "
            "yes or no, e.g. bytes_left > threshold"
        )
    if group is None or dist.get_world_size(group) == 1:
        return bool(flag)
    vote = torch.tensor([int(bool(flag))])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())
