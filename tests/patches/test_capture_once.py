"""Capture-once on vLLM 0.33.0's own modules: KV allocation, backing, worker, engine core.

Faked, because this machine has no GPU: the CUDA driver's virtual memory calls
(``tests/fake_cuda_driver.py``, the narrowest seam), the range's tensor (CPU bytes
filled with 0x55, so unzeroed bytes show), torch's free-memory reading, and what
needs a model on a GPU (vLLM's warm-up and capture, the engine's workers and their
sizing). vLLM's ``allocate_kv_cache``, its KV-cache config classes, its
``Worker.compile_or_warm_up_model`` and its capacity functions run as shipped.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.fake_cuda_driver import MIB, FakeDriver
from vllm_specgraph.patches import _capture_once
from vllm_specgraph.reserve import PageMapError, ReservedRange

GARBAGE = 0x55
BLOCKS = 64


@pytest.fixture
def gpu(monkeypatch):
    """The driver, the range's bytes and free memory: ``gpu.free`` is what the
    GPU reports free; backing pages takes from it, as the driver would."""
    driver = FakeDriver(physical_bytes=1 << 40)
    state = SimpleNamespace(driver=driver, free=8000 * MIB, ranges=[])

    def reserved_range(nbytes, device):
        made = ReservedRange(nbytes, device, driver=driver)
        state.ranges.append(made)
        return made

    def tensor(self, dtype=torch.uint8):
        if not hasattr(self, "_cpu_bytes"):
            self._cpu_bytes = torch.full((self.reserved_bytes,), GARBAGE, dtype=torch.uint8)
        return self._cpu_bytes.view(dtype)

    def mem_get_info(device=None):
        mapped = sum(r.mapped_bytes for r in state.ranges)
        return state.free - mapped, 80000 * MIB

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(ReservedRange, "tensor", tensor)
    monkeypatch.setattr(_capture_once, "ReservedRange", reserved_range)
    monkeypatch.setattr(_capture_once, "_plan", None)
    return state


def _kv_cache_config(num_blocks=BLOCKS, layers=("model.layers.0.attn", "model.layers.1.attn")):
    """Two layers of 64 KiB pages, each in its own region (layer-outermost)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * len(layers),
        layers=list(layers),
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    return KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(list(layers), spec)]), page


def _runner(max_num_seqs=2, max_num_batched_tokens=32):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        decode_query_len=1,
        device=torch.device("cuda:0"),
    )


def _layout():
    from vllm.v1.kv_cache_interface import KVCacheLayout

    return KVCacheLayout.LBNHC


def _allocate(install_patch, config, runner=None, device="cuda:0"):
    attn_utils = install_patch("vllm.v1.worker.gpu.attn_utils")
    if runner is not None:
        _capture_once.plan_capture_once(runner)
    return attn_utils.allocate_kv_cache(config, torch.device(device), _layout(), None)


def _block_bytes(kv, block):
    return kv[block].view(torch.uint8)


def test_the_warmup_bound_covers_vllms_warmup_and_capture_block_ids():
    config, _ = _kv_cache_config()
    # 2 requests x (1 + 1 block of 7 tokens) + one 32-token prefill (2 blocks + 2) + null block
    assert _capture_once.warmup_blocks(_runner(), config) == 1 + 2 * 2 + 4


def test_armed_the_kv_cache_lies_over_a_reserved_range_backed_for_warmup_only(gpu, install_patch):
    from vllm.v1.worker import utils
    from vllm.v1.worker.utils import allocate_kv_cache

    config, _ = _kv_cache_config()
    runner = _runner()
    shipped = allocate_kv_cache(config, torch.device("cpu"), _layout(), None)
    kv = _allocate(install_patch, config, runner)
    assert utils.torch is torch, "vLLM's module sees torch again"
    (reserved,) = gpu.ranges
    raw = reserved.tensor()
    assert {name: (t.shape, t.stride(), t.dtype) for name, t in kv.items()} == {
        name: (t.shape, t.stride(), t.dtype) for name, t in shipped.items()
    }, "vLLM's own views, over the range"
    assert all(t.untyped_storage().data_ptr() == raw.data_ptr() for t in kv.values())
    warm = _capture_once.warmup_blocks(runner, config)
    # each layer's region: warm-up blocks backed, widened to 2 MiB pages (32 blocks)
    assert reserved.mapped_bytes == 2 * 2 * MIB
    for layer in kv.values():
        assert all(_block_bytes(layer, b).eq(0).all() for b in range(warm)), "zeroed"
        assert _block_bytes(layer, BLOCKS - 1).eq(GARBAGE).all(), "no page there yet"
    assert _capture_once._plan.backing.num_blocks == warm
    assert _capture_once._plan.free_before == gpu.free


