"""Hook names: the list read from hooks.json, the per-layer conditions, parsing and globs."""

import json
from pathlib import Path

import pytest

import glmdiff_hooks
from glmdiff_hooks import names

HOOKS_JSON = Path(glmdiff_hooks.__file__).with_name("hooks.json")


def test_hooks_json_is_consistent():
    spec = json.loads(HOOKS_JSON.read_text())
    points = [p["point"] for p in spec["layer_points"]]
    assert len(points) == len(set(points))
    assert {p["when"] for p in spec["layer_points"]} <= {"always", "q_lora", "dsa", "dense", "moe"}
    assert all(p["rank"] in (2, 3) for p in spec["layer_points"] + spec["optional_layer_points"])
    req, opt = spec["metadata"]["required"], spec["metadata"]["optional"]
    assert not set(req) & set(opt)
    assert "hook_script" in opt and "not_captured" in opt
    assert names.ID_POINTS == {"indexer_topk", "moe_topk_ids"}


def test_glm5_layers_dense_then_moe_with_indexer():
    hooks = glmdiff_hooks.expected_hooks(2, {0}, dsa=True)
    assert hooks[0] == "token_embd" and hooks[-2:] == ["result_norm", "logits"]
    l0 = [h[len("blk.0."):] for h in hooks if h.startswith("blk.0.")]
    l1 = [h[len("blk.1."):] for h in hooks if h.startswith("blk.1.")]
    assert l0 == ["attn_norm", "q_a", "q_a_norm", "q_b", "q_pe_rope", "kv_a", "kv_a_norm", "k_pe_rope",
                  "indexer_scores", "indexer_topk", "attn_heads", "attn_out", "ffn_inp", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_act", "ffn_out", "l_out"]
    assert l1 == l0[:14] + ["moe_logits", "moe_probs", "moe_topk_ids", "moe_weights", "moe_routed", "ffn_shexp",
                            "ffn_out", "l_out"]
    assert len(hooks) == 1 + len(l0) + len(l1) + 2


def test_deepseek_without_indexer_or_q_lora():
    hooks = glmdiff_hooks.expected_hooks(3, {0, 1}, dsa=False, q_lora=False)
    assert not [h for h in hooks if "indexer" in h or ".q_a" in h]
    assert "blk.2.moe_logits" in hooks and "blk.1.ffn_act" in hooks and "blk.1.moe_logits" not in hooks
    assert "blk.0.q_b" in hooks


def test_parse_hook_accepts_every_expected_and_optional_name():
    for h in glmdiff_hooks.expected_hooks(3, {0}, dsa=True):
        layer, point = glmdiff_hooks.parse_hook(h)
        assert (h == point) if layer is None else (h == f"blk.{layer}.{point}")
    assert glmdiff_hooks.parse_hook("blk.12.exp.255.out") == (12, "exp.{e}.out")
    assert glmdiff_hooks.parse_hook("blk.0.attn_probs") == (0, "attn_probs")


@pytest.mark.parametrize("bad", ["", "q_a", "blk.0", "blk.0.nope", "blk.x.q_a", "blk.-1.q_a", "blk.0.exp.a.out",
                                 "blk.0.exp.{e}.out", "blk.0.token_embd", "blk.0.logits", "dequant.blk.0.x.weight",
                                 "model.layers.0.self_attn.q_a_proj"])
def test_parse_hook_refuses_other_names(bad):
    with pytest.raises(ValueError, match="not a glmdiff hook name"):
        glmdiff_hooks.parse_hook(bad)


def test_rank_and_ids():
    assert names.rank("blk.3.q_pe_rope") == 3 and names.rank("blk.3.attn_probs") == 3
    assert names.rank("logits") == 2 and names.rank("blk.0.exp.1.out") == 2
    assert names.is_id_hook("blk.2.moe_topk_ids") and not names.is_id_hook("blk.2.moe_weights")


@pytest.mark.parametrize("pattern,name,ok", [
    ("blk.*.q_a_norm", "blk.12.q_a_norm", True),
    ("blk.*.q_a_norm", "blk.1.q_a", False),
    ("blk.*", "blk.1.exp.3.out", True),
    ("blk.?.l_out", "blk.7.l_out", True),
    ("blk.?.l_out", "blk.17.l_out", False),
    ("blk.1.q_a", "blkX1.q_a", False),
    ("*", "logits", True),
    ("blk.[0].q_a", "blk.0.q_a", False),
])
def test_glob_matches_as_glmdiff(pattern, name, ok):
    assert glmdiff_hooks.glob_matches(pattern, name) is ok


def test_architectures():
    assert set(glmdiff_hooks.ARCH.values()) == {"glm-dsa", "deepseek2"}
    assert glmdiff_hooks.ARCH["glm_moe_dsa"] == "glm-dsa" and glmdiff_hooks.ARCH["deepseek_v3"] == "deepseek2"
