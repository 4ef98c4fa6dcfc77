"""Checked, undoable replacement of names in vLLM, applied when vLLM imports a module.

vLLM offers no callbacks for the internals this plugin changes, so each patch
rebinds a name where vLLM looks it up (several names are imported by value,
so the importing module is patched too). :class:`PatchSet` checks that every
target exists with the parameters the replacement relies on, so a vLLM
upgrade fails loudly at start-up instead of silently running unpatched code.
:func:`when_imported` defers a patch until vLLM imports its module, so a
process that never loads the GPU worker (the API server) never imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

__all__ = ["PatchSet", "cancel_pending", "when_imported"]


class PatchSet:
    """The replacements made so far, in order, so that :meth:`undo` can restore them."""

    def __init__(self) -> None:
        self._made: list[tuple[object, str, object, bool]] = []

    @property
    def names(self) -> tuple[str, ...]:
        """``module.name`` or ``module.Class.name`` of every replacement made."""
        return tuple(_qualified(owner, name) for owner, name, _, _ in self._made)

    def replace(
        self,
        owner: ModuleType | type,
        name: str,
        new: object,
        *,
        parameters: Iterable[str] = (),
    ) -> object:
        """Rebind ``owner.name`` to ``new``; returns the original.

        ``parameters``: names the original must accept (the replacement passes
        them through). Raises RuntimeError naming the target and the fix when
        the target is missing or its signature changed.
        """
        return self.wrap(owner, name, lambda original: new, parameters=parameters)

    def wrap(
        self,
        owner: ModuleType | type,
        name: str,
        make_wrapper: Callable[[Any], object],
        *,
        parameters: Iterable[str] = (),
    ) -> object:
        """Rebind ``owner.name`` to ``make_wrapper(original)``; returns the original.

        The original is checked as :meth:`replace` checks it before the wrapper is made.
        """
        present = name in vars(owner)
        original = vars(owner).get(name) if present else getattr(owner, name, None)
        if original is None:
            raise RuntimeError(
                f"vllm-specgraph cannot patch {_qualified(owner, name)}: it does not exist "
                "in this vLLM; use the vLLM version this plugin supports, or set "
                "VLLM_SPECGRAPH=0 to run without the plugin"
            )
        wanted = tuple(parameters)
        if wanted:
            accepted = inspect.signature(original).parameters
            missing = [p for p in wanted if p not in accepted]
            if missing:
                raise RuntimeError(
                    f"vllm-specgraph cannot patch {_qualified(owner, name)}: its signature "
                    f"lacks {missing}; this vLLM is not the one the plugin supports "
                    "(set VLLM_SPECGRAPH=0 to run without it)"
                )
        setattr(owner, name, make_wrapper(original))
        self._made.append((owner, name, original, present))
        return original

    def undo(self) -> None:
        """Restore every replaced name, newest first."""
        while self._made:
            owner, name, original, present = self._made.pop()
            if present:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _qualified(owner: object, name: str) -> str:
    if isinstance(owner, ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


class _RunAfterExec(importlib.abc.Loader):
    """The module's own loader, with callbacks run once after the module body."""

    def __init__(self, name: str, loader: importlib.abc.Loader, callbacks: list[Callable]) -> None:
        self._name = name
        self._loader = loader
        self._callbacks = callbacks

    def __getattr__(self, name: str) -> object:
        # get_source, get_filename, is_package, ...: tracebacks and inspect use them.
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        callbacks, self._callbacks = self._callbacks, []  # a reload must not patch twice
        try:
            self._loader.exec_module(module)
            for callback in callbacks:
                callback(module)
        except BaseException:
            # The import fails; the next attempt must patch again, not load unpatched.
            _finder.pending.setdefault(self._name, [])[:0] = callbacks
            raise


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Hands the real loader of a watched module a list of callbacks to run after it."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._searching = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending or getattr(self._searching, "name", None) == fullname:
            return None
        self._searching.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RunAfterExec(fullname, spec.loader, self.pending.pop(fullname))
        return spec


_finder = _PostImportFinder()


def cancel_pending() -> None:
    """Forget every callback :func:`when_imported` still holds for a module not yet imported."""
    _finder.pending.clear()


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is).

    The callback runs right after the module body, before the importer sees
    the module, so names it rebinds are in place before anyone imports them.
    """
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.pending.setdefault(module_name, []).append(callback)
