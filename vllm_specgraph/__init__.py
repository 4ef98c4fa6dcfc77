"""vllm-specgraph: one owner for every CUDA-graph resource in speculative decoding.

The torch-only core (``lanes``, ``channels``, ``capture``, ``profile``, ``allreduce``) never
imports vLLM. :func:`register` is the ``vllm.general_plugins`` entry point
that vLLM calls once per process (API server, engine core, every worker); it
arms the patch set in :mod:`vllm_specgraph.patches`.

Switches (:mod:`vllm_specgraph.switches`, read and checked once by :func:`register`):
``VLLM_SPECGRAPH=0`` leaves vLLM unpatched; ``VLLM_SPECGRAPH_FORCE=1`` patches a vLLM
other than 0.33.x (at your risk); ``VLLM_SPECGRAPH_PROFILE=extrapolate`` keeps vLLM's
own graph-memory estimate; ``VLLM_SPECGRAPH_ALLREDUCE`` (``auto``, ``1``, ``0``)
says when the peer all-reduce serves the TP group. On/off switches accept ``0/1``,
``false/true`` and ``off/on`` in any case.
"""

from __future__ import annotations

import logging

from vllm_specgraph.switches import read_switches, set_current_switches

__all__ = ["SUPPORTED_VLLM_SERIES", "register"]

SUPPORTED_VLLM_SERIES = "0.33"
"""vLLM releases this patch set is written against: 0.33.x, local builds included."""

logger = logging.getLogger("vllm.specgraph")

_patches = None


def _supported(version: str) -> bool:
    release = version.split("+", 1)[0].split(".")
    return ".".join(release[:2]) == SUPPORTED_VLLM_SERIES


def register() -> bool:
    """Entry point for ``vllm.general_plugins``; returns whether the patches are armed.

    Reads and checks the switches first, in every process, so a value they do not
    accept stops start-up here with a ValueError that names it. Idempotent: vLLM
    loads plugins once per process, tests may call it again. An unsupported vLLM
    is left untouched with a warning rather than an error, so a version bump never
    stops a server from starting. A patch that cannot be installed into a module
    already imported (vLLM changed under it) raises, and nothing stays patched: a
    later call tries again rather than report armed. One for a module vLLM imports
    later raises from that import, which then fails.
    """
    global _patches
    switches = read_switches()
    set_current_switches(switches)
    if not switches.enabled:
        logger.info("vllm-specgraph is installed but off (VLLM_SPECGRAPH=0); vLLM runs unpatched")
        return False
    import vllm
    import vllm.logger  # configures the "vllm" logger these lines go through

    version = getattr(vllm, "__version__", "unknown")
    if not _supported(version) and not switches.force:
        logger.warning(
            "vllm-specgraph supports vLLM %s.x but found %s; leaving vLLM unpatched. "
            "Install vllm==%s.* or set VLLM_SPECGRAPH_FORCE=1 to patch anyway.",
            SUPPORTED_VLLM_SERIES,
            version,
            SUPPORTED_VLLM_SERIES,
        )
        return False
    if _patches is None:
        from vllm_specgraph.patches import PATCHES, arm
        from vllm_specgraph.patches._patching import PatchSet, cancel_pending

        patches = PatchSet()
        try:
            arm(patches)
        except BaseException:
            cancel_pending()
            patches.undo()
            raise
        _patches = patches
        symbols = [f"{p.vllm_module}.{s}" for p in PATCHES for s in p.symbols]
        logger.info(
            "vllm-specgraph armed for vLLM %s%s: %s (each installed when vLLM imports its module)",
            version,
            " (forced)" if switches.force else "",
            ", ".join(symbols),
        )
    return True
