"""RoPE element order: the GGUF (and llama.cpp, and glmdiff) rotate adjacent pairs (2i, 2i+1) in place;
transformers' interleaved-RoPE helper returns the rotated vector de-interleaved (evens first, then odds).
Same dot products, permuted vector: a trace must hold the GGUF order (docs/hooks.md, "Element order").

Pure: the permutations are lists of indices; `reinterleave` indexes the last axis of anything that takes a
list index (a torch tensor, a numpy array) without importing either.
"""

from __future__ import annotations


def _check(n: int) -> None:
    if n < 0 or n % 2:
        raise ValueError(f"glmdiff_hooks: a RoPE dimension must be even, not {n}")


def deinterleave_perm(n: int) -> list[int]:
    """transformers' order from the GGUF's: `out = x[..., perm]` gives [x0, x2, ..., x1, x3, ...]."""
    _check(n)
    return list(range(0, n, 2)) + list(range(1, n, 2))


def reinterleave_perm(n: int) -> list[int]:
    """The GGUF's order from transformers': `out = x[..., perm]` maps [e0..e(n/2-1), o0..] to [e0, o0, e1, o1, ...]
    (the inverse of deinterleave_perm)."""
    _check(n)
    half = n // 2
    return [j for i in range(half) for j in (i, half + i)]


def reinterleave(x):
    """`x` (last axis a de-interleaved RoPE vector) in the GGUF's element order; a new array or tensor."""
    return x[..., reinterleave_perm(int(x.shape[-1]))]
