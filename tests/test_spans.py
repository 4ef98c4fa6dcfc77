"""CPU tests for vllm_specgraph.spans."""

import re

import numpy as np
import pytest
import torch

from vllm_specgraph.spans import overlapping_pairs, spans_overlap, tensor_span


def test_tensor_span_covers_exactly_the_views_bytes():
    base = torch.zeros(64, dtype=torch.float32)
    start = base.data_ptr()
    assert tensor_span(base[4:12]) == (start + 16, start + 48)
    assert tensor_span(base.view(torch.uint8)[1:3]) == (start + 1, start + 3)


def test_tensor_span_strided_view_raises_value_error():
    with pytest.raises(ValueError, match="not contiguous"):
        tensor_span(torch.zeros(4, 4)[:, 1])


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 10), (10, 20), False),  # touching is not sharing
        ((0, 10), (9, 20), True),
        ((5, 6), (0, 100), True),
        ((5, 5), (0, 100), False),  # an empty span shares nothing
    ],
)
def test_spans_overlap_boundaries(a, b, expected):
    assert spans_overlap(a, b) is expected
    assert spans_overlap(b, a) is expected


def test_overlapping_pairs_names_each_overlapping_pair_once():
    assert overlapping_pairs([(0, 4), (4, 8), (8, 12)]) == []
    assert overlapping_pairs([(0, 4), (2, 10), (8, 12)]) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("tensor", [None, [1, 2], b"\0\0"])
def test_tensor_span_of_no_tensor_names_it(tensor):
    with pytest.raises(TypeError, match=f"tensor must be a Tensor, got {re.escape(repr(tensor))}"):
        tensor_span(tensor)


@pytest.mark.parametrize(
    ("a", "error", "match"),
    [
        (None, TypeError, "a must be a .start, end. pair, got None"),
        ((5,), TypeError, r"a must be a .start, end. pair, got \(5,\)"),
        ((0, 1, 2), TypeError, r"a must be a .start, end. pair, got \(0, 1, 2\)"),
        ((0.5, 2), TypeError, r"a\[0\] must be an int, got 0.5"),
        ((False, True), TypeError, r"a\[0\] must be an int, got False"),
        ((-4, 4), ValueError, r"a\[0\] must be >= 0, got -4"),
        ((5, 1), ValueError, r"a ends before it starts, got \(5, 1\)"),
    ],
)
def test_spans_overlap_refuses_what_is_no_span_naming_it(a, error, match):
    with pytest.raises(error, match=match):
        spans_overlap(a, (0, 10))
    with pytest.raises(error, match=match.replace("a", "b", 1)):
        spans_overlap((0, 10), a)


def test_spans_take_numpy_integers_as_ints():
    assert spans_overlap((np.int64(0), np.int64(8)), (4, 12)) is spans_overlap((0, 8), (4, 12))
    assert overlapping_pairs([(np.int64(0), np.int64(4)), (2, 6)]) == [(0, 1)]


@pytest.mark.parametrize(
    ("spans", "error", "match"),
    [
        (None, TypeError, "spans must be a sequence of .start, end. pairs, got None"),
        (3, TypeError, "spans must be a sequence of .start, end. pairs, got 3"),
        ([(0, 4), (0,)], TypeError, r"spans\[1\] must be a .start, end. pair, got \(0,\)"),
        ([(0, 4), (8, 2)], ValueError, r"spans\[1\] ends before it starts, got \(8, 2\)"),
    ],
)
def test_overlapping_pairs_refuses_what_is_no_spans_naming_it(spans, error, match):
    with pytest.raises(error, match=match):
        overlapping_pairs(spans)


def test_overlapping_pairs_reads_an_iterator_once():
    assert overlapping_pairs(iter([(0, 4), (2, 6)])) == [(0, 1)]
