"""The plugin's switches: four environment variables, read and checked once per process.

:func:`~vllm_specgraph.register` reads them (:func:`read_switches`) in every
process vLLM loads it in, before anything is patched, so a misspelt value stops
start-up with an error that names the variable, the value and what it accepts,
rather than arming the patches silently or failing later inside a worker. The
patches then ask :func:`current_switches`, never the environment.

Imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from vllm_specgraph._checks import check_bool, check_choice, check_instance

__all__ = [
    "ALLREDUCE_MODES",
    "BOOLEAN_SPELLINGS",
    "PROFILE_MODES",
    "Switches",
    "current_switches",
    "read_switches",
    "set_current_switches",
]

BOOLEAN_SPELLINGS: Mapping[str, bool] = {
    "1": True,
    "true": True,
    "on": True,
    "0": False,
    "false": False,
    "off": False,
}
"""What an on/off switch accepts, in any case."""

PROFILE_MODES = ("exact", "extrapolate", "capture-once")
"""``VLLM_SPECGRAPH_PROFILE``: the plugin's exact profile (default), vLLM's estimate, or
no profile: the KV cache backed after the production capture."""

ALLREDUCE_MODES = ("auto", "1", "0")
"""``VLLM_SPECGRAPH_ALLREDUCE``: where vLLM has no fast path, always, never."""


@dataclass(frozen=True)
class Switches:
    """The switches' values; the defaults are the plugin's behaviour when none is set.

    Attributes:
        enabled: ``VLLM_SPECGRAPH``; off leaves vLLM unpatched.
        force: ``VLLM_SPECGRAPH_FORCE``; patch a vLLM other than the supported series.
        profile: ``VLLM_SPECGRAPH_PROFILE``, one of :data:`PROFILE_MODES`.
        allreduce: ``VLLM_SPECGRAPH_ALLREDUCE``, one of :data:`ALLREDUCE_MODES`.
    """

    enabled: bool = True
    force: bool = False
    profile: str = "exact"
    allreduce: str = "auto"

    def __post_init__(self) -> None:
        check_bool("Switches.enabled", self.enabled, "pass True or False")
        check_bool("Switches.force", self.force, "pass True or False")
        check_choice("Switches.profile", self.profile, PROFILE_MODES, "see PROFILE_MODES")
        check_choice("Switches.allreduce", self.allreduce, ALLREDUCE_MODES, "see ALLREDUCE_MODES")


V = TypeVar("V")


def _choice(environ: Mapping[str, str], name: str, allowed: Mapping[str, V], default: V) -> V:
    raw = environ.get(name)
    if raw is None:
        return default
    if not isinstance(raw, str):
        raise TypeError(
            f"{name}={raw!r} ({type(raw).__name__}) is not a str, as environment values are; "
            f"use one of {sorted(set(allowed))} (any case), or unset it"
        )
    value = allowed.get(raw.lower())
    if value is None:
        raise ValueError(
            f"{name}={raw!r} is not a value it accepts; use one of {sorted(set(allowed))} "
            "(any case), or unset it"
        )
    return value


def read_switches(environ: Mapping[str, str] | None = None) -> Switches:
    """The switches as ``environ`` (the process environment by default) sets them.

    Raises ValueError naming the first variable whose value is not accepted, the
    value, and the accepted set. Reads nothing else and changes nothing.
    """
    environ = os.environ if environ is None else environ
    check_instance("environ", environ, Mapping, "pass a mapping of variable names to values")
    on_off = {spelling: "1" if on else "0" for spelling, on in BOOLEAN_SPELLINGS.items()}
    return Switches(
        enabled=_choice(environ, "VLLM_SPECGRAPH", BOOLEAN_SPELLINGS, True),
        force=_choice(environ, "VLLM_SPECGRAPH_FORCE", BOOLEAN_SPELLINGS, False),
        profile=_choice(environ, "VLLM_SPECGRAPH_PROFILE", {m: m for m in PROFILE_MODES}, "exact"),
        allreduce=_choice(environ, "VLLM_SPECGRAPH_ALLREDUCE", {"auto": "auto", **on_off}, "auto"),
    )


_current: Switches | None = None


def set_current_switches(switches: Switches | None) -> None:
    """Make ``switches`` what :func:`current_switches` returns (None: read the environment)."""
    global _current
    if switches is not None:
        check_instance("switches", switches, Switches, "pass read_switches()'s result, or None")
    _current = switches


def current_switches() -> Switches:
    """The switches :func:`~vllm_specgraph.register` read for this process.

    Before it ran (a patch installed by hand, in a test, say) they are read from
    the environment at each call, with the same checks.
    """
    return _current if _current is not None else read_switches()
