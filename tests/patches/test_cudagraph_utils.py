"""The exact disposable profile as vLLM 0.33.0 calls it, on the CPU.

The runner, its speculator, graph wrappers and CUDA memory are faked (they
need a GPU and a model); vLLM's own pool plumbing, compilation counters,
workspace module and CUDAGraphMode are real. The fakes record events so the
tests check the order of steps and what is restored after a fault.
tests/gpu and scripts/device-vllm-e2e.sh check the real memory on a GPU.
"""

import contextlib
import gc
import logging
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch

from vllm_specgraph.lanes import current_owner, current_owner_name
from vllm_specgraph.meter import CaptureFootprint

pytestmark = pytest.mark.vllm

MIB = 1 << 20


class _Wrapper:
    def __init__(self, pool, events):
        self.graph_pool, self.events = pool, events

    def clear_graphs(self):
        self.events.append(("clear_graphs",))


@pytest.fixture
def vllm_env(install_patch, allocator_conf, monkeypatch):
    import vllm.config
    import vllm.v1.worker.gpu.cudagraph_utils as cudagraph_utils
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.platforms import current_platform

    workspace_module = install_patch("vllm.v1.worker.workspace")
    install_patch("vllm.v1.worker.gpu.cudagraph_utils")
    events: list = []
    # held: graph-pool bytes; blocks: default-pool blocks past the weights,
    # address -> size (what a capture keeps for good, the profiling KV state).
    state = {
        "free": 1000 * MIB,
        "pool": 0,
        "held": 0,
        "blocks": {},
        "next_address": 1 << 32,
        "kv_state_bytes": 0,
        "expandable_in_capture": [],
        "segments": [],  # (driver bytes, addresses): segments of their own
    }

    def kept():
        return sum(state["blocks"].values())

    def new_block(size):
        state["next_address"] += 1 << 30
        state["blocks"][state["next_address"]] = size
        return state["next_address"]

    def graph_pool_handle():
        state["pool"] += 1
        return (0, state["pool"])

    def empty_cache():
        events.append(("empty_cache",))
        state["free"] += state.pop("releasable", 0)

    def segment(device, pool, blocks):
        return {
            "device": device,
            "segment_pool_id": pool,
            "total_size": sum(blocks.values()),
            "blocks": [
                {"address": a, "size": n, "state": "active_allocated"} for a, n in blocks.items()
            ],
        }

    def memory_snapshot():
        # The graphs' bytes in a graph pool's segment; the default pool's segments
        # (weights, say) stay as they are; another GPU's segments do not count.
        # A block of a segment of its own (state["segments"]: address -> that
        # segment's size, a list of blocks sharing it) is listed there.
        own = {a for _, group in state["segments"] for a in group}
        shared = {a: n for a, n in state["blocks"].items() if a not in own}
        return [
            segment(0, (0, 0), {0: 300 * MIB, **shared}),
            *(
                segment(0, (0, 0), {a: state["blocks"][a] for a in group if a in state["blocks"]})
                | {
                    "total_size": size,
                    "is_expandable": state.get("expandable_state_segment", False),
                }
                for size, group in state["segments"]
                if any(a in state["blocks"] for a in group)
            ),
            segment(0, (0, 99), {1 << 31: state["held"]}),
            segment(1, (0, 99), {0: 64 * MIB}),
        ]

    for name, fn in {
        "synchronize": lambda *device: events.append(("sync",)),
        "empty_cache": empty_cache,
        "mem_get_info": lambda *device: (state["free"], 2000 * MIB),
        "memory_snapshot": memory_snapshot,
        "memory_reserved": lambda: 300 * MIB + kept() + state["held"],
        "max_memory_reserved": lambda: 300 * MIB + kept() + state["held"],
        "reset_peak_memory_stats": lambda: None,
        "current_device": lambda: 0,
        "graph_pool_handle": graph_pool_handle,
        "is_current_stream_capturing": lambda: False,
        "current_blas_handle": lambda: events.append(("blas_handle",)),
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(  # CPU builds of torch lack it
        torch._C,
        "_cuda_clearCublasWorkspaces",
        lambda: events.append(("clear_cublas",)),
        raising=False,
    )
    platform_cls = type(current_platform)
    production_pool = graph_pool_handle()
    monkeypatch.setattr(platform_cls, "_global_graph_pool", production_pool)
    monkeypatch.setattr(
        platform_cls, "graph_pool_handle", lambda self: graph_pool_handle(), raising=False
    )
    monkeypatch.setattr(platform_cls, "is_cuda", lambda self: True)
    monkeypatch.setattr(CUDAGraphWrapper, "_all_instances", weakref.WeakSet())
    monkeypatch.setattr(BreakableCUDAGraphWrapper, "_all_instances", weakref.WeakSet())
    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda c: contextlib.nullcontext())

    def minimal_kv(runner):
        # The state the KV-cache set-up leaves held until the next set-up replaces
        # it (the draft's attention metadata buffers): taken at driver level once.
        events.append(("minimal_kv", platform_cls._global_graph_pool))
        # Driver memory the first set-up takes outside the allocator and any capture
        # window (a library's first initialisation, say): no owner's bytes explain it.
        state["free"] -= state.pop("kv_driver_only_bytes", 0)
        if state["kv_state_bytes"]:
            old = state.pop("kv_state_block", None)
            if old is None:
                state["free"] -= state["kv_state_bytes"]
            else:
                del state["blocks"][old]
            state["kv_state_block"] = new_block(state["kv_state_bytes"])
        # The KV cache itself (one buffer, every layer's view into it) and state
        # the profiling teardown frees (the target's attention metadata buffers):
        # production's set-up makes that state again after the KV cache is sized.
        if state.get("kv_cache_bytes"):
            buffer = torch.zeros(64, dtype=torch.int8)
            runner.kv_caches = [buffer[:32], buffer[32:]]
            address = buffer.untyped_storage().data_ptr()
            state["blocks"][address] = state["kv_cache_bytes"]
            state["segments"].append((state["kv_cache_bytes"], [address]))
            state["free"] -= state["kv_cache_bytes"]
        if state.get("kv_state_freed_bytes"):
            # In a segment of its own (the driver's cost: kv_state_freed_segment),
            # or beside the state that outlives the pass (kv_state_shared).
            freed = new_block(state["kv_state_freed_bytes"])
            state["kv_state_freed_block"] = freed
            size = state.get("kv_state_freed_segment", state["kv_state_freed_bytes"])
            if state.get("kv_state_shared"):
                state["segments"].append((size, [freed, state["kv_state_block"]]))
            elif "older_block" in state:  # beside a block from before the profile
                state["segments"].append((size, [freed, state["older_block"]]))
            else:
                state["segments"].append((size, [freed]))
                state["free"] -= size

    def teardown(runner):
        events.append(("teardown_profiling_state",))
        state["releasable"], state["held"] = state["held"], 0
        for cache in getattr(runner, "kv_caches", ())[:1]:
            del state["blocks"][cache.untyped_storage().data_ptr()]
            state["releasable"] += state["kv_cache_bytes"]
        runner.kv_caches = []
        if "older_block" in state:
            state["blocks"].pop(state["older_block"], None)
        if "kv_state_freed_block" in state:
            del state["blocks"][state.pop("kv_state_freed_block")]
            if not state.get("kv_state_shared"):  # else the kept state holds its segment
                state["releasable"] += state.get(
                    "kv_state_freed_segment", state["kv_state_freed_bytes"]
                )

    @contextlib.contextmanager
    def freeze_gc_for_cudagraph_capture():
        # vLLM's: collect, freeze, disable; on exit unfreeze, collect, enable.
        events.append(("gc_freeze", "production"))
        yield

    # The real module imports compiled ops at import time; a stand-in holds the one
    # name the profile rebinds, looked up at call time as capture_model does.
    model_runner_module = SimpleNamespace(
        freeze_gc_for_cudagraph_capture=freeze_gc_for_cudagraph_capture
    )
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.model_runner", model_runner_module)
    monkeypatch.setattr(cudagraph_utils, "_init_minimal_kv_cache_for_profiling", minimal_kv)
    monkeypatch.setattr(cudagraph_utils, "_teardown_profiling_state", teardown)
    from vllm.device_allocator import alloc_conf

    set_alloc_conf = alloc_conf.set_alloc_conf  # the allocator_conf fixture's fake
    monkeypatch.setattr(
        alloc_conf,
        "set_alloc_conf",
        lambda conf: (events.append(("alloc_conf", conf)), set_alloc_conf(conf)),
    )
    saved_manager = workspace_module._manager
    workspace_module.init_workspace_manager(torch.device("cpu"), 1, 2)
    yield SimpleNamespace(
        events=events,
        state=state,
        new_block=new_block,
        platform_cls=platform_cls,
        production_pool=production_pool,
        wrappers=CUDAGraphWrapper._all_instances,
        workspace=workspace_module.current_workspace_manager(),
        lock_workspace=workspace_module.lock_workspace,
        cudagraph_utils=cudagraph_utils,
        cudagraph_utils_patch=sys.modules["vllm_specgraph.patches.v1.worker.gpu.cudagraph_utils"],
        model_runner_module=model_runner_module,
        allocator_conf=allocator_conf,
    )
    workspace_module._manager = saved_manager


