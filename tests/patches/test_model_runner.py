"""The model_runner patch: every speculator phase in the draft lane, per-owner capture.

Speculator classes are vLLM 0.33.0's own; their methods are overridden by
probes that record the lane, because running them needs a GPU and a model.
"""

import importlib
import inspect
from types import SimpleNamespace

import pytest

from vllm_specgraph.lanes import current_owner

pytestmark = pytest.mark.vllm

SPECULATORS = [
    ("eagle.speculator", "EagleSpeculator"),
    ("mtp.speculator", "MTPSpeculator"),
    ("gemma4.speculator", "Gemma4Speculator"),
    ("multi_module_mtp.speculator", "MultiModuleMTPSpeculator"),
    ("dflash.speculator", "DFlashSpeculator"),
    ("dflash2.speculator", "DFlash2Speculator"),
    ("lilicorr.speculator", "LiLiCorrSpeculator"),
    ("xpress.speculator", "XPressSpeculator"),
    ("dspark.speculator", "DSparkSpeculator"),
    ("standalone_ar.speculator", "StandaloneARSpeculator"),
    ("ngram.speculator", "NgramGPUSpeculator"),
    ("extract_hidden_states", "ExtractHiddenStatesSpeculator"),
]
PHASES = {"init_cudagraph_manager", "capture", "propose"}
DRAFT_MODEL_PHASES = {"load_model", "set_attn", "observe_verification", "prepare_watermarking"}


def _probe_class(cls: type) -> tuple[type, list]:
    """A subclass of ``cls`` whose public methods record the lane they run in."""
    calls: list = []

    def recorder(name):
        def method(self, *args, **kwargs):
            calls.append((name, current_owner()))

        return method

    public = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
    return type(f"Probe{cls.__name__}", (cls,), {n: recorder(n) for n in public}), calls


