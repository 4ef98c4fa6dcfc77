"""Latency of the core's peer-to-peer all-reduce vs NCCL on two GPUs, eager and graph-replayed.

Two ranks (spawned, one GPU each, NVLink multicast off), bf16 inputs of 1 KiB to 8 MiB
(powers of 2), microseconds per call, the slower rank's:
  * core:     PeerAllReduce with its default config (one-shot, two-shot or NCCL by size);
  * one-shot, two-shot: PeerAllReduce with that kernel forced, on an 8 MiB channel;
  * NCCL:     torch.distributed.all_reduce in place (no copy).
Eager: CUDA events around back-to-back calls, so host launch cost counts where it exceeds
the GPU time. Graph: one graph of back-to-back calls per size and variant, replayed. Each
variant is timed 7 times, in turn with the others, and the median is reported. Every
variant's sum is first checked bit for bit against NCCL's. Throwaway channels are rolled
back after each size. Writes bench/results/allreduce.{json,md}, allreduce.png when
matplotlib is importable (else: python bench/plot_allreduce.py), and prints one summary line.

    python bench/allreduce.py
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_specgraph.allreduce import Algorithm, AllReduceConfig, PeerAllReduce
from vllm_specgraph.channels import checkpoint_channel_pools, rollback_channel_pools

RESULTS = Path(__file__).parent / "results"
WORLD_SIZE = 2
DTYPE = torch.bfloat16
SIZES = [1 << k for k in range(10, 24)]  # 1 KiB .. 8 MiB
WIDE_CHANNEL_BYTES = 8 << 20  # holds every size, so the forced kernels run at all of them
VARIANTS = ("core", "one_shot", "two_shot", "nccl")
EAGER_WARMUP, EAGER_CALLS = 20, 200
GRAPH_CALLS, GRAPH_REPLAYS = 16, 20
TRIALS = 7  # per variant, taken in turn with the other variants; the median is reported


def _per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def _variants(core: PeerAllReduce, wide: PeerAllReduce, x: torch.Tensor, out: torch.Tensor):
    """Each variant's call, and the channel pool its graph captures under (None: none)."""
    return {
        "core": (lambda: core.all_reduce(x, out=out), core.channel_pool),
        "one_shot": (
            lambda: wide.all_reduce(x, out=out, algorithm=Algorithm.ONE_SHOT),
            wide.channel_pool,
        ),
        "two_shot": (
            lambda: wide.all_reduce(x, out=out, algorithm=Algorithm.TWO_SHOT),
            wide.channel_pool,
        ),
        "nccl": (lambda: dist.all_reduce(out), None),
    }


def _equal_to_nccl(core: PeerAllReduce, wide: PeerAllReduce, x: torch.Tensor) -> bool:
    ref = x.clone()
    dist.all_reduce(ref)
    sums = [
        core.all_reduce(x),
        wide.all_reduce(x, algorithm=Algorithm.ONE_SHOT),
        wide.all_reduce(x, algorithm=Algorithm.TWO_SHOT),
    ]
    return all(torch.equal(y, ref) for y in sums)


def _capture(fn, channel_pool, owner: str) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    binding = nullcontext() if channel_pool is None else channel_pool.capture(owner=owner)
    with binding, torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()  # warm
    return graph


