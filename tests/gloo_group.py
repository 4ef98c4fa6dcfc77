"""The process group every multi-process CPU test starts: gloo over a file store."""

import datetime

import torch.distributed as dist


def init_gloo_group(rank: int, store_path: str, world_size: int, timeout_s: int = 30) -> None:
    """Join ``world_size`` spawned ranks as ``rank`` through the file at ``store_path``."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
