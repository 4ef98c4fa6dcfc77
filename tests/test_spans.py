"""CPU tests for vllm_specgraph.spans."""

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
