"""Whether the current code runs inside a model runner's ``profile_run``.

vLLM's memory profile is the runner's ``profile_run``: a dummy run whose peak
sizes the KV cache. Patches that make the profile hold memory a path needs
later must act there only; a forward without attention metadata also happens
in the V1 runner's warm-up and capture runs and on an idle data-parallel
rank's dummy batches, where such a reservation would only cost time.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

__all__ = ["in_profile_run", "wrap_profile_run"]

_in_profile_run: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "specgraph_in_profile_run", default=False
)


def in_profile_run() -> bool:
    """True inside a runner's ``profile_run`` (a wrapped one)."""
    return _in_profile_run.get()


def wrap_profile_run(original: Callable) -> Callable:
    """``original`` (a runner's ``profile_run``), run with :func:`in_profile_run` true."""

    @functools.wraps(original)
    def profile_run(self, *args, **kwargs):
        token = _in_profile_run.set(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _in_profile_run.reset(token)

    return profile_run
