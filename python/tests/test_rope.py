"""RoPE element order: transformers' de-interleaved rotation, re-interleaved, is llama.cpp's pairwise one."""

import numpy as np
import pytest

from glmdiff_hooks import deinterleave_perm, reinterleave, reinterleave_perm


def test_permutations_by_hand():
    assert reinterleave_perm(6) == [0, 3, 1, 4, 2, 5]
    assert deinterleave_perm(6) == [0, 2, 4, 1, 3, 5]
    assert reinterleave_perm(0) == [] and reinterleave_perm(2) == [0, 1]


@pytest.mark.parametrize("n", [2, 4, 8, 64, 128])
def test_permutations_are_inverse(n):
    x = np.arange(n)
    assert (x[deinterleave_perm(n)][reinterleave_perm(n)] == x).all()
    assert (x[reinterleave_perm(n)][deinterleave_perm(n)] == x).all()


@pytest.mark.parametrize("n", [-2, 1, 7])
def test_odd_dimension_is_refused(n):
    with pytest.raises(ValueError, match="must be even"):
        reinterleave_perm(n)


def _rope_gguf(x, pos, base=10000.0):
    """llama.cpp's normal RoPE: pairs (2i, 2i+1) rotated by pos * base^(-2i/n)."""
    n = x.shape[-1]
    out = x.copy()
    for i in range(n // 2):
        th = pos * base ** (-2.0 * i / n)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * np.cos(th) - b * np.sin(th)
        out[..., 2 * i + 1] = a * np.sin(th) + b * np.cos(th)
    return out


def _rope_transformers_interleave(x, pos, base=10000.0):
    """transformers' apply_rotary_pos_emb_interleave: de-interleave (view(..., n/2, 2).transpose), then
    x * cos + rotate_half(x) * sin with the frequencies repeated over both halves."""
    n = x.shape[-1]
    d = x.reshape(*x.shape[:-1], n // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    inv = base ** (-np.arange(0, n, 2) / n)
    th = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-d[..., n // 2:], d[..., : n // 2]], axis=-1)
    return d * np.cos(th) + rot * np.sin(th)


def test_reinterleaved_transformers_rope_is_the_gguf_rope():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 3, 16))  # [T, H, rope]
    for pos in (0, 1, 5, 37):
        hf = _rope_transformers_interleave(x, pos)
        gg = _rope_gguf(x, pos)
        assert not np.allclose(hf, gg) or pos == 0
        np.testing.assert_allclose(reinterleave(hf), gg, rtol=0, atol=1e-12)
        # same dot products either way: the permutation is the only difference
        np.testing.assert_allclose((hf * hf).sum(-1), (gg * gg).sum(-1), rtol=1e-12)
