"""A reserved range on a real GPU: graphs captured before its pages exist, and failures.

Needs NVIDIA's cuda-bindings package beside torch. Free memory is read at
driver level (cudaMemGetInfo), settled first.
"""

import gc

import pytest
import torch

from vllm_specgraph.meter import settled_free_bytes
from vllm_specgraph.reserve import BlockBacking, PageMapError, ReservedRange, StridedPlacement

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture(autouse=True)
def process_state_loaded():
    """The first kernel launch and the first capture load state the process keeps for
    good (kernel modules, the capture stream's cuBLAS workspace): load it before a
    test reads its baseline, or the baseline counts it as the range's."""
    pytest.importorskip("cuda.bindings.driver", reason="needs NVIDIA's cuda-bindings package")
    x = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x += x
    graph.replay()
    del graph
    settled_free_bytes()


def test_a_graph_captured_before_pages_are_mapped_reads_and_writes_them_after():
    free_before = settled_free_bytes()
    reserved = ReservedRange(64 * MIB, torch.cuda.current_device())
    reserved.map(0, reserved.granularity)  # what warm-up and capture touch
    values = reserved.tensor(torch.float32)
    far = (48 * MIB) // 4  # an element on a page that does not exist yet
    near = 5
    values[near] = 7.0
    step = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values[far : far + 4] += values[near] + step  # reads a mapped page, writes a late one
    mapped = reserved.map(0, reserved.reserved_bytes)
    assert mapped == reserved.reserved_bytes - reserved.granularity
    values[far : far + 4] = 1.0
    step.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert values[far : far + 4].tolist() == [8.5] * 4
    values[near] = 2.0  # a page mapped before the capture, written after it
    graph.replay()
    assert values[far : far + 4].tolist() == [11.0] * 4
    del graph, values
    gc.collect()
    reserved.release()
    assert abs(free_before - settled_free_bytes()) <= 2 * MIB, "every page given back"


def test_backing_more_than_the_gpu_has_fails_clearly_and_leaves_memory_as_it_was():
    free = settled_free_bytes()
    reserved = ReservedRange(free + 8 * reserved_granularity(), torch.cuda.current_device())
    reserved.map(0, reserved.granularity)
    before = settled_free_bytes()
    with pytest.raises(PageMapError, match=r"could not back .* MiB free"):
        reserved.map(0, reserved.reserved_bytes)
    assert abs(before - settled_free_bytes()) <= 2 * MIB, "the failed call kept no page"
    assert reserved.mapped_bytes == reserved.granularity
    view = reserved.tensor()
    view[:4] = 3
    assert view[:4].tolist() == [3] * 4, "the range works after the failure"
    with pytest.raises(RuntimeError, match="still alive"):
        reserved.release()
    del view
    gc.collect()
    reserved.release()
    assert abs(free - settled_free_bytes()) <= 2 * MIB


def reserved_granularity() -> int:
    probe = ReservedRange(1, torch.cuda.current_device())
    try:
        return probe.granularity
    finally:
        probe.release()


def test_kv_blocks_backed_after_a_capture_are_zeroed_and_the_graph_writes_them():
    """Two layers, each its own region (layer-outermost, as vLLM lays out most
    caches): the graph is captured with only block 0 backed and copies block 0
    into a block backed only after the capture."""
    page, blocks = 1 * MIB, 40
    free_before = settled_free_bytes()
    placement = StridedPlacement(0, page * blocks, page, 2, page)
    backing = BlockBacking(
        ReservedRange(2 * page * blocks, torch.cuda.current_device()), [placement], blocks
    )
    backing.back(1)
    kv = backing.tensor()
    assert kv[:page].eq(0).all(), "a warm-up block starts zeroed, as torch.zeros would"
    late = 30  # a block of layer 1 with no page under it at capture time
    dst = placement.layer_stride + late * page
    kv[:page].fill_(5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Kernels, as vLLM's KV writes are: a graph's memcpy node is refused at
        # capture (invalid argument) where its destination has no page yet.
        kv[dst : dst + page].mul_(0).add_(kv[:page])
    before = settled_free_bytes()
    # 36 blocks of each layer fill 36 MiB, whole 2 MiB pages: 72 MiB in all.
    mapped = backing.back(backing.most_blocks_within(72 * MIB))
    assert backing.num_blocks == 36 and mapped > 0
    assert before - settled_free_bytes() >= mapped - 2 * MIB, "the pages are real memory"
    assert kv[placement.layer_stride : placement.layer_stride + 36 * page].eq(0).all()
    assert kv[:page].eq(5).all(), "a block backed before keeps its contents"
    graph.replay()
    torch.cuda.synchronize()
    assert kv[dst : dst + page].eq(5).all()
    del graph, kv
    gc.collect()
    assert backing.release(), "no view left: released at once"
    assert abs(free_before - settled_free_bytes()) <= 2 * MIB, "every page given back"


def test_a_backing_abandoned_with_a_view_alive_goes_back_when_the_view_dies():
    free_before = settled_free_bytes()
    backing = BlockBacking(
        ReservedRange(16 * MIB, torch.cuda.current_device()),
        [StridedPlacement(0, 8 * MIB, MIB, 2, MIB)],
        8,
    )
    backing.back(8)
    view = backing.tensor()[:MIB]  # a KV-cache view some object still holds
    assert not backing.release()
    assert free_before - settled_free_bytes() >= 14 * MIB, "kept while the view lives"
    del view
    gc.collect()
    assert abs(free_before - settled_free_bytes()) <= 2 * MIB, "given back with the last view"
