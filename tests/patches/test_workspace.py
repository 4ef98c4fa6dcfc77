"""The workspace patch on vLLM 0.33.0's own workspace module (CPU tensors)."""

import threading

import pytest
import torch

from vllm_specgraph.lanes import LaneWorkspace

pytestmark = pytest.mark.vllm


@pytest.fixture
def workspace(install_patch):
    module = install_patch("vllm.v1.worker.workspace")
    saved = module._manager
    yield module
    module._manager = saved


def test_init_workspace_manager_builds_the_core_workspace_with_vllm_arguments(workspace):
    workspace.init_workspace_manager(torch.device("cpu"), None, 2)
    manager = workspace.current_workspace_manager()
    assert isinstance(manager, LaneWorkspace)
    assert (manager.num_ubatches, manager.num_lanes) == (1, 2)
    assert manager.owner_lanes == {"target": 0, "draft": 1}


def test_use_workspace_lane_selects_the_core_lane_and_growth_retires(workspace, monkeypatch):
    workspace.init_workspace_manager(torch.device("cpu"), 1, 2)
    manager = workspace.current_workspace_manager()
    (target,) = manager.get_simultaneous(((64,), torch.float32))
    with workspace.use_workspace_lane(1):
        manager.get_simultaneous(((64,), torch.float32))
        # A draft graph takes a view (a stand-in for a capture, which needs a GPU).
        monkeypatch.setattr(manager, "_is_capturing", lambda: True)
        (draft,) = manager.get_simultaneous(((64,), torch.float32))
        monkeypatch.setattr(manager, "_is_capturing", bool)
        (grown,) = manager.get_simultaneous(((4096,), torch.float32))
    assert target.data_ptr() != draft.data_ptr()
    assert manager.usage()["draft"].retired_bytes > 0, "vLLM freed here; the core retires"
    assert grown.numel() == 4096
    manager.get_simultaneous(((4096,), torch.float32))
    assert manager.usage()["target"].retired_bytes == 0, "no graph viewed it: freed, as vLLM"


def test_lane_beyond_configured_raises_naming_the_fix(workspace):
    workspace.init_workspace_manager(torch.device("cpu"), 1, 1)
    manager = workspace.current_workspace_manager()
    with workspace.use_workspace_lane(1), pytest.raises(RuntimeError, match="num_lanes>=2"):
        manager.get_simultaneous(((4,), torch.float32))


def test_ubatch_slot_follows_vllm_dbo_context(workspace, monkeypatch):
    import vllm.v1.worker.ubatching as ubatching

    workspace.init_workspace_manager(torch.device("cpu"), 2, 1)
    manager = workspace.current_workspace_manager()
    (first,) = manager.get_simultaneous(((64,), torch.float32))
    # What vLLM's ubatch context records for a micro-batch thread it registers.
    monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 1)
    (second,) = manager.get_simultaneous(((64,), torch.float32))
    assert first.data_ptr() != second.data_ptr()


def test_lock_workspace_then_growth_raises_assertion_like_vllm(workspace):
    workspace.init_workspace_manager(torch.device("cpu"), 1, 1)
    workspace.current_workspace_manager().get_simultaneous(((8,), torch.float32))
    workspace.lock_workspace()
    assert workspace.current_workspace_manager().is_locked()
    # Named by the caller's place, past the manager's own frames (its subclass's too).
    caller = r"locked but allocation from '[^']*test_workspace\.py"
    with pytest.raises(AssertionError, match=caller):
        workspace.current_workspace_manager().get_simultaneous(((1024,), torch.float32))


def test_undo_restores_vllm_manager_and_lane_selector(install_patch):
    import vllm.v1.worker.workspace as module

    original = (module.WorkspaceManager, module.use_workspace_lane)
    from vllm_specgraph.patches._patching import PatchSet
    from vllm_specgraph.patches.v1.worker.workspace import install

    patches = PatchSet()
    install(patches, module)
    assert module.WorkspaceManager is not original[0]
    patches.undo()
    assert (module.WorkspaceManager, module.use_workspace_lane) == original


def test_manager_keeps_vllms_ubatch_lookup_attributes_and_messages(workspace, monkeypatch):
    """What vLLM's own tests of its manager read: the ubatch through its workspace
    module (replaced there, it is replaced here), ``_current_workspaces`` in its
    order (``ubatch * num_lanes + lane``), and its errors' opening words."""
    manager = workspace.WorkspaceManager(torch.device("cpu"), num_ubatches=2, num_lanes=2)
    ubatch = [0]
    monkeypatch.setattr(workspace, "dbo_current_ubatch_id", lambda: ubatch[0])  # looked up late
    assert manager._current_workspaces == [None] * 4
    manager.get_simultaneous(((512,), torch.uint8))
    ubatch[0] = 1
    with workspace.use_workspace_lane(1):
        manager.get_simultaneous(((256,), torch.uint8))
    sizes = [None if b is None else b.numel() for b in manager._current_workspaces]
    assert sizes == [512, None, None, 256]
    with pytest.raises(ValueError, match="non-negative"), workspace.use_workspace_lane(-1):
        pass
    with pytest.raises(ValueError, match="at least one"):
        workspace.WorkspaceManager(torch.device("cpu"), num_lanes=0)
    manager.lock()
    with pytest.raises(AssertionError, match="was not allocated during warmup"):
        manager.get_persistent_resource("new", object)
    with pytest.raises(AssertionError, match="Workspace is locked but allocation from"):
        manager.get_simultaneous(((4096,), torch.uint8))


def test_vllm_debug_workspace_logs_growth_lock_and_unlock_as_vllm_does(workspace, monkeypatch):
    import logging

    from vllm import envs

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    workspace.logger.addHandler(handler)
    level = workspace.logger.level
    workspace.logger.setLevel(logging.INFO)
    try:
        manager = workspace.WorkspaceManager(torch.device("cpu"))
        manager.get_simultaneous(((1024,), torch.uint8))
        assert records == [], "quiet unless asked"
        monkeypatch.setattr(envs, "VLLM_DEBUG_WORKSPACE", True)
        manager.get_simultaneous(((2 << 20,), torch.uint8))
        manager.lock()
        manager.unlock()
    finally:
        workspace.logger.removeHandler(handler)
        workspace.logger.setLevel(level)
    resized, locked, unlocked = records
    assert resized.startswith("[WORKSPACE DEBUG] Resized workspace from 'test_workspace.py:")
    assert resized.endswith(": 0.00 MB -> 2.00 MB (ubatch 0, lane 0)")
    assert locked == "[WORKSPACE DEBUG] Workspace locked. Current sizes: [2.0]"
    assert unlocked == "[WORKSPACE DEBUG] Workspace unlocked. Current sizes: [2.0]"