class _Speculator:
    def __init__(self, env, fail_capture=False, one_time_bytes=0):
        self.env, self.fail_capture = env, fail_capture
        self.one_time_bytes = one_time_bytes  # taken by the first capture, never given back

    def capture(self):
        from vllm.compilation.counter import compilation_counter

        self.env.events.append(("speculator_capture", current_owner()))
        with torch.no_grad():
            self.env.workspace.get_simultaneous(((1024,), torch.float32))
        if self.fail_capture:
            raise KeyError("draft capture failed")
        self.env.state["free"] -= 10 * MIB + self.one_time_bytes
        self.env.state["held"] += 10 * MIB
        self.one_time_bytes = 0
        compilation_counter.num_cudagraph_captured += 2

    def init_cudagraph_manager(self, mode):
        self.env.events.append(("speculator_init_cudagraph_manager", mode.name))


class _Runner:
    def __init__(self, env, speculator, fail_capture=False, one_time_bytes=0, kept_bytes=0):
        from vllm.config.compilation import CUDAGraphMode

        self.env, self.speculator, self.fail_capture = env, speculator, fail_capture
        # Taken by the first capture and never given back: outside the allocator,
        # and in a default-pool segment.
        self.one_time_bytes, self.kept_bytes = one_time_bytes, kept_bytes
        self.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL)
        self.device = torch.device("cuda:0")
        self.vllm_config = SimpleNamespace(use_cumem_cudagraph_pool=False)
        record = env.events.append
        self.cudagraph_manager = SimpleNamespace(release_graphs=lambda: record(("release",)))
        self.fast_prefill = object()  # holds the profiling manager, as vLLM's helper does
        self.model_state = SimpleNamespace(
            graphs=SimpleNamespace(release=lambda: record(("inner_release",)))
        )

    def needs_cudagraph_capture(self):
        return True

    def capture_model(self, *, profile_only=False):

        env = self.env
        env.events.append(("capture_model", profile_only, env.platform_cls._global_graph_pool))
        env.state["expandable_in_capture"].append(env.allocator_conf["expandable"]())
        with env.model_runner_module.freeze_gc_for_cudagraph_capture():
            env.events.append(("gc_enabled_in_capture", gc.isenabled()))
            return self._capture(env)

    def _capture(self, env):
        from vllm.compilation.counter import compilation_counter

        # vLLM's figure: driver-level free memory before and after.
        free_before = env.state["free"]
        env.new_wrapper = _Wrapper(env.platform_cls._global_graph_pool, env.events)
        env.wrappers.add(env.new_wrapper)
        if self.fail_capture:
            raise RuntimeError("target capture failed")
        env.state["free"] -= 30 * MIB + self.one_time_bytes + self.kept_bytes
        env.state["held"] += 30 * MIB
        if self.kept_bytes:
            env.new_block(self.kept_bytes)
        self.one_time_bytes = self.kept_bytes = 0
        compilation_counter.num_cudagraph_captured += 3
        if self.speculator is not None:
            self.speculator.capture()
        env.lock_workspace()
        return free_before - env.state["free"]