def test_unarmed_the_allocation_is_vllms(gpu, install_patch):
    config, _ = _kv_cache_config()
    kv = _allocate(install_patch, config, device="cpu")
    assert not gpu.ranges
    assert all(t.eq(0).all() for t in kv.values())


def test_an_allocation_that_fails_gives_the_range_back_and_drops_the_plan(
    gpu, install_patch, monkeypatch
):
    from vllm.v1.worker import utils

    config, _ = _kv_cache_config()

    def failing_views(*args, **kwargs):
        raise ValueError("no layout for this spec")

    monkeypatch.setattr(utils, "create_kv_cache_views", failing_views)
    with pytest.raises(ValueError, match="no layout"):
        _allocate(install_patch, config, _runner())
    assert utils.torch is torch
    assert gpu.driver.reserved == {} and gpu.driver.mapped == {}, "nothing kept"
    assert _capture_once.planned_runner() is None


def _worker(runner, kv_budget):
    return SimpleNamespace(model_runner=runner, available_kv_cache_memory_bytes=kv_budget)


def test_backing_after_capture_gives_the_kv_cache_the_budget_less_what_capture_took(
    gpu, install_patch
):
    config, _ = _kv_cache_config()
    runner = _runner()
    kv = _allocate(install_patch, config, runner)
    gpu.free -= 6 * MIB  # the production graphs and warm-up state
    # 2 MiB pages per layer: 16 MiB lets each layer have 8 MiB = 128 blocks' pages,
    # capped at the 64 blocks reserved; 14 MiB leaves 4 MiB a layer (64 blocks).
    outcome = _capture_once.back_within_budget(_worker(runner, 20 * MIB))
    assert outcome.taken_bytes == 6 * MIB
    assert outcome.budget_bytes == 14 * MIB
    assert (outcome.num_blocks, outcome.max_blocks) == (BLOCKS, BLOCKS)
    assert outcome.mapped_bytes == 8 * MIB
    assert runner.specgraph_capture_once is outcome
    for layer in kv.values():
        assert all(_block_bytes(layer, b).eq(0).all() for b in range(BLOCKS)), "zeroed"
    assert _capture_once.planned_runner() is None


def test_state_made_between_the_profile_and_the_kv_allocation_is_taken_from_the_budget(
    gpu, install_patch
):
    """vLLM's KV budget is measured at its memory profile; what the runner makes after
    it and before the KV cache (a speculator's attention state, block tables) is
    held at rest as the graphs are, so the budget must count it."""
    config, _ = _kv_cache_config(num_blocks=256)
    runner = _runner()
    attn_utils = install_patch("vllm.v1.worker.gpu.attn_utils")
    _capture_once.plan_capture_once(runner)
    gpu.free -= 4 * MIB  # state the runner makes before it allocates the KV cache
    attn_utils.allocate_kv_cache(config, torch.device("cuda:0"), _layout(), None)
    gpu.free -= 2 * MIB  # the production graphs
    outcome = _capture_once.back_within_budget(_worker(runner, 14 * MIB))
    assert outcome.taken_bytes == 6 * MIB
    # 8 MiB: 4 MiB a layer = 64 blocks of 64 KiB
    assert outcome.num_blocks == 64 and outcome.mapped_bytes == 8 * MIB


def test_backing_stops_at_the_budget_and_keeps_what_blocks_held(gpu, install_patch):
    config, _ = _kv_cache_config(num_blocks=256)
    runner = _runner()
    kv = _allocate(install_patch, config, runner)
    marked = next(iter(kv.values()))
    marked[1].fill_(3.0)  # a warm-up block written before the backing
    gpu.free -= 2 * MIB
    outcome = _capture_once.back_within_budget(_worker(runner, 14 * MIB))
    # 12 MiB: 6 MiB a layer = 96 blocks of 64 KiB
    assert outcome.num_blocks == 96 and outcome.mapped_bytes == 12 * MIB
    assert marked[1].eq(3.0).all(), "a block backed before keeps its contents"
    assert _block_bytes(marked, 95).eq(0).all() and _block_bytes(marked, 96).eq(GARBAGE).all()


