"""Shape and kind checks before a trace is written."""

import pytest

from glmdiff_hooks import check_hook


@pytest.mark.parametrize("name,shape,is_int", [
    ("token_embd", [4, 64], False),
    ("blk.0.q_pe_rope", [4, 8, 16], False),
    ("blk.0.k_pe_rope", [4, 16], False),
    ("blk.1.moe_topk_ids", [4, 2], True),
    ("blk.1.indexer_topk", [4, 4], True),
    ("blk.1.attn_probs", [8, 4, 4], False),
    ("blk.1.exp.3.out", [0, 64], False),
    ("blk.1.exp.3.out", [4, 64], False),
    ("logits", [4, 1000], False),
])
def test_good_shapes_pass(name, shape, is_int):
    check_hook(name, shape, is_int, tokens=4)


@pytest.mark.parametrize("name,shape,is_int,msg", [
    ("token_embd", [3, 64], False, r"shape \[3, 64\], not \[4, \.\.\.\]"),
    ("token_embd", [1, 4, 64], False, "not 2 dimensions"),
    ("blk.0.q_pe_rope", [4, 128], False, "not 3 dimensions"),
    ("logits", [], False, "not 2 dimensions"),
    ("blk.1.attn_probs", [8, 4, 3], False, r"not \[H, 4, 4\]"),
    ("blk.1.exp.3.out", [5, 64], False, "more than the 4 tokens"),
    ("blk.1.moe_topk_ids", [4, 2], False, "must hold integer ids, not floats"),
    ("blk.1.moe_weights", [4, 2], True, "must hold floats, not integers"),
    ("blk.1.mystery", [4, 2], False, "not a glmdiff hook name"),
])
def test_bad_shapes_name_the_hook(name, shape, is_int, msg):
    with pytest.raises(ValueError, match=msg) as e:
        check_hook(name, shape, is_int, tokens=4)
    assert name in str(e.value)