def _runner(
    env,
    fail_capture=False,
    fail_draft=False,
    one_time_bytes=0,
    target_one_time_bytes=0,
    target_kept_bytes=0,
):
    from vllm_specgraph.patches.v1.worker.gpu.model_runner import run_speculator_in_draft_lane

    speculator = run_speculator_in_draft_lane(_Speculator(env, fail_draft, one_time_bytes))
    return _Runner(env, speculator, fail_capture, target_one_time_bytes, target_kept_bytes)


def test_profile_measures_every_graph_per_owner_and_gives_everything_back(vllm_env):
    from vllm.compilation.counter import compilation_counter

    env = vllm_env
    old_wrapper = _Wrapper(env.production_pool, env.events)
    env.wrappers.add(old_wrapper)
    graphs_before = compilation_counter.num_cudagraph_captured
    runner = _runner(env)
    estimate = env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert estimate == 40 * MIB
    report = runner.specgraph_profile.estimate
    assert [(o.owner, o.num_graphs, o.driver_bytes) for o in report.owners] == [
        ("target", 3, 30 * MIB),
        ("draft", 2, 10 * MIB),
    ]
    assert report.retained_bytes == 0
    assert compilation_counter.num_cudagraph_captured == graphs_before
    assert env.platform_cls._global_graph_pool == env.production_pool
    assert old_wrapper.graph_pool == env.production_pool
    assert env.new_wrapper.graph_pool == env.production_pool, "made mid-profile"
    assert not env.workspace.is_locked()
    assert env.workspace.usage()["draft"].total_bytes == 0, "lane growth rolled back"
    assert runner.fast_prefill is None, "nothing keeps the profiling manager's outputs"


def test_profile_step_order(vllm_env):
    env = vllm_env
    env.cudagraph_utils.profile_cudagraph_memory(_runner(env))
    private = (0, 2)
    steps = [e for e in env.events if e[0] not in ("empty_cache",)]
    assert steps[:5] == [
        ("sync",),
        ("clear_cublas",),
        ("blas_handle",),
        ("sync",),  # the engine's baseline
        ("minimal_kv", private),
    ]
    capture_at = steps.index(("capture_model", False, private))
    on_at = steps.index(("alloc_conf", "expandable_segments:True"))
    off_at = steps.index(("alloc_conf", "expandable_segments:False"))
    assert on_at < capture_at < off_at < steps.index(("clear_graphs",)), (
        "expandable segments for the capture only; back before the graphs are destroyed"
    )
    steps = [e for e in steps if e[0] != "alloc_conf"]
    capture_at = steps.index(("capture_model", False, private))
    assert steps[capture_at + 1 : capture_at + 4] == [
        ("gc_enabled_in_capture", False),
        ("sync",),
        ("speculator_capture", 1),
    ]
    destroy_at = steps.index(("clear_graphs",))
    assert steps[destroy_at - 1] == ("sync",), "graphs are destroyed after a synchronise"
    assert steps[destroy_at + 1 :] == [
        ("release",),
        ("inner_release",),
        ("speculator_init_cudagraph_manager", "NONE"),
        ("teardown_profiling_state",),
        ("clear_cublas",),
        ("blas_handle",),
        ("sync",),
    ]


