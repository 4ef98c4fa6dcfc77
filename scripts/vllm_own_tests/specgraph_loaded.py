# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (``-p specgraph_loaded``): vllm-specgraph armed before any test
imports vLLM, as vLLM's plugin loader arms it in every process."""

import vllm_specgraph


def pytest_configure(config: object) -> None:
    assert vllm_specgraph.register(), "vllm-specgraph did not arm"
