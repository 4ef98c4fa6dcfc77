"""The reserved range's bookkeeping on the CPU, with the CUDA driver API faked.

The fake stands for ``cuda.bindings.driver``, the narrowest seam: it hands out
handles for physical allocations while a budget lasts and records what is
mapped where. tests/gpu/test_reserve_gpu.py checks real pages on a GPU.
"""

import contextlib

import pytest
import torch

from tests.fake_cuda_driver import MIB, FakeDriver
from vllm_specgraph.reserve import (
    PageMapError,
    ReservedRange,
    StridedPlacement,
    blocks_within,
    page_runs,
)


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * MIB, 80 * MIB))
    return FakeDriver()


def _offsets(driver, reserved):
    return sorted((a - reserved.address, n) for a, (n, _) in driver.mapped.items())


def test_a_range_is_reserved_at_the_granularity_and_maps_only_what_is_asked(driver):
    reserved = ReservedRange(9 * MIB, "cuda:0", driver=driver)
    assert (reserved.reserved_bytes, reserved.mapped_bytes) == (10 * MIB, 0)
    assert driver.reserved == {reserved.address: 10 * MIB}
    assert reserved.map(3 * MIB, 1) == 2 * MIB, "widened to the pages around it"
    assert _offsets(driver, reserved) == [(2 * MIB, 2 * MIB)]


def test_mapping_over_mapped_pages_backs_only_the_unmapped_runs(driver):
    reserved = ReservedRange(10 * MIB, "cuda:0", driver=driver)
    reserved.map(2 * MIB, 2 * MIB)
    reserved.map(6 * MIB, 2 * MIB)
    assert reserved.map(0, 10 * MIB) == 6 * MIB
    assert _offsets(driver, reserved) == [
        (0, 2 * MIB),
        (2 * MIB, 2 * MIB),
        (4 * MIB, 2 * MIB),
        (6 * MIB, 2 * MIB),
        (8 * MIB, 2 * MIB),
    ]
    assert reserved.mapped_bytes == 10 * MIB and reserved.map(0, 10 * MIB) == 0


def test_running_out_of_memory_names_what_was_asked_and_what_is_free_and_leaks_nothing(driver):
    driver.physical_free = 5 * MIB
    reserved = ReservedRange(16 * MIB, "cuda:0", driver=driver)
    reserved.map(2 * MIB, 2 * MIB)
    with pytest.raises(PageMapError, match=r"could not back 12\.0 MiB .* 5\.0 MiB free"):
        reserved.map(0, 16 * MIB)  # the first run (2 MiB) fits, the second (12 MiB) does not
    assert reserved.mapped_bytes == 2 * MIB
    assert _offsets(driver, reserved) == [(2 * MIB, 2 * MIB)]
    assert driver.physical_free == 3 * MIB and len(driver.handles) == 1


@pytest.mark.parametrize("failing", ["fail_map", "fail_access"])
def test_a_failed_map_or_access_gives_its_pages_back(driver, failing):
    reserved = ReservedRange(4 * MIB, "cuda:0", driver=driver)
    setattr(driver, failing, True)
    with pytest.raises(PageMapError, match=r"CUDA_ERROR_INVALID.*nothing of this call stays"):
        reserved.map(0, 4 * MIB)
    assert (reserved.mapped_bytes, driver.mapped, driver.handles) == (0, {}, {})
    setattr(driver, failing, False)
    assert reserved.map(0, 4 * MIB) == 4 * MIB, "the range is usable after the failure"


def test_release_unmaps_every_page_and_frees_the_range_once(driver, monkeypatch):
    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronised.append)
    reserved = ReservedRange(8 * MIB, "cuda:0", driver=driver)
    reserved.map(0, 4 * MIB)
    reserved.map(6 * MIB, 2 * MIB)
    reserved.release()
    reserved.release()
    assert (driver.mapped, driver.handles, driver.reserved) == ({}, {}, {})
    assert driver.physical_free == 64 * MIB and len(synchronised) == 1
    with pytest.raises(RuntimeError, match="was released; make a new one"):
        reserved.map(0, 1)


def test_release_is_refused_while_a_view_is_alive(driver, monkeypatch):
    """torch.as_tensor stands in for the view: it keeps the range's holder, as a
    CUDA tensor made from ``__cuda_array_interface__`` does."""
    views = []

    def as_tensor(holder, device):
        views.append(holder)
        return torch.zeros(4, dtype=torch.uint8)

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    reserved = ReservedRange(4 * MIB, "cuda:0", driver=driver)
    reserved.map(2 * MIB, 2 * MIB)
    with pytest.raises(RuntimeError, match=r"first page is not mapped.*map\(0, \.\.\.\) first"):
        reserved.tensor()
    reserved.map(0, 1)
    reserved.tensor()
    reserved.tensor()
    assert len({id(v) for v in views}) == 1, "every view shares one holder"
    with pytest.raises(RuntimeError, match="a tensor over this reserved range is still alive"):
        reserved.release()
    assert driver.reserved, "nothing released"
    views.clear()  # the last view goes
    reserved.release()
    assert driver.reserved == {}