def test_profile_rolls_back_the_channels_its_captures_made_on_the_groups_all_reduce(
    vllm_env, monkeypatch
):
    from vllm.distributed import parallel_state

    from vllm_specgraph.channels import ChannelPool
    from vllm_specgraph.device_channel import device_channel_factory

    env = vllm_env
    channel_pool = ChannelPool("tp", device_channel_factory(64, "cpu"))
    eager = channel_pool.current()
    group = SimpleNamespace(
        device_communicator=SimpleNamespace(
            specgraph_all_reduce=SimpleNamespace(channel_pool=channel_pool)
        )
    )
    # A communicator shared by two groups is checkpointed once (rolling it back twice
    # would refuse the second time).
    monkeypatch.setattr(parallel_state, "_TP", group)
    monkeypatch.setattr(parallel_state, "_DCP", group)
    runner = _runner(env)
    made = []
    capture_model = runner.capture_model

    def capture_model_through_graph_capture(*, profile_only=False):
        # What the parallel_state patch does around each graph manager's capture.
        with channel_pool.capture(owner="target") as channel:
            made.append(channel)
        return capture_model(profile_only=profile_only)

    runner.capture_model = capture_model_through_graph_capture
    env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert made and channel_pool.channels == (eager,), "the profile's channels are closed"
    with pytest.raises(RuntimeError, match="closed"):
        _ = made[0].buffer


def test_profile_collections_visit_only_what_its_pass_made(vllm_env, monkeypatch):
    env = vllm_env
    collect = gc.collect
    monkeypatch.setattr(
        gc,
        "collect",
        lambda *a: (env.events.append(("gc_collect", gc.get_freeze_count() > 0)), collect(*a)),
    )
    env.cudagraph_utils.profile_cudagraph_memory(_runner(env))
    steps = [
        e for e in env.events if e[0] in ("gc_collect", "capture_model", "teardown_profiling_state")
    ]
    # Where vLLM's capture collects as it starts, and after vLLM's teardown (faked
    # here: the real one collects too) drops the graphs; every older object frozen.
    assert steps == [
        ("capture_model", False, steps[0][2]),
        ("gc_collect", True),
        ("teardown_profiling_state",),
        ("gc_collect", True),
    ]
    assert ("gc_enabled_in_capture", False) in env.events, "capture runs with gc off"
    assert gc.isenabled() and gc.get_freeze_count() == 0
    frozen = env.model_runner_module.freeze_gc_for_cudagraph_capture
    assert frozen.__name__ == "freeze_gc_for_cudagraph_capture", "production's is back"


@pytest.mark.parametrize("fault", ["minimal_kv", "target_capture", "draft_capture", "teardown"])
def test_profile_fault_at_each_step_restores_pools_lanes_counters_and_reraises(
    vllm_env, monkeypatch, fault
):
    from vllm.compilation.counter import compilation_counter

    env = vllm_env
    old_wrapper = _Wrapper(env.production_pool, env.events)
    env.wrappers.add(old_wrapper)
    counters = (
        compilation_counter.num_cudagraph_captured,
        compilation_counter.num_gpu_runner_capture_triggers,
    )
    failure = OSError(f"{fault} failed")

    def fail(*args):
        raise failure

    if fault == "minimal_kv":
        monkeypatch.setattr(env.cudagraph_utils, "_init_minimal_kv_cache_for_profiling", fail)
    if fault == "teardown":
        monkeypatch.setattr(env.cudagraph_utils, "_teardown_profiling_state", fail)
    runner = _runner(
        env, fail_capture=fault == "target_capture", fail_draft=fault == "draft_capture"
    )
    production_freeze = env.model_runner_module.freeze_gc_for_cudagraph_capture
    with pytest.raises((OSError, RuntimeError, KeyError)) as info:
        env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert fault.split("_")[0] in str(info.value)
    assert env.model_runner_module.freeze_gc_for_cudagraph_capture is production_freeze
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert env.platform_cls._global_graph_pool == env.production_pool
    assert old_wrapper.graph_pool == env.production_pool
    if hasattr(env, "new_wrapper"):
        assert env.new_wrapper.graph_pool == env.production_pool
    assert not env.workspace.is_locked()
    assert env.workspace.usage()["draft"].total_bytes == 0
    assert (
        compilation_counter.num_cudagraph_captured,
        compilation_counter.num_gpu_runner_capture_triggers,
    ) == counters
    assert ("clear_cublas",) in env.events[-6:], "teardown ran to the end"
    assert not hasattr(runner, "specgraph_profile")
    assert not env.allocator_conf["expandable"](), "the allocator config is the user's"


@pytest.fixture
def vllm_profile_calls(vllm_env, monkeypatch):
    """The patch installed over a stand-in for vLLM's own profile, which returns 7."""
    from vllm_specgraph.patches._patching import PatchSet
    from vllm_specgraph.patches.v1.worker.gpu.cudagraph_utils import install

    calls = []

    def vllm_profile(runner):
        calls.append(runner)
        return 7

    monkeypatch.setattr(vllm_env.cudagraph_utils, "profile_cudagraph_memory", vllm_profile)
    patches = PatchSet()
    install(patches, vllm_env.cudagraph_utils)
    yield calls
    patches.undo()


