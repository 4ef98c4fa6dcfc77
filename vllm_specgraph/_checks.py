"""Argument checks shared by the core modules: type first, then range, naming the fix.

Torch is imported only by the checks that need it, so that a torch-free module
(the switches) can use the others.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_device",
    "check_instance",
    "check_int",
    "check_items",
    "check_pool_handle",
    "check_str",
]

_T = TypeVar("_T")


def _got(value: object) -> str:
    return f"got {value!r} ({type(value).__name__})"


def check_int(name: str, value: object, minimum: int, fix: str) -> int:
    """``value`` as a plain int (torch and slot keys take nothing else)."""
    # Type before range: "'<=' not supported between 'str' and 'int'" names nothing.
    # Any integer type counts (numpy's too), as everywhere in this package; bool does not.
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, {_got(value)}; {fix}")
    index = operator.index(value)
    if index < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}")
    return index


def check_str(name: str, value: object, fix: str) -> None:
    """A str (TypeError otherwise) that is not empty (ValueError)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a non-empty str, {_got(value)}; {fix}")
    if not value:
        raise ValueError(f"{name} must be a non-empty str, got ''; {fix}")


def check_choice(name: str, value: object, allowed: Collection[str], fix: str) -> None:
    """One of the strs ``allowed`` (TypeError for another type, ValueError for another str)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {sorted(allowed)}, {_got(value)}; {fix}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}; {fix}")


def check_bool(name: str, value: object, fix: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, {_got(value)}; {fix}")


def check_callable(name: str, value: object, fix: str) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be callable, {_got(value)}; {fix}")


def check_instance(name: str, value: object, expected: type, fix: str) -> None:
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be a {expected.__name__}, {_got(value)}; {fix}")


def check_items(name: str, value: object, expected: type[_T], fix: str) -> tuple[_T, ...]:
    """The items of an iterable of ``expected``, as a tuple (an iterator is read once, here).

    A single ``expected``, a str or bytes is no such iterable (TypeError), nor is an item
    of another type (TypeError naming its index).
    """
    if isinstance(value, expected | str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of {expected.__name__}, {_got(value)}; {fix}")
    items = tuple(value)
    for i, item in enumerate(items):
        check_instance(f"{name}[{i}]", item, expected, fix)
    return items


def check_device(name: str, value: object, fix: str) -> torch.device:
    """``value`` as a torch.device: a torch.device, a str such as ``"cuda:0"``, or an int index.

    An int (numpy's too) is what torch makes of it: that accelerator's device. A bool
    is no device index.
    """
    import torch

    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not (isinstance(value, str) or hasattr(type(value), "__index__")):
        raise TypeError(
            f"{name} must be a torch.device, a str such as 'cuda:0' or an int device index, "
            f"{_got(value)}; {fix}"
        )
    try:
        return torch.device(value if isinstance(value, str) else operator.index(value))
    except RuntimeError as error:  # torch's words for a bad string or index
        raise ValueError(
            f"{name} {value!r} is not a device torch can use ({error}); {fix}"
        ) from None


def check_pool_handle(name: str, value: object, fix: str) -> tuple[int, int]:
    """A CUDA graph memory pool handle, ``torch.cuda.graph_pool_handle()``'s pair of ints."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{name} must be a pool handle, a pair of ints, {_got(value)}; {fix}")
    return check_int(f"{name}[0]", value[0], 0, fix), check_int(f"{name}[1]", value[1], 0, fix)