def test_a_budget_below_the_warmup_blocks_stops_start_up_naming_the_numbers(gpu, install_patch):
    config, _ = _kv_cache_config()
    runner = _runner()
    _allocate(install_patch, config, runner)
    gpu.free -= 30 * MIB
    took = r"took 30.0 MiB since vLLM's memory profile, leaving 0.0 MiB of the 20.0 MiB"
    with pytest.raises(RuntimeError, match=took):
        _capture_once.back_within_budget(_worker(runner, 20 * MIB))


def test_pages_the_driver_refuses_name_requested_and_free_bytes_and_map_nothing(gpu, install_patch):
    config, _ = _kv_cache_config(num_blocks=256)
    runner = _runner()
    _allocate(install_patch, config, runner)
    (reserved,) = gpu.ranges
    before = dict(gpu.driver.mapped)
    gpu.driver.physical_free = 3 * MIB
    with pytest.raises(PageMapError, match=r"could not back .* MiB free"):
        _capture_once.back_within_budget(_worker(runner, 64 * MIB))
    assert gpu.driver.mapped == before and reserved.mapped_bytes == 4 * MIB


def _warmed_worker(install_patch, monkeypatch, warm_up):
    """vLLM's Worker with its model-specific warm-up replaced by ``warm_up``."""
    gpu_worker = install_patch("vllm.v1.worker.gpu_worker")
    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    runner = _runner()
    runner.eplb = SimpleNamespace(suppress=lambda: __import__("contextlib").nullcontext())
    worker.__dict__.update(
        model_runner=runner, use_v2_model_runner=True, available_kv_cache_memory_bytes=20 * MIB
    )
    monkeypatch.setattr(gpu_worker.Worker, "_compile_or_warm_up_model", lambda self: warm_up())
    return worker, runner


def test_the_worker_backs_the_kv_cache_after_vllms_warm_up_and_capture(
    gpu, install_patch, monkeypatch
):
    def warm_up():
        gpu.free -= 6 * MIB
        return "times"

    worker, runner = _warmed_worker(install_patch, monkeypatch, warm_up)
    config, _ = _kv_cache_config()
    _allocate(install_patch, config, runner)
    assert worker.compile_or_warm_up_model() == "times"
    assert runner.specgraph_capture_once.taken_bytes == 6 * MIB


def test_a_failed_capture_gives_the_reservation_back(gpu, install_patch, monkeypatch):
    """(Here the views are CPU bytes the range does not track; the GPU test checks
    that a range with a live view goes back when the view dies.)"""

    def warm_up():
        raise RuntimeError("CUDA error: out of memory during capture")

    worker, runner = _warmed_worker(install_patch, monkeypatch, warm_up)
    config, _ = _kv_cache_config()
    _allocate(install_patch, config, runner)
    with pytest.raises(RuntimeError, match="during capture"):
        worker.compile_or_warm_up_model()
    assert _capture_once.planned_runner() is None
    assert gpu.driver.reserved == {} and gpu.driver.mapped == {}


def test_a_worker_capture_once_is_not_armed_for_runs_vllms_warm_up_alone(
    gpu, install_patch, monkeypatch
):
    worker, runner = _warmed_worker(install_patch, monkeypatch, lambda: "times")
    assert worker.compile_or_warm_up_model() == "times"
    assert not hasattr(runner, "specgraph_capture_once")


@pytest.fixture
def engine(install_patch, monkeypatch):
    """vLLM's EngineCore with the plugin's patch, over a stand-in for its sizing.

    vLLM's own ``_initialize_kv_caches`` needs a model and workers on GPUs; the
    stand-in does what the patch relies on: it stores the capacity through the
    module's ``update_kv_cache_capacity`` (vLLM's, which runs), and returns the
    scheduler's config. ``engine.backed`` is what each worker reports.
    """
    import vllm.v1.engine.core as core
    from vllm.config import DeviceConfig, VllmConfig

    config, _ = _kv_cache_config(num_blocks=1000)

    def sizing(self, vllm_config):
        vllm_config.cache_config.num_gpu_blocks = config.num_blocks
        core.update_kv_cache_capacity(vllm_config, config)
        return config

    monkeypatch.setattr(core.EngineCore, "_initialize_kv_caches", sizing)
    install_patch("vllm.v1.engine.core")
    state = SimpleNamespace(config=config, backed=[None])
    made = core.EngineCore.__new__(core.EngineCore)
    made.collective_rpc = lambda method: [
        method(SimpleNamespace(model_runner=SimpleNamespace(specgraph_capture_once=None)))
        if n is None
        else method(
            SimpleNamespace(model_runner=SimpleNamespace(specgraph_capture_once=_backed(n)))
        )
        for n in state.backed
    ]
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    object.__setattr__(vllm_config, "model_config", SimpleNamespace(max_model_len=1024))
    state.vllm_config, state.core = vllm_config, made
    return state