def test_profile_extrapolate_mode_calls_vllm_profile(vllm_env, vllm_profile_calls, monkeypatch):
    env = vllm_env
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "extrapolate")
    runner = _runner(env)
    assert env.cudagraph_utils.profile_cudagraph_memory(runner) == 7
    assert vllm_profile_calls == [runner]
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "exactly")
    with pytest.raises(
        ValueError, match=r"VLLM_SPECGRAPH_PROFILE='exactly'.*'exact', 'extrapolate'"
    ):
        env.cudagraph_utils.profile_cudagraph_memory(runner)


def test_profile_on_a_platform_other_than_cuda_keeps_vllm_estimate(
    vllm_env, vllm_profile_calls, monkeypatch
):
    env = vllm_env
    monkeypatch.setattr(env.platform_cls, "is_cuda", lambda self: False)
    runner = _runner(env)
    assert env.cudagraph_utils.profile_cudagraph_memory(runner) == 7
    assert vllm_profile_calls == [runner]
    assert not any(e[0] == "capture_model" for e in env.events)


def _captures(env):
    return sum(1 for e in env.events if e[0] == "capture_model")


def test_profile_one_pass_when_what_it_left_lies_outside_the_allocator(vllm_env, caplog):
    """Expandable segments on: the first pass's allocator bytes are the graphs, per owner."""
    env = vllm_env
    runner = _runner(env, one_time_bytes=4 * MIB, target_one_time_bytes=6 * MIB)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    outcome = runner.specgraph_profile
    report = outcome.estimate
    assert [(o.owner, o.driver_bytes, o.allocator_bytes) for o in report.owners] == [
        ("target", 30 * MIB, 30 * MIB),
        ("draft", 10 * MIB, 10 * MIB),
    ], "the one-time bytes are no owner's graphs"
    assert (report.one_time_bytes, report.retained_bytes) == (10 * MIB, 0)
    assert report.retained_allocator_bytes == 0
    assert budget == 50 * MIB, "the KV cache is sized after the profile: budget what it kept"
    assert (_captures(env), outcome.profile_passes) == (1, 1)
    assert env.state["expandable_in_capture"] == [True]
    assert outcome.estimate_footprint == CaptureFootprint(40 * MIB, 0, 10 * MIB)
    [line] = [r.message for r in caplog.records if "memory profile" in r.message]
    assert "1 pass, expandable segments on" in line


def test_profile_one_pass_when_it_kept_blocks_made_before_capturing(vllm_env, caplog):
    """The KV-cache set-up's state (the draft's attention buffers) stays until the real
    set-up replaces it; no capture window took it, so the allocator bytes still hold."""
    env = vllm_env
    env.state["kv_state_bytes"] = 8 * MIB
    runner = _runner(env, one_time_bytes=4 * MIB)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    report = runner.specgraph_profile.estimate
    assert [(o.owner, o.driver_bytes) for o in report.owners] == [
        ("target", 30 * MIB),
        ("draft", 10 * MIB),
    ]
    assert (report.one_time_bytes, report.retained_allocator_bytes) == (12 * MIB, 8 * MIB)
    assert budget == 52 * MIB
    assert (_captures(env), runner.specgraph_profile.profile_passes) == (1, 1)
    [line] = [r.message for r in caplog.records if "its allocator bytes" in r.message]
    assert "4.0 MiB outside the allocator and 8.0 MiB of blocks made before capturing" in line


def test_profile_measures_again_when_the_first_pass_kept_allocator_memory(vllm_env):
    """A default-pool segment the first capture keeps is one-time too, but inside the
    allocator: the first pass's allocator bytes would count it as graphs."""
    env = vllm_env
    runner = _runner(env, one_time_bytes=4 * MIB, target_kept_bytes=2 * MIB)
    budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    report = runner.specgraph_profile.estimate
    assert [(o.owner, o.driver_bytes) for o in report.owners] == [
        ("target", 30 * MIB),
        ("draft", 10 * MIB),
    ], "the second pass measures what production will take"
    assert (report.one_time_bytes, report.retained_bytes) == (6 * MIB, 0)
    assert report.retained_allocator_bytes == 2 * MIB, "the kept segment"
    assert budget == 46 * MIB
    assert (_captures(env), runner.specgraph_profile.profile_passes) == (2, 2)
    footprint = runner.specgraph_profile.estimate_footprint
    assert footprint == CaptureFootprint(40 * MIB, 0, 0), "the last pass's: graphs only"


