"""The plugin entry point, loaded the way vLLM 0.33.0 loads it."""

import logging

import pytest

import vllm_specgraph

pytestmark = pytest.mark.vllm


def test_load_plugins_by_group_finds_register():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("specgraph") is vllm_specgraph.register


def test_register_supported_version_returns_true(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_specgraph"):
        assert vllm_specgraph.register() is True
    assert "loaded for vLLM 0.33.0" in caplog.text


def test_register_other_version_warns_and_returns_false(monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger="vllm_specgraph"):
        assert vllm_specgraph.register() is False
    assert "supports vLLM 0.33.0 but found 0.34.0" in caplog.text
    assert "Install vllm==0.33.0" in caplog.text
