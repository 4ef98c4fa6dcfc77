"""Byte-address spans of tensors: which memory do two views, buffers or graphs share?

Torch only; used by the lane self-check and the tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from vllm_specgraph._checks import check_instance, check_int

__all__ = ["Span", "overlapping_pairs", "spans_overlap", "tensor_span"]

Span = tuple[int, int]
"""``(start, end)`` byte addresses, end exclusive."""

_SPAN_FIX = "pass (start, end) byte addresses, start <= end, e.g. tensor_span(t)"


def tensor_span(tensor: torch.Tensor) -> Span:
    """The bytes a contiguous tensor covers. Raises ValueError for a strided view."""
    check_instance("tensor", tensor, torch.Tensor, "pass a contiguous tensor")
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
            "contiguous, so its bytes are not one span; pass a contiguous view"
        )
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _checked(name: str, span: object) -> Span:
    """``span`` as a pair of plain ints, else raise naming it."""
    try:
        start, end = span  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a (start, end) pair, got {span!r} ({type(span).__name__}); {_SPAN_FIX}"
        ) from None
    start = check_int(f"{name}[0]", start, 0, _SPAN_FIX)
    end = check_int(f"{name}[1]", end, 0, _SPAN_FIX)
    if end < start:
        raise ValueError(f"{name} ends before it starts, got {span!r}; {_SPAN_FIX}")
    return start, end


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def spans_overlap(a: Span, b: Span) -> bool:
    """Whether ``a`` and ``b`` share at least one byte (an empty span shares none)."""
    return _overlap(_checked("a", a), _checked("b", b))


def overlapping_pairs(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of the spans that overlap; empty if all are disjoint."""
    if isinstance(spans, str | bytes) or not isinstance(spans, Iterable):
        raise TypeError(
            f"spans must be a sequence of (start, end) pairs, got {spans!r} "
            f"({type(spans).__name__}); pass e.g. [tensor_span(t) for t in tensors]"
        )
    checked = [_checked(f"spans[{i}]", span) for i, span in enumerate(spans)]
    return [
        (i, j)
        for i in range(len(checked))
        for j in range(i + 1, len(checked))
        if _overlap(checked[i], checked[j])
    ]
