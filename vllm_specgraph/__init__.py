"""vllm-specgraph: one owner for every CUDA-graph resource in speculative decoding.

The torch-only core (``lanes``, ``channels``, ``profile``) never imports vLLM.
:func:`register` is the ``vllm.general_plugins`` entry point that vLLM calls
once per process (API server, engine core, every worker).
"""

from __future__ import annotations

import logging

__all__ = ["SUPPORTED_VLLM_VERSION", "register"]

SUPPORTED_VLLM_VERSION = "0.33.0"

logger = logging.getLogger(__name__)


def register() -> bool:
    """Entry point for ``vllm.general_plugins``; returns whether this vLLM is supported.

    An unsupported vLLM is left untouched with a warning rather than an error,
    so a version bump never stops a server from starting unpatched.
    """
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if version != SUPPORTED_VLLM_VERSION:
        logger.warning(
            "vllm-specgraph supports vLLM %s but found %s; leaving vLLM unpatched. "
            "Install vllm==%s or a vllm-specgraph release built for %s.",
            SUPPORTED_VLLM_VERSION,
            version,
            SUPPORTED_VLLM_VERSION,
            version,
        )
        return False
    logger.info("vllm-specgraph loaded for vLLM %s", version)
    return True