@pytest.mark.parametrize("blocker", ["user_conf", "cumem_pool", "custom_all_reduce"])
def test_profile_keeps_the_allocator_setting_where_it_must_and_measures_twice(
    vllm_env, monkeypatch, caplog, blocker
):
    from vllm.distributed import parallel_state

    env = vllm_env
    runner = _runner(env, one_time_bytes=4 * MIB)
    reason = {
        "user_conf": "the allocator config 'max_split_size_mb:512,expandable_segments:False'",
        "cumem_pool": "sleep-mode cuMem pool",
        "custom_all_reduce": "the TP group's custom all-reduce registers captured buffers",
    }[blocker]
    if blocker == "user_conf":
        monkeypatch.setenv(
            "PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:False"
        )
    if blocker == "cumem_pool":
        runner.vllm_config.use_cumem_cudagraph_pool = True
    if blocker == "custom_all_reduce":
        custom = SimpleNamespace(disabled=False, _capture_registered=True)
        monkeypatch.setattr(
            parallel_state,
            "_TP",
            SimpleNamespace(device_communicator=SimpleNamespace(ca_comm=custom)),
        )
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert budget == 44 * MIB
    assert env.state["expandable_in_capture"] == [False, False]
    assert env.allocator_conf["writes"] == [], "the allocator config is not touched"
    outcome = runner.specgraph_profile
    assert (outcome.profile_passes, outcome.expandable_segments) == (2, False)
    assert reason in outcome.expandable_segments_blocker
    [line] = [r.message for r in caplog.records if "memory profile" in r.message]
    assert f"2 passes, expandable segments off ({outcome.expandable_segments_blocker})" in line


def test_profile_with_expandable_segments_set_by_the_user_leaves_them_as_they_are(
    vllm_env, monkeypatch
):
    env = vllm_env
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    runner = _runner(env, one_time_bytes=4 * MIB)
    assert env.cudagraph_utils.profile_cudagraph_memory(runner) == 44 * MIB
    assert env.state["expandable_in_capture"] == [True]
    assert env.allocator_conf["writes"] == []
    assert runner.specgraph_profile.profile_passes == 1


def test_profile_budget_holds_the_kv_state_production_makes_again(vllm_env, caplog):
    """The KV-cache set-up's own state beside the cache: what the teardown frees
    (a 5 MiB block, the target's attention buffers, in a 20 MiB segment of its
    own) production's set-up makes again after the KV cache is sized, so the
    budget holds its segment; what outlives the pass (8 MiB, the draft's) is in
    the one-time bytes already; the KV cache itself (the minimal one) is no state."""
    env = vllm_env
    env.state.update(
        kv_state_bytes=8 * MIB,
        kv_state_freed_bytes=5 * MIB,
        kv_state_freed_segment=20 * MIB,
        kv_cache_bytes=20 * MIB,
    )
    runner = _runner(env)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    report = runner.specgraph_profile.estimate
    assert report.one_time_bytes == 8 * MIB
    assert runner.specgraph_profile.kv_state_bytes == 20 * MIB
    assert budget == (40 + 8 + 20) * MIB
    [line] = [r.message for r in caplog.records if "memory profile" in r.message]
    assert "budget 68.0 MiB (with 20.0 MiB of KV-cache initialisation state made after" in line


def test_profile_kv_state_beside_kept_state_is_budgeted_at_its_blocks_bytes(vllm_env):
    """A freed state block that shared its segment with state that outlives the
    pass: that segment is in the one-time bytes; the freed block is budgeted at
    its own bytes, not its segment's, and never at less."""
    env = vllm_env
    env.state.update(
        kv_state_bytes=8 * MIB,
        kv_state_freed_bytes=5 * MIB,
        kv_state_freed_segment=20 * MIB,
        kv_state_shared=True,
    )
    runner = _runner(env)
    budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert runner.specgraph_profile.kv_state_bytes == 5 * MIB
    assert budget == (40 + 8 + 5) * MIB


@pytest.mark.parametrize("expandable", [False, True])
def test_profile_kv_state_beside_an_older_block_or_expandable_costs_its_blocks(
    vllm_env, expandable
):
    """A freed state block in a segment that a block from before the profile also
    held, or in an expandable segment (one per stream, shared by everything): the
    segment says nothing of the state's cost, so its blocks' bytes are budgeted."""
    env = vllm_env
    env.state.update(
        kv_state_freed_bytes=5 * MIB,
        kv_state_freed_segment=20 * MIB,
        expandable_state_segment=expandable,
    )
    if not expandable:
        env.state["older_block"] = env.new_block(2 * MIB)
    runner = _runner(env)
    env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert runner.specgraph_profile.kv_state_bytes == 5 * MIB


def test_profile_measured_twice_budgets_the_last_passes_kv_state(vllm_env):
    """With a second pass (a capture kept a block), the state the budget holds is
    the last pass's: the first pass's copy was freed when the second set-up ran."""
    env = vllm_env
    env.state.update(kv_state_freed_bytes=4 * MIB, kv_state_freed_segment=20 * MIB)
    runner = _runner(env, target_kept_bytes=6 * MIB)
    budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    outcome = runner.specgraph_profile
    assert outcome.profile_passes == 2
    assert outcome.kv_state_bytes == 20 * MIB
    assert budget == env.cudagraph_utils_patch.budget_bytes(outcome.estimate) + 20 * MIB


def test_profile_budget_holds_communicator_workspace_made_after_kv_sizing(
    vllm_env, monkeypatch, caplog
):
    from vllm_specgraph.patches.distributed.device_communicators import (
        flashinfer_pcie_ipc_all_reduce as pcie_ipc,
    )

    env = vllm_env
    monkeypatch.setattr(pcie_ipc, "communicator_bytes_after_kv_cache", lambda runner: 6 * MIB)
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        budget = env.cudagraph_utils.profile_cudagraph_memory(_runner(env))
    assert budget == 46 * MIB, "40 MiB of graphs and the 6 MiB workspace"
    [line] = [r.message for r in caplog.records if "memory profile" in r.message]
    assert "budget 46.0 MiB (with 6.0 MiB of communicator workspace" in line


