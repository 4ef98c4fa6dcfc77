"""The plugin entry point, loaded the way vLLM 0.33.0 loads it."""

import importlib
import logging
import re

import pytest

import vllm_specgraph
from vllm_specgraph import switches
from vllm_specgraph.patches import PATCHES

SWITCHES = (
    "VLLM_SPECGRAPH",
    "VLLM_SPECGRAPH_FORCE",
    "VLLM_SPECGRAPH_PROFILE",
    "VLLM_SPECGRAPH_ALLREDUCE",
)

pytestmark = pytest.mark.vllm


@pytest.fixture
def fresh_plugin(monkeypatch):
    """register() as in a new process; every patch it makes is undone afterwards.

    The patched modules are imported first, so register() installs into them
    at once instead of leaving import hooks behind for later tests.
    """
    for patch in PATCHES:
        importlib.import_module(patch.vllm_module)
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(vllm_specgraph, "_patches", None)
    monkeypatch.setattr(switches, "_current", None)
    yield
    if vllm_specgraph._patches is not None:
        vllm_specgraph._patches.undo()


def test_load_plugins_by_group_finds_register():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("specgraph") is vllm_specgraph.register


def test_load_general_plugins_patches_vllm_and_logs_through_vllm_logger(
    fresh_plugin, monkeypatch, capsys
):
    import vllm.plugins
    import vllm.v1.worker.workspace as workspace
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    monkeypatch.setenv("VLLM_PLUGINS", "specgraph")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    configure_logging(LoggingConfig())  # vLLM's handler writes to the captured stdout
    vllm.plugins.load_general_plugins()
    line = next(x for x in capsys.readouterr().out.splitlines() if "vllm-specgraph armed" in x)
    assert "INFO" in line and "[__init__.py" in line, f"not vLLM's log format: {line}"
    for patch in PATCHES:
        for symbol in patch.symbols:
            assert f"{patch.vllm_module}.{symbol}" in line
    assert workspace.WorkspaceManager.__module__.startswith("vllm_specgraph")
    assert len(vllm_specgraph._patches.names) >= sum(len(p.symbols) for p in PATCHES)


@pytest.mark.parametrize("version", ["0.33.0", "0.33.2", "0.33.0+cu129", "0.33.1rc1"])
def test_register_supported_versions_arm_the_patches(fresh_plugin, monkeypatch, version):
    import vllm
    import vllm.v1.worker.workspace as workspace

    monkeypatch.setattr(vllm, "__version__", version)
    assert vllm_specgraph.register() is True
    assert workspace.WorkspaceManager.__module__.startswith("vllm_specgraph")
    assert vllm_specgraph.register() is True, "a second call is a no-op"


@pytest.mark.parametrize("version", ["0.34.0", "0.3.3", "0.32.9", "unknown"])
def test_register_other_version_warns_and_patches_nothing(
    fresh_plugin, monkeypatch, caplog, version
):
    import vllm
    import vllm.v1.worker.workspace as workspace

    original = workspace.WorkspaceManager
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="vllm.specgraph"):
        assert vllm_specgraph.register() is False
    assert f"supports vLLM 0.33.x but found {version}" in caplog.text
    assert "VLLM_SPECGRAPH_FORCE=1" in caplog.text
    assert workspace.WorkspaceManager is original


def test_register_force_patches_other_version(fresh_plugin, monkeypatch):
    import vllm
    import vllm.v1.worker.workspace as workspace

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setenv("VLLM_SPECGRAPH_FORCE", "1")
    assert vllm_specgraph.register() is True
    assert workspace.WorkspaceManager.__module__.startswith("vllm_specgraph")


def test_register_off_switch_patches_nothing(fresh_plugin, monkeypatch, caplog):
    import vllm.v1.worker.gpu.model_runner as model_runner
    import vllm.v1.worker.workspace as workspace

    before = (workspace.WorkspaceManager, model_runner._profile_cudagraph_memory)
    monkeypatch.setenv("VLLM_SPECGRAPH", "0")
    with caplog.at_level(logging.INFO, logger="vllm.specgraph"):
        assert vllm_specgraph.register() is False
    assert "VLLM_SPECGRAPH=0" in caplog.text
    assert (workspace.WorkspaceManager, model_runner._profile_cudagraph_memory) == before
    assert vllm_specgraph._patches is None


