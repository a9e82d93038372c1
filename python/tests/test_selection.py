"""indexer_topk rows from an engine's selection."""

import pytest

from glmdiff_hooks import causal_topk_rows


def test_future_and_padded_positions_are_dropped_and_rows_padded():
    sel = [[0, 1, 2], [1, 2, 0], [2, 5, 1], [-1, 3, 0]]
    assert causal_topk_rows(sel, 2) == [[0, -1], [1, 0], [2, 1], [3, 0]]


def test_width_is_min_of_k_and_tokens():
    sel = [[0], [1, 0]]
    assert causal_topk_rows(sel, 2048) == [[0, -1], [1, 0]]
    assert causal_topk_rows([], 4) == []


def test_engine_order_is_kept():
    assert causal_topk_rows([[0], [0, 1], [1, 2, 0]], 3) == [[0, -1, -1], [0, 1, -1], [1, 2, 0]]


def test_k_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        causal_topk_rows([[0]], 0)