def _median_per_call_us(timed: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each variant timed TRIALS times, the variants in turn, so that a slow spell of the
    machine lands on all of them rather than on one; the median trial of each."""
    trials: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(TRIALS):
        for name, time_once in timed.items():
            trials[name].append(time_once())
    return {name: statistics.median(us) for name, us in trials.items()}


def _measure_size(core: PeerAllReduce, wide: PeerAllReduce, nbytes: int, rank: int) -> dict:
    device = core.device
    gen = torch.Generator(device=device).manual_seed(rank * 1000 + nbytes)
    numel = nbytes // DTYPE.itemsize
    checked = torch.randn(numel, device=device, generator=gen).to(DTYPE)
    row = {"bytes": nbytes, "core_picks": core.select(checked).value}
    row["equal_to_nccl"] = _equal_to_nccl(core, wide, checked)
    # Zeros sum to zeros: repeated in-place calls never overflow, and the timing is the same.
    x = torch.zeros(numel, dtype=DTYPE, device=device)
    out = torch.zeros_like(x)
    variants = _variants(core, wide, x, out)
    for fn, _ in variants.values():
        for _ in range(EAGER_WARMUP):
            fn()
    row["eager_us"] = _median_per_call_us(
        {
            name: functools.partial(_per_call_us, fn, EAGER_CALLS, device)
            for name, (fn, _) in variants.items()
        }
    )
    cp = checkpoint_channel_pools([core.channel_pool, wide.channel_pool])
    graphs = {
        name: _capture(fn, channel_pool, f"bench-{name}")
        for name, (fn, channel_pool) in variants.items()
    }
    row["graph_us"] = _median_per_call_us(
        {
            name: lambda graph=graph: (
                _per_call_us(graph.replay, GRAPH_REPLAYS, device) / GRAPH_CALLS
            )
            for name, graph in graphs.items()
        }
    )
    torch.cuda.synchronize()
    for graph in graphs.values():
        graph.reset()
    rollback_channel_pools(cp)  # every graph above is reset: free their channels
    return row


def _measure(rank: int, device: torch.device) -> dict:
    started = time.perf_counter()
    core = PeerAllReduce(dist.group.WORLD, device)
    wide = PeerAllReduce(dist.group.WORLD, device, AllReduceConfig(WIDE_CHANNEL_BYTES))
    rows = [_measure_size(core, wide, nbytes, rank) for nbytes in SIZES]
    # The slower rank's latency is what the collective costs.
    modes = ("eager_us", "graph_us")
    times = torch.tensor(
        [[row[mode][v] for mode in modes for v in VARIANTS] for row in rows],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    n = len(VARIANTS)
    for row, maxima in zip(rows, times.tolist(), strict=True):
        for i, mode in enumerate(modes):
            row[mode] = dict(zip(VARIANTS, maxima[i * n : (i + 1) * n], strict=True))
    core.close()
    wide.close()
    return {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "world_size": WORLD_SIZE,
        "dtype": str(DTYPE).removeprefix("torch."),
        "core_config": {
            "channel_bytes": core.config.channel_bytes,
            "one_shot_max_bytes": core.config.one_shot_max_bytes,
        },
        "forced_channel_bytes": WIDE_CHANNEL_BYTES,
        "eager_calls": EAGER_CALLS,
        "graph_calls": GRAPH_CALLS * GRAPH_REPLAYS,
        "trials": TRIALS,
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }


def _worker(rank: int, store_path: str, result_path: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD_SIZE,
        device_id=device,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        torch.manual_seed(0)
        result = _measure(rank, device)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result, indent=2))
    finally:
        dist.destroy_process_group()


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def render(result: dict) -> list[str]:
    config = result["core_config"]
    names = {"core": "core", "one_shot": "one-shot", "two_shot": "two-shot", "nccl": "NCCL"}
    header = " | ".join(f"{mode} {names[v]}" for mode in ("eager", "graph") for v in VARIANTS)
    lines = [
        f"All-reduce (sum) latency, us per call, slower of {result['world_size']} ranks: "
        f"{result['device']}, torch {result['torch']}, NCCL {result['nccl']}, "
        f"{result['dtype']}, NVLink multicast off",
        "",
        f"core: PeerAllReduce defaults (one-shot up to {_size(config['one_shot_max_bytes'])}, "
        f"two-shot up to its {_size(config['channel_bytes'])} channel, NCCL above); "
        f"one-shot/two-shot: forced, on a {_size(result['forced_channel_bytes'])} channel; "
        f"NCCL: torch.distributed.all_reduce in place. Eager: {result['eager_calls']} calls "
        f"back to back; graph: {result['graph_calls']} calls replayed; the median of "
        f"{result.get('trials', 1)} trials, the variants timed in turn.",
        "",
        f"| size | core picks | sums = NCCL | {header} |",
        "|---|---|---|" + "---:|" * (2 * len(VARIANTS)),
    ]
    for row in result["rows"]:
        cells = [f"{row[mode][v]:.1f}" for mode in ("eager_us", "graph_us") for v in VARIANTS]
        equal = "yes" if row["equal_to_nccl"] else "**no**"
        lines.append(
            f"| {_size(row['bytes'])} | {row['core_picks']} | {equal} | {' | '.join(cells)} |"
        )
    return lines


def _summary(result: dict) -> str:
    ratios = {
        mode: [r[f"{mode}_us"]["core"] / r[f"{mode}_us"]["nccl"] for r in result["rows"]]
        for mode in ("eager", "graph")
    }
    spans = ", ".join(f"{mode} {min(v):.2f}x-{max(v):.2f}x" for mode, v in ratios.items())
    num_unequal = sum(not r["equal_to_nccl"] for r in result["rows"])
    return (
        f"allreduce: core/NCCL latency {spans} over {_size(SIZES[0])}-{_size(SIZES[-1])}; "
        f"sums unequal to NCCL at {num_unequal} sizes; {result['seconds']:.1f} s"
    )


def main() -> int:
    if torch.cuda.device_count() < WORLD_SIZE:
        print(f"bench/allreduce.py needs {WORLD_SIZE} CUDA GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(str(Path(tmp) / "store"), str(result_path)), nprocs=WORLD_SIZE)
        result = json.loads(result_path.read_text())
    lines = render(result)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "allreduce.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "allreduce.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "matplotlib is not importable here; render the plot later with "
            "python bench/plot_allreduce.py bench/results/allreduce.json"
        )
    else:
        from plot_allreduce import main as plot

        print(plot(str(RESULTS / "allreduce.json")))
    print(_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