def _backed(num_blocks):
    return _capture_once.CaptureOnceOutcome(1000, num_blocks, 0, 0, 0, 0, 0.0)


def test_the_scheduler_gets_the_fewest_blocks_a_worker_backed(engine, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "capture-once")
    engine.backed = [700, 640]
    result = engine.core._initialize_kv_caches(engine.vllm_config)
    assert result.num_blocks == 640
    assert engine.vllm_config.cache_config.num_gpu_blocks == 640
    assert engine.vllm_config.cache_config.kv_cache_size_tokens == 640 * 16, "after backing"


def test_where_no_worker_ran_capture_once_vllms_numbers_stand(engine, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "capture-once")
    result = engine.core._initialize_kv_caches(engine.vllm_config)
    assert result.num_blocks == 1000
    assert engine.vllm_config.cache_config.kv_cache_size_tokens == 1000 * 16


def test_other_profile_modes_leave_the_engine_as_shipped(engine, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "exact")
    engine.backed = [10]
    assert engine.core._initialize_kv_caches(engine.vllm_config).num_blocks == 1000


def test_workers_that_disagree_on_capture_once_stop_start_up(engine, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "capture-once")
    engine.backed = [700, None]
    with pytest.raises(RuntimeError, match=r"some workers and not on others .*\[700, None\]"):
        engine.core._initialize_kv_caches(engine.vllm_config)


def test_blocks_too_few_for_max_model_len_stop_start_up_naming_both(engine, monkeypatch):
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "capture-once")
    engine.backed = [50]  # 800 tokens
    with pytest.raises(ValueError, match=r"backed 50 KV blocks \(800 tokens\).*max_model_len=1024"):
        engine.core._initialize_kv_caches(engine.vllm_config)
    assert engine.config.num_blocks == 1000, "the config is left as vLLM sized it"


@pytest.fixture
def blocker(monkeypatch):
    """``capture_once_blocker`` on a runner over vLLM's own config and KV specs;
    ``blocker(change)`` applies ``change(config, specs, backends)`` first."""
    import sys
    import types

    from vllm.config import DeviceConfig, VllmConfig
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    class Layer(AttentionLayerBase):
        def __init__(self, backend):
            self.backend = backend

        def get_attn_backend(self):
            return SimpleNamespace(get_name=lambda: self.backend)

        def get_kv_cache_spec(self, vllm_config):
            raise NotImplementedError

    def decide(change=lambda config, specs, backends: None):
        config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        object.__setattr__(config, "model_config", SimpleNamespace(enable_sleep_mode=False))
        kv_config, _ = _kv_cache_config()
        spec = kv_config.kv_cache_groups[0].kv_cache_spec
        specs = {"model.layers.0.attn": spec, "model.layers.1.attn": spec}
        backends = {name: "TRITON_ATTN" for name in specs}
        change(config, specs, backends)
        context = config.compilation_config.static_forward_context
        context.update({name: Layer(backend) for name, backend in backends.items()})
        runner = SimpleNamespace(vllm_config=config, get_kv_cache_spec=lambda: specs)
        return _capture_once.capture_once_blocker(runner)

    return decide


def test_capture_once_applies_to_full_attention_on_one_gpu(blocker):
    assert blocker() is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda c, s, b: setattr(c.model_config, "enable_sleep_mode", True), "sleep mode"),
        (lambda c, s, b: setattr(c.parallel_config, "world_size", 2), "2 ranks"),
        (lambda c, s, b: b.update({"model.layers.1.attn": "FLEX_ATTENTION"}), "FLEX_ATTENTION"),
        (lambda c, s, b: s.clear(), "no KV cache"),
    ],
    ids=["sleep-mode", "tensor-parallel", "backend", "no-kv-cache"],
)
def test_capture_once_says_why_it_cannot_apply(blocker, change, why):
    assert why in blocker(change)


def test_capture_once_without_cuda_bindings_says_how_to_get_them(blocker, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    assert "cuda-bindings" in blocker()


def test_capture_once_refuses_layers_other_than_full_attention(blocker):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    def sliding(config, specs, backends):
        specs["model.layers.1.attn"] = SlidingWindowSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16, sliding_window=64
        )

    assert "other than full attention (SlidingWindowSpec)" in blocker(sliding)