@pytest.mark.parametrize("spelling", ["0", "false", "OFF", "False", "off"])
def test_register_off_switch_accepts_every_off_spelling(fresh_plugin, monkeypatch, spelling):
    monkeypatch.setenv("VLLM_SPECGRAPH", spelling)
    assert vllm_specgraph.register() is False
    assert vllm_specgraph._patches is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("VLLM_SPECGRAPH", "no"),
        ("VLLM_SPECGRAPH", ""),
        ("VLLM_SPECGRAPH", " 0"),
        ("VLLM_SPECGRAPH_FORCE", "yes"),
        ("VLLM_SPECGRAPH_PROFILE", "foo"),
        ("VLLM_SPECGRAPH_ALLREDUCE", "yes"),
    ],
)
def test_register_refuses_a_switch_value_it_does_not_accept_and_patches_nothing(
    fresh_plugin, monkeypatch, name, value
):
    import vllm.v1.worker.workspace as workspace

    original = workspace.WorkspaceManager
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}={value!r} is not a value it accepts") as err:
        vllm_specgraph.register()
    assert "use one of" in str(err.value) and "or unset it" in str(err.value)
    assert workspace.WorkspaceManager is original and vllm_specgraph._patches is None


def test_register_reads_the_switches_once(fresh_plugin, monkeypatch):
    from vllm_specgraph.patches.distributed.device_communicators import cuda_communicator
    from vllm_specgraph.patches.v1.worker.gpu import cudagraph_utils

    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "Extrapolate")
    monkeypatch.setenv("VLLM_SPECGRAPH_ALLREDUCE", "ON")
    monkeypatch.setenv("VLLM_SPECGRAPH_FORCE", "true")
    assert vllm_specgraph.register() is True
    # A later change to the environment (a worker's own, say) changes nothing.
    monkeypatch.setenv("VLLM_SPECGRAPH_PROFILE", "not read again")
    assert cudagraph_utils.profile_mode() == "extrapolate"
    assert cuda_communicator.allreduce_mode() == "1"
    assert switches.current_switches() == switches.Switches(
        enabled=True, force=True, profile="extrapolate", allreduce="1"
    )


def test_register_after_a_failed_arm_does_not_report_armed(fresh_plugin, monkeypatch):
    """A vLLM whose signature changed under one patch: register() raises, every patch
    it made before is undone, and a second call raises again rather than report armed."""
    import vllm.v1.worker.gpu.model_runner as model_runner
    import vllm.v1.worker.workspace as workspace

    original = workspace.WorkspaceManager

    def init_speculator(config, device):  # vLLM's takes (vllm_config, device, req_states)
        raise AssertionError("never called")

    monkeypatch.setattr(model_runner, "init_speculator", init_speculator)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="init_speculator: its signature lacks"):
            vllm_specgraph.register()
        assert vllm_specgraph._patches is None
        assert workspace.WorkspaceManager is original
        assert model_runner.init_speculator is init_speculator


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("enabled", "no", TypeError, "Switches.enabled must be a bool, got 'no'"),
        ("enabled", 1, TypeError, "Switches.enabled must be a bool, got 1"),
        ("force", None, TypeError, "Switches.force must be a bool, got None"),
        (
            "profile",
            "foo",
            ValueError,
            r"Switches.profile must be one of \['capture-once', 'exact', 'extrapolate'\]",
        ),
        ("profile", None, TypeError, "Switches.profile must be a str, one of"),
        ("allreduce", "yes", ValueError, r"Switches.allreduce must be one of \['0', '1', 'auto'\]"),
        ("allreduce", 1, TypeError, "Switches.allreduce must be a str, one of"),
    ],
)
def test_switches_refuse_a_value_no_variable_could_set(field, value, error, match):
    with pytest.raises(error, match=match):
        switches.Switches(**{field: value})


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ([("VLLM_SPECGRAPH", "1")], "environ must be a Mapping, got"),
        ({"VLLM_SPECGRAPH": 1}, r"VLLM_SPECGRAPH=1 \(int\) is not a str"),
        (
            {"VLLM_SPECGRAPH_PROFILE": b"exact"},
            r"VLLM_SPECGRAPH_PROFILE=b'exact' \(bytes\) is not a str",
        ),
    ],
)
def test_read_switches_from_no_environment_names_what_is_wrong(environ, match):
    with pytest.raises(TypeError, match=match):
        switches.read_switches(environ)


@pytest.mark.parametrize("value", ["yes", {"enabled": True}, True])
def test_set_current_switches_refuses_what_is_no_switches_and_keeps_the_current(monkeypatch, value):
    current = switches.Switches(force=True)
    monkeypatch.setattr(switches, "_current", current)
    with pytest.raises(
        TypeError, match=f"switches must be a Switches, got {re.escape(repr(value))}"
    ):
        switches.set_current_switches(value)
    assert switches.current_switches() is current