def test_profile_without_kept_memory_captures_once(vllm_env):
    env = vllm_env
    env.cudagraph_utils.profile_cudagraph_memory(_runner(env))
    assert sum(1 for e in env.events if e[0] == "capture_model") == 1


def test_profile_says_which_bytes_of_its_pass_the_allocator_does_not_hold(vllm_env):
    env = vllm_env
    runner = _runner(env, one_time_bytes=MIB // 2)  # below the second-pass threshold
    env.cudagraph_utils.profile_cudagraph_memory(runner)
    footprint = runner.specgraph_profile.estimate_footprint
    assert footprint == CaptureFootprint(40 * MIB, 0, MIB // 2)
    assert runner.specgraph_profile.to_dict()["estimate_footprint"] == {
        "graph_pool_bytes": 40 * MIB,
        "default_pool_bytes": 0,
        "outside_allocator_bytes": MIB // 2,
    }


@pytest.fixture
def encoder_runner_class():
    """vLLM's encoder-only runner class, imported before ``vllm_env`` stands in for
    the module it imports from."""
    from vllm.v1.worker.mm_encoder_model_runner import MMEncoderModelRunner

    return MMEncoderModelRunner


def test_profile_without_graphs_to_capture_returns_zero_as_vllm_does(
    encoder_runner_class, vllm_env, monkeypatch
):
    """The modes resolved to none once the minimal KV cache exists (vLLM's encoder-only
    runner says so always, with its own ``needs_cudagraph_capture``): no capture runs,
    the pass is torn down, and production's capture is not metered. The rank still
    votes once: ranks that found graphs wait for it."""
    from vllm_specgraph.patches.v1.worker.gpu import cudagraph_utils as patch

    votes = []
    monkeypatch.setattr(patch, "on_any_rank", lambda flag, group: votes.append(flag) or flag)
    env = vllm_env
    runner = _runner(env)
    runner.needs_cudagraph_capture = encoder_runner_class.needs_cudagraph_capture.__get__(runner)
    assert env.cudagraph_utils.profile_cudagraph_memory(runner) == 0
    names = [e[0] for e in env.events]
    assert "minimal_kv" in names and "teardown_profiling_state" in names
    assert "capture_model" not in names
    assert getattr(runner, "specgraph_profile", None) is None
    assert env.platform_cls._global_graph_pool == env.production_pool
    assert votes == [False]


def test_profile_with_graphs_off_returns_at_once_as_vllm_does(vllm_env, monkeypatch):
    """Graphs resolved to none and nothing else to capture: vLLM's own early return,
    before any minimal KV cache, pass or vote (which would run collectives and log
    vLLM's "Skipping capture" warning a second time)."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_specgraph.patches.v1.worker.gpu import cudagraph_utils as patch

    votes = []
    monkeypatch.setattr(patch, "on_any_rank", lambda flag, group: votes.append(flag) or flag)
    runner = _runner(vllm_env)
    runner.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    runner.needs_cudagraph_capture = lambda: False
    assert vllm_env.cudagraph_utils.profile_cudagraph_memory(runner) == 0
    assert vllm_env.events == [] and votes == []
    assert getattr(runner, "specgraph_profile", None) is None


@pytest.mark.parametrize(("other_rank_asks", "passes"), [(False, 1), (True, 2)])
def test_profile_measures_again_on_every_rank_when_any_rank_asks(
    vllm_env, monkeypatch, caplog, other_rank_asks, passes
):
    """This rank's readings need one pass; another rank of vLLM's world group (a
    stand-in: a vote needs several processes) may need two. The vote over the
    group's CPU group decides, before the second pass's collectives run."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    cpu_group = object()
    votes = []

    def all_reduce(tensor, op, group):
        votes.append((int(tensor.item()), op, group))
        tensor.fill_(max(int(tensor.item()), int(other_rank_asks)))

    monkeypatch.setattr(parallel_state, "_WORLD", SimpleNamespace(cpu_group=cpu_group))
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    env = vllm_env
    runner = _runner(env, one_time_bytes=4 * MIB)  # one pass would do, on this rank
    with caplog.at_level("INFO", logger="vllm.specgraph"):
        env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert votes == [(0, dist.ReduceOp.MAX, cpu_group)]
    assert (_captures(env), runner.specgraph_profile.profile_passes) == (passes, passes)
    asked = [r.message for r in caplog.records if "another rank's pass asks" in r.message]
    assert len(asked) == int(other_rank_asks)


def test_profile_first_frees_what_earlier_growth_retired(vllm_env, monkeypatch):
    """No graph exists before the profile, so nothing can read a retired buffer."""
    env = vllm_env
    workspace = env.workspace
    workspace.get_simultaneous(((256,), torch.float32))
    monkeypatch.setattr(workspace, "_is_capturing", lambda: True)  # a stand-in capture
    workspace.get_simultaneous(((256,), torch.float32))
    monkeypatch.setattr(workspace, "_is_capturing", bool)
    workspace.get_simultaneous(((4096,), torch.float32))
    assert workspace.usage()["target"].retired_bytes > 0
    env.cudagraph_utils.profile_cudagraph_memory(_runner(env))
    assert workspace.usage()["target"].retired_bytes == 0


def test_profile_measures_again_when_what_the_pass_left_is_not_all_accounted_for(vllm_env):
    """Left taken, one-time: 4 MiB the owners took outside the allocator, and 8 MiB
    that no owner and no allocator block explains. One pass is exact only within
    1 MiB of the account, so the profile measures again."""
    env = vllm_env
    env.state["kv_driver_only_bytes"] = 8 * MIB
    runner = _runner(env, one_time_bytes=4 * MIB)
    env.cudagraph_utils.profile_cudagraph_memory(runner)
    assert (_captures(env), runner.specgraph_profile.profile_passes) == (2, 2)


def test_profile_captures_vllms_own_piecewise_wrappers_in_its_pool_per_owner(vllm_env):
    """torch.compile's PIECEWISE graphs live in vLLM's own ``CUDAGraphWrapper``s: one
    made before the profile (the compiled backbone's) and one each made while the
    target and the draft capture. Each captures into the profile's private pool;
    afterwards every one holds the production pool and no graph; each owner's
    bytes are its own."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.config.compilation import CUDAGraphMode

    env = vllm_env
    config = SimpleNamespace(compilation_config=SimpleNamespace())
    backbone = CUDAGraphWrapper(lambda: None, config, CUDAGraphMode.PIECEWISE)
    assert backbone.graph_pool == env.production_pool
    pools: dict[str, object] = {}
    made: list[CUDAGraphWrapper] = []

    def capture_piece(owner: str, wrapper: CUDAGraphWrapper) -> None:
        # What the wrapper's own capture reads: its pool, as the profile left it.
        pools[owner] = wrapper.graph_pool
        wrapper.concrete_cudagraph_entries[owner] = SimpleNamespace(cudagraph=object())

    class Speculator(_Speculator):
        def capture(self):
            draft = CUDAGraphWrapper(lambda: None, config, CUDAGraphMode.PIECEWISE)
            made.append(draft)
            capture_piece("draft " + current_owner_name(), draft)
            super().capture()

    class Runner(_Runner):
        def _capture(self, env):
            capture_piece("backbone", backbone)
            target = CUDAGraphWrapper(lambda: None, config, CUDAGraphMode.PIECEWISE)
            made.append(target)
            capture_piece("target " + current_owner_name(), target)
            return super()._capture(env)

    from vllm_specgraph.patches.v1.worker.gpu.model_runner import run_speculator_in_draft_lane

    runner = Runner(env, run_speculator_in_draft_lane(Speculator(env)))
    budget = env.cudagraph_utils.profile_cudagraph_memory(runner)
    private = {pool for pool in pools.values()}
    assert len(private) == 1 and env.production_pool not in private, pools
    assert sorted(pools) == ["backbone", "draft draft", "target target"]
    for wrapper in (backbone, *made):
        assert wrapper.graph_pool == env.production_pool
        assert wrapper.concrete_cudagraph_entries == {}, "the profile's graphs are gone"
    report = runner.specgraph_profile.estimate
    assert [(o.owner, o.num_graphs, o.driver_bytes) for o in report.owners] == [
        ("target", 3, 30 * MIB),
        ("draft", 2, 10 * MIB),
    ]
    assert budget == 40 * MIB


def test_profile_under_capture_once_captures_nothing_and_arms_it(vllm_env, monkeypatch):
    from vllm_specgraph.patches import _capture_once
    from vllm_specgraph.patches.v1.worker.gpu import cudagraph_utils as patch

    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "capture-once")
    monkeypatch.setattr(patch, "capture_once_blocker", lambda runner: None)
    monkeypatch.setattr(_capture_once, "_plan", None)
    runner = _runner(vllm_env)
    assert vllm_env.cudagraph_utils.profile_cudagraph_memory(runner) == 0
    assert _captures(vllm_env) == 0, "no profile capture"
    assert _capture_once.planned_runner() is runner
    assert _capture_once._plan.free_before == vllm_env.state["free"], "read at the profile"
    assert getattr(runner, "specgraph_profile", None) is None


def test_profile_under_capture_once_that_cannot_apply_runs_the_exact_profile(
    vllm_env, monkeypatch, caplog
):
    from vllm_specgraph.patches import _capture_once
    from vllm_specgraph.patches.v1.worker.gpu import cudagraph_utils as patch

    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "capture-once")
    monkeypatch.setattr(patch, "capture_once_blocker", lambda runner: "sleep mode is on")
    monkeypatch.setattr(_capture_once, "_plan", None)
    runner = _runner(vllm_env)
    with caplog.at_level(logging.INFO, logger="vllm.specgraph"):
        assert vllm_env.cudagraph_utils.profile_cudagraph_memory(runner) == 40 * MIB
    assert _captures(vllm_env) == 1
    assert _capture_once.planned_runner() is None
    assert runner.specgraph_capture_once_fallback == "sleep mode is on"
    assert "capture-once falls back to the exact profile: sleep mode is on" in caplog.text