@pytest.mark.parametrize(("module", "name"), SPECULATORS)
def test_run_speculator_in_draft_lane_every_public_method_of_real_class(module, name):
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    from vllm_specgraph.patches.v1.worker.gpu.model_runner import run_speculator_in_draft_lane

    cls = getattr(importlib.import_module(f"vllm.v1.worker.gpu.spec_decode.{module}"), name)
    probe_cls, calls = _probe_class(cls)
    speculator = run_speculator_in_draft_lane(probe_cls.__new__(probe_cls))
    public = {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    expected = PHASES | (DRAFT_MODEL_PHASES if issubclass(cls, DraftModelSpeculator) else set())
    assert expected <= public, f"{name} lacks phases {expected - public}"
    for method in sorted(public):
        getattr(speculator, method)()
    assert calls == [(method, 1) for method in sorted(public)]
    assert current_owner() == "target"


def test_init_speculator_builds_in_draft_lane_and_wraps(install_patch, monkeypatch):
    import vllm.v1.worker.gpu.model_runner as model_runner
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    probe_cls, calls = _probe_class(NgramGPUSpeculator)
    built_in = []

    def fake_init_speculator(vllm_config, device, req_states):
        built_in.append(current_owner())
        return probe_cls.__new__(probe_cls)

    monkeypatch.setattr(model_runner, "init_speculator", fake_init_speculator)
    install_patch("vllm.v1.worker.gpu.cudagraph_utils")
    install_patch("vllm.v1.worker.gpu.model_runner")
    speculator = model_runner.init_speculator(None, "cpu", None)
    speculator.propose()
    assert built_in == [1] and calls == [("propose", 1)]


def test_install_sets_every_by_value_name_and_undo_restores(install_patch):
    import vllm.v1.worker.gpu.cudagraph_utils as cudagraph_utils
    import vllm.v1.worker.gpu.model_runner as model_runner

    names = ("init_speculator", "refresh_quantized_lm_heads", "_profile_cudagraph_memory")
    before = {n: getattr(model_runner, n) for n in names}
    init_before = model_runner.GPUModelRunner.__init__
    from vllm_specgraph.patches._patching import PatchSet
    from vllm_specgraph.patches.v1.worker.gpu import cudagraph_utils as profile_patch
    from vllm_specgraph.patches.v1.worker.gpu import model_runner as runner_patch

    patches = PatchSet()
    profile_patch.install(patches, cudagraph_utils)
    runner_patch.install(patches, model_runner)
    assert model_runner._profile_cudagraph_memory is cudagraph_utils.profile_cudagraph_memory
    assert all(getattr(model_runner, n) is not before[n] for n in names)
    patches.undo()
    assert {n: getattr(model_runner, n) for n in names} == before
    assert model_runner.GPUModelRunner.__init__ is init_before


def test_install_model_runner_before_profile_patch_refused():
    import vllm.v1.worker.gpu.model_runner as model_runner

    from vllm_specgraph.patches._patching import PatchSet
    from vllm_specgraph.patches.v1.worker.gpu import model_runner as runner_patch

    patches = PatchSet()
    with pytest.raises(RuntimeError, match="cudagraph_utils must be patched before"):
        runner_patch.install(patches, model_runner)
    assert patches.names == ()


def test_production_capture_reports_where_its_bytes_went(monkeypatch, caplog, allocator_conf):
    """CUDA memory is faked (no GPU here): the capture puts 30 MiB in a graph pool,
    keeps a 2 MiB default-pool segment and loads 6 MiB the allocator does not hold;
    memory the process takes on another GPU meanwhile does not count. It runs with
    expandable segments on, as the profile's captures did."""
    import torch
    from vllm.compilation.counter import compilation_counter

    from vllm_specgraph import meter
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches import _measurements
    from vllm_specgraph.patches.v1.worker.gpu import model_runner as patch
    from vllm_specgraph.profile import GraphMemoryReport

    mib = 1 << 20
    state = {"free": 1000 * mib, "graph": 0, "default": 300 * mib, "other_gpu": 64 * mib}
    fakes = {
        "synchronize": lambda *args: None,
        "empty_cache": lambda: None,
        "current_device": lambda: 0,
        "mem_get_info": lambda *args: (state["free"], 2000 * mib),
        "memory_reserved": lambda *args: state["default"] + state["graph"],
        "memory_snapshot": lambda: [
            {"device": 0, "segment_pool_id": (0, 0), "total_size": state["default"]},
            {"device": 0, "segment_pool_id": (0, 5), "total_size": state["graph"]},
            {"device": 1, "segment_pool_id": (0, 5), "total_size": state["other_gpu"]},
        ],
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fn)

    class Runner:
        vllm_config = SimpleNamespace(use_cumem_cudagraph_pool=False)

        def capture_model(self, *, profile_only=False):
            state["expandable_in_capture"] = allocator_conf["expandable"]()
            state["graph"] += 30 * mib
            state["default"] += 2 * mib
            state["free"] -= 38 * mib
            state["other_gpu"] += 8 * mib
            compilation_counter.num_cudagraph_captured += 3
            return 38 * mib

    runner = Runner()
    estimate = GraphMemoryReport((OwnerMemory("target", 3, 38 * mib, 0),), 0, 0, 0, 0, 1.0)
    runner.specgraph_profile = _measurements.SpecgraphCapture(estimate=estimate)
    capture_model = patch._wrap_capture_model(Runner.capture_model)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        assert capture_model(runner) == 38 * mib
    outcome = runner.specgraph_profile
    assert outcome.actual_footprint == meter.CaptureFootprint(30 * mib, 2 * mib, 6 * mib)
    assert [(o.owner, o.driver_bytes, o.allocator_bytes) for o in outcome.actual] == [
        ("target", 38 * mib, 32 * mib)
    ]
    assert state["expandable_in_capture"] and not allocator_conf["expandable"]()
    [line] = [r.message for r in caplog.records if "estimate vs actual" in r.message]
    assert line.endswith(
        "; production: graph pools 30.0, default pools 2.0, outside the allocator 6.0 MiB"
    ), line


CUSTOM_AR = "the TP group's custom all-reduce registers captured buffers by CUDA IPC"


@pytest.mark.parametrize(
    ("estimate_mib", "actual_mib", "blocker", "warned"),
    [
        (114, 118, CUSTOM_AR, True),  # 1B with ngram on an H200: 4 MiB, one segment apart
        (114, 118, None, True),
        (116, 118, CUSTOM_AR, False),  # 2 MiB: the floor
        (1009, 1000, None, False),  # 0.9 %
        (1011, 1000, None, True),  # 1.1 %
    ],
)
def test_estimate_far_from_production_warns_and_says_why_segments_were_not_expandable(
    caplog, estimate_mib, actual_mib, blocker, warned
):
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches import _measurements
    from vllm_specgraph.patches.v1.worker.gpu import model_runner as patch
    from vllm_specgraph.profile import GraphMemoryReport

    mib = 1 << 20
    estimate = GraphMemoryReport(
        (OwnerMemory("target", 51, estimate_mib * mib, 0),), 0, 0, 0, 0, 1.0
    )
    outcome = _measurements.SpecgraphCapture(
        estimate=estimate,
        capture_wall_seconds=1.0,
        actual=(OwnerMemory("target", 51, actual_mib * mib, 0),),
        expandable_segments=blocker is None,
        expandable_segments_blocker=blocker,
    )
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        patch._log_estimate_vs_actual(outcome)
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == int(warned), warnings
    if warned:
        assert (
            f"missed the production capture by {estimate_mib - actual_mib:+.1f} MiB"
            in (warnings[0])
        )
        assert ("kept the allocator's setting because" in warnings[0]) == (blocker is not None)
        assert blocker is None or warnings[0].endswith(blocker), warnings[0]


@pytest.mark.parametrize(
    ("speculative_config", "lane"),
    [(None, 0), (SimpleNamespace(use_dspark=lambda: False), 1)],
)
def test_runner_runs_any_speculator_in_the_draft_lane_and_none_in_the_target_lane(
    install_patch, monkeypatch, speculative_config, lane
):
    import vllm.v1.worker.gpu.model_runner as model_runner

    def vllm_init(self, vllm_config, device):
        # vLLM's own rule (model_runner.py, __init__): lane 1 for DSpark alone. A
        # stand-in, as vLLM's __init__ needs a GPU and a model.
        self.speculative_config = vllm_config.speculative_config
        self._draft_workspace_lane = int(
            self.speculative_config is not None and self.speculative_config.use_dspark()
        )

    monkeypatch.setattr(model_runner.GPUModelRunner, "__init__", vllm_init)
    install_patch("vllm.v1.worker.gpu.cudagraph_utils")
    install_patch("vllm.v1.worker.gpu.model_runner")
    config = SimpleNamespace(speculative_config=speculative_config)
    runner = model_runner.GPUModelRunner(config, "cpu")
    assert runner._draft_workspace_lane == lane


def test_capture_inside_an_active_meter_reports_to_that_meter_alone():
    """A capture_model call made inside a measured one (the profile's pass) must not
    start its own meter: the speculator's capture would report its bytes to the inner
    meter, and the outer one would count them as the target's."""
    from vllm_specgraph import meter
    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches import _measurements
    from vllm_specgraph.patches.v1.worker.gpu import model_runner as patch
    from vllm_specgraph.profile import GraphMemoryReport

    calls = []

    class Runner:
        vllm_config = SimpleNamespace(use_cumem_cudagraph_pool=False)

        def capture_model(self, *, profile_only=False):
            calls.append(meter.current_meter())
            return 0

    runner = Runner()
    estimate = GraphMemoryReport((OwnerMemory("target", 1, 1, 0),), 0, 0, 0, 0, 1.0)
    runner.specgraph_profile = _measurements.SpecgraphCapture(estimate=estimate)
    capture_model = patch._wrap_capture_model(Runner.capture_model)
    with meter.metering(meter.CaptureMeter(_measurements.graphs_captured)) as outer:
        capture_model(runner)
    assert calls == [outer] and runner.specgraph_profile.actual is None


def test_production_kv_set_up_is_read_beside_the_cache_and_logged(
    monkeypatch, caplog, allocator_conf
):
    """Production's ``initialize_kv_cache`` (the profile has run): what it made beside
    the KV cache (a 16 MiB builder buffer in a segment of its own, a small block in
    a segment made before; not the KV cache) goes on the estimate-vs-actual line
    beside the budget's share for it. The profile's own set-up is not read."""
    import torch
    from vllm.compilation.counter import compilation_counter

    from vllm_specgraph.meter import OwnerMemory
    from vllm_specgraph.patches import _measurements
    from vllm_specgraph.patches.v1.worker.gpu import model_runner as patch
    from vllm_specgraph.profile import GraphMemoryReport

    mib = 1 << 20
    kv = torch.zeros(8, dtype=torch.int8)
    segments = [(300 * mib, [(1, 300 * mib)])]  # (segment size, blocks): the weights

    def snapshot():
        return [
            {
                "device": 0,
                "segment_pool_id": (0, 0),
                "total_size": size,
                "blocks": [{"address": a, "size": n, "state": "active_allocated"} for a, n in b],
            }
            for size, b in segments
        ]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Runner:
        vllm_config = SimpleNamespace(use_cumem_cudagraph_pool=False)

        def initialize_kv_cache(
            self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None
        ):
            self.kv_caches = [kv[:4], kv[4:]]
            address = kv.untyped_storage().data_ptr()
            segments[0] = (300 * mib, [(1, 300 * mib), (2, 1024)])  # a block in an old segment
            segments.append((1000 * mib, [(address, 1000 * mib)]))
            segments.append((16 * mib, [(3, 16 * mib)]))

        def capture_model(self, *, profile_only=False):
            compilation_counter.num_cudagraph_captured += 1
            return 0

    runner = Runner()
    initialize_kv_cache = patch._wrap_initialize_kv_cache(Runner.initialize_kv_cache)
    initialize_kv_cache(runner, None, True)
    assert not hasattr(runner, "specgraph_profile")
    estimate = GraphMemoryReport((OwnerMemory("target", 1, 0, 0),), 0, 0, 0, 0, 1.0)
    runner.specgraph_profile = _measurements.SpecgraphCapture(
        estimate=estimate, kv_state_bytes=16 * mib, kv_state_kept_bytes=0
    )
    segments[:] = [(300 * mib, [(1, 300 * mib)])]
    initialize_kv_cache(runner, None)
    # The builder's segment, and the small block beside the weights at its own bytes.
    assert runner.specgraph_profile.actual_kv_state_bytes == 16 * mib + 1024
    for name, fn in {
        "synchronize": lambda *args: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda *args: (1000 * mib, 2000 * mib),
        "memory_reserved": lambda *args: 0,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        patch._wrap_capture_model(Runner.capture_model)(runner)
    [line] = [r.message for r in caplog.records if "estimate vs actual" in r.message]
    assert (
        "KV-cache set-up beside the cache: production made 16.0 MiB, the budget held 16.0 MiB "
        "for it and 0.0 MiB of the profile's own in its one-time bytes" in line
    ), line
