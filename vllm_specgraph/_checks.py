"""Argument checks shared by the core modules: type first, then range, naming the fix."""

from __future__ import annotations

import operator

__all__ = ["check_bool", "check_callable", "check_instance", "check_int", "check_str"]


def check_int(name: str, value: object, minimum: int, fix: str) -> int:
    """``value`` as a plain int (torch and slot keys take nothing else)."""
    # Type before range: "'<=' not supported between 'str' and 'int'" names nothing.
    # Any integer type counts (numpy's too), as everywhere in this package; bool does not.
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}); {fix}")
    index = operator.index(value)
    if index < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}")
    return index


def check_str(name: str, value: object, fix: str) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{name} must be a non-empty str, got {value!r} ({type(value).__name__}); {fix}"
        )


def check_bool(name: str, value: object, fix: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}); {fix}")


def check_callable(name: str, value: object, fix: str) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r} ({type(value).__name__}); {fix}")


def check_instance(name: str, value: object, expected: type, fix: str) -> None:
    if not isinstance(value, expected):
        raise TypeError(
            f"{name} must be a {expected.__name__}, got {value!r} ({type(value).__name__}); {fix}"
        )
