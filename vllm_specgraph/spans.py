"""Byte-address spans of tensors: which memory do two views, buffers or graphs share?

Torch only; used by the lane self-check and the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Span", "overlapping_pairs", "spans_overlap", "tensor_span"]

Span = tuple[int, int]
"""``(start, end)`` byte addresses, end exclusive."""


def tensor_span(tensor: torch.Tensor) -> Span:
    """The bytes a contiguous tensor covers. Raises ValueError for a strided view."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
            "contiguous, so its bytes are not one span; pass a contiguous view"
        )
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def spans_overlap(a: Span, b: Span) -> bool:
    """Whether ``a`` and ``b`` share at least one byte (an empty span shares none)."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def overlapping_pairs(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of the spans that overlap; empty if all are disjoint."""
    return [
        (i, j)
        for i in range(len(spans))
        for j in range(i + 1, len(spans))
        if spans_overlap(spans[i], spans[j])
    ]
