"""Selections as glmdiff's hooks hold them. Pure (lists of ints)."""

from __future__ import annotations

from collections.abc import Sequence


def causal_topk_rows(selected: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """`indexer_topk` rows from an engine's selection.

    `selected[t]` is the engine's selected key positions for query t, in its order (an engine may also pick masked
    future positions, or pad with -1). Each output row keeps the causal ones (0 <= s <= t) in that order, at most
    min(k, t + 1) of them, padded with -1 to width min(k, T) (docs/hooks.md)."""
    if k < 1:
        raise ValueError(f"glmdiff_hooks: index top-k must be at least 1, not {k}")
    t_len = len(selected)
    width = min(k, t_len)
    out = []
    for t, row in enumerate(selected):
        kept = [int(s) for s in row if 0 <= int(s) <= t][: min(width, t + 1)]
        out.append(kept + [-1] * (width - len(kept)))
    return out