def test_mapping_beyond_the_range_is_refused_before_any_page(driver):
    reserved = ReservedRange(4 * MIB, "cuda:0", driver=driver)
    with pytest.raises(ValueError, match=r"reach byte 5242880, beyond the 4194304 reserved"):
        reserved.map(4 * MIB, MIB)
    assert driver.handles == {}


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 0), ValueError, "nbytes must be >= 1"),
        (("1", 0), TypeError, "nbytes must be an int"),
        ((MIB, "cpu"), ValueError, "device must be one CUDA GPU with its index"),
        ((MIB, "cuda"), ValueError, "device must be one CUDA GPU with its index"),
    ],
)
def test_bad_range_arguments_are_named_before_any_driver_call(driver, args, error, match):
    with pytest.raises(error, match=match):
        ReservedRange(*args, driver=driver)
    assert driver.reserved == {}


def test_without_cuda_bindings_the_error_names_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ImportError("No module named 'cuda'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(RuntimeError, match="needs NVIDIA's cuda-bindings package"):
        ReservedRange(MIB, "cuda:0")


def test_runs_over_several_pages_map_all_or_none(driver):
    driver.physical_free = 6 * MIB
    reserved = ReservedRange(32 * MIB, "cuda:0", driver=driver)
    with pytest.raises(PageMapError):
        reserved.map_runs([(0, MIB), (8 * MIB, 9 * MIB), (16 * MIB, 22 * MIB)])
    assert (reserved.mapped_bytes, driver.mapped, driver.physical_free) == (0, {}, 6 * MIB)
    assert reserved.map_runs([(0, MIB), (8 * MIB, 9 * MIB)]) == 4 * MIB
    assert _offsets(driver, reserved) == [(0, 2 * MIB), (8 * MIB, 2 * MIB)]


def test_page_runs_widen_to_pages_and_merge_what_meets():
    assert page_runs([(5, 6), (0, 1), (3 * MIB, 4 * MIB + 1)], 2 * MIB) == [(0, 6 * MIB)]
    assert page_runs([(0, 1), (2 * MIB, 2 * MIB + 1)], 2 * MIB) == [(0, 4 * MIB)]
    assert page_runs([(4 * MIB, 5 * MIB)], 2 * MIB) == [(4 * MIB, 6 * MIB)]
    with pytest.raises(ValueError, match=r"0 <= start < end, got \(3, 3\)"):
        page_runs([(3, 3)], 2 * MIB)


def test_blocks_of_a_layer_outermost_placement_are_one_run_per_layer():
    page = 64 << 10
    placement = StridedPlacement(
        0, layer_stride=page * 1000, block_stride=page, num_layers=3, page_bytes=page
    )
    assert placement.runs(10) == [
        (0, 10 * page),
        (1000 * page, 1010 * page),
        (2000 * page, 2010 * page),
    ]
    assert placement.runs(0) == []


def test_blocks_of_a_block_outermost_placement_are_one_prefix():
    page = 64 << 10
    placement = StridedPlacement(
        page, layer_stride=page, block_stride=4 * page, num_layers=4, page_bytes=page
    )
    runs = placement.runs(8)
    assert page_runs(runs, page) == [(page, page + 32 * page)]


def test_blocks_within_takes_the_most_blocks_whose_pages_fit():
    page, granularity = 512 << 10, 2 * MIB  # four blocks of a layer per driver page
    layer_outermost = StridedPlacement(0, 1000 * page, page, num_layers=2, page_bytes=page)
    # two layers: n blocks take 2 * ceil(n / 4) pages of 2 MiB
    assert blocks_within([layer_outermost], 8 * MIB, granularity, 1000) == 8
    assert blocks_within([layer_outermost], 8 * MIB - 1, granularity, 1000) == 4
    assert blocks_within([layer_outermost], 0, granularity, 1000) == 0
    assert blocks_within([layer_outermost], 1 << 40, granularity, 1000) == 1000


def test_an_exception_inside_the_driver_call_gives_the_pages_back(driver):
    reserved = ReservedRange(4 * MIB, "cuda:0", driver=driver)
    driver.fail_access = "raise"
    with pytest.raises(TypeError, match="the bindings refused"):
        reserved.map(0, 4 * MIB)
    assert (reserved.mapped_bytes, driver.mapped, driver.handles) == (0, {}, {})


def test_a_release_that_fails_midway_can_be_retried(driver, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    reserved = ReservedRange(8 * MIB, "cuda:0", driver=driver)
    reserved.map(0, 2 * MIB)
    reserved.map(4 * MIB, 2 * MIB)
    driver.fail_unmap_after = 1
    with pytest.raises(RuntimeError, match="cuMemUnmap failed"):
        reserved.release()
    assert reserved.mapped_bytes == 2 * MIB and driver.reserved, "the rest stays, recorded"
    reserved.release()
    assert (driver.mapped, driver.handles, driver.reserved) == ({}, {}, {})


def test_pages_are_made_and_opened_on_the_range_s_own_gpu(driver):
    reserved = ReservedRange(2 * MIB, "cuda:1", driver=driver)
    reserved.map(0, 1)
    assert reserved._prop.location.id == 1 and driver.access_devices == [1]
