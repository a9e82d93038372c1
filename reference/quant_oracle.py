"""Exact-oracle mixed-quant GGUFs: random valid quant blocks whose dequantized values are the model.

The mixed file is built in three steps (reference/make_model_fixtures.py drives them):
1. the transformers model is converted to an F32 GGUF with llama.cpp's converter (pass 1) to learn
   every GGUF tensor name and shape;
2. for every tensor of the plan, random valid blocks of its type are drawn and dequantized with
   gguf-py (F16/BF16 tensors: the pass-1 values rounded), and those floats are written back into the
   transformers parameters through the inverse of the converter's layout (`apply_gguf_to_hf`);
3. the model is converted again (pass 2); its F32 tensors must equal the dequantized blocks exactly.
   The mixed GGUF then copies pass 2's metadata and F32 tensors and writes the drawn bytes for the
   planned tensors, so the GGUF and the transformers model hold exactly the same function.

Block layouts: gguf-py `gguf/quants.py` and ggml `src/ggml-common.h` (offsets of the f16 scale fields
below), shared/spec/quant-formats.md.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gq

#: Byte offsets of the f16 fields of one block: (offset, role). role "d" is the main scale,
#: "dmin" the K-quant min scale, "m" the legacy min (an offset).
F16_FIELDS: dict[Q, list[tuple[int, str]]] = {
    Q.Q4_0: [(0, "d")], Q.Q4_1: [(0, "d"), (2, "m")], Q.Q5_0: [(0, "d")], Q.Q5_1: [(0, "d"), (2, "m")],
    Q.Q8_0: [(0, "d")],
    Q.Q2_K: [(80, "d"), (82, "dmin")], Q.Q3_K: [(108, "d")], Q.Q4_K: [(0, "d"), (2, "dmin")],
    Q.Q5_K: [(0, "d"), (2, "dmin")], Q.Q6_K: [(208, "d")],
    Q.IQ2_XXS: [(0, "d")], Q.IQ2_XS: [(0, "d")], Q.IQ2_S: [(0, "d")], Q.IQ3_XXS: [(0, "d")],
    Q.IQ3_S: [(0, "d")], Q.IQ1_S: [(0, "d")], Q.IQ4_NL: [(0, "d")], Q.IQ4_XS: [(0, "d")],
}

#: Target standard deviation of the dequantized weights of a tensor with fan-in n: gain/sqrt(n).
WEIGHT_GAIN = 0.8


def _blocks_with(qtype: Q, raw: np.ndarray, d: np.ndarray, second: np.ndarray | None) -> np.ndarray:
    """Write scale fields into random block bytes (raw: [n_blocks, type_size] uint8)."""
    out = raw.copy()
    if qtype == Q.MXFP4:
        out[:, 0] = d.astype(np.uint8)
        return out
    for off, role in F16_FIELDS[qtype]:
        vals = d if role == "d" else second
        out[:, off:off + 2] = vals.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return out


def _dequant_blocks(qtype: Q, blocks: np.ndarray) -> np.ndarray:
    return gq.dequantize(blocks, qtype).reshape(blocks.shape[0], -1).astype(np.float64)


def draw_blocks(qtype: Q, n_blocks: int, target_std: float, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` random valid blocks of `qtype` whose dequantized values have about `target_std`.

    Quant bytes are uniform random; the f16 scales are set so that values are centred (for types
    with a min) and scaled to the target, with a log-normal spread from block to block.
    """
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        # d = 2^(e-128); random nibbles of kvalues have rms ~5.85
        e = np.round(128 + np.log2(target_std / 5.85) + rng.normal(0, 0.5, n_blocks)).clip(1, 254)
        return _blocks_with(qtype, raw, e, None)
    roles = [r for _, r in F16_FIELDS[qtype]]
    # calibrate on a sample of the same random bytes: mean/std with d=1 and the second field
    ones = np.ones(n_blocks)
    zeros = np.zeros(n_blocks)
    ratio = 0.0
    if len(roles) == 2:
        y_d = _dequant_blocks(qtype, _blocks_with(qtype, raw, ones, zeros))
        y_s = _dequant_blocks(qtype, _blocks_with(qtype, raw, zeros, ones))
        # choose second = ratio * d so that the mean is ~0: mean(y_d) + ratio * mean(y_s) = 0
        ratio = -y_d.mean() / y_s.mean()
    y1 = _dequant_blocks(qtype, _blocks_with(qtype, raw, ones, ratio * ones if roles[1:] else None))
    std1 = y1.std()
    d = (target_std / std1) * np.exp(rng.normal(0, 0.2, n_blocks))
    d16 = d.astype(np.float16).astype(np.float64)
    second = None
    if len(roles) == 2:
        second = (ratio * d16 * np.exp(rng.normal(0, 0.05, n_blocks))).astype(np.float16).astype(np.float64)
    return _blocks_with(qtype, raw, d16, second)


def draw_tensor(qtype: Q, shape: tuple[int, ...], target_std: float, rng: np.random.Generator):
    """Random bytes for a tensor of numpy shape `shape` (ne reversed) and their float values.

    Returns (bytes [.., row_bytes] uint8, values float32 of `shape`).
    """
    block, size = GGML_QUANT_SIZES[qtype]
    ne0 = shape[-1]
    if ne0 % block:
        raise ValueError(f"ne0 {ne0} is not a multiple of the {qtype.name} block {block}")
    n_blocks = int(np.prod(shape)) // block
    blocks = draw_blocks(qtype, n_blocks, target_std, rng)
    vals = gq.dequantize(blocks.reshape(-1), qtype).reshape(shape).astype(np.float32)
    data = blocks.reshape(*shape[:-1], (ne0 // block) * size)
    assert np.isfinite(vals).all()
    return data, vals


def round_to(qtype: Q, vals: np.ndarray):
    """(stored array, exact float32 values) for F16/BF16/F32 tensors of the plan."""
    v32 = np.ascontiguousarray(vals, dtype=np.float32)
    if qtype == Q.F32:
        return v32, v32
    if qtype == Q.F16:
        h = v32.astype(np.float16)
        return h, h.astype(np.float32)
    if qtype == Q.BF16:
        b = gq.quantize(v32, Q.BF16)  # uint8 bytes, round to nearest even
        return b, gq.dequantize(b, Q.BF16).reshape(v32.shape).astype(np.float32)
    raise ValueError(qtype)


# ---------------------------------------------------------------------------------------------
# Plans: GGUF tensor name -> type, in the spirit of unsloth "UD" mixes (spec quant-formats.md).
# Tensors not named stay F32, as the converter writes them (norms, biases, ffn_gate_inp and
# indexer.proj are always F32 in llama.cpp's converter, conversion/base.py prepare_tensors).
# ---------------------------------------------------------------------------------------------

PLANS: dict[str, dict[str, Q]] = {
    "glm5-tiny-q": {
        "token_embd.weight": Q.Q5_K,
        "output.weight": Q.Q4_K,
        "blk.0.attn_q_a.weight": Q.Q5_K,
        "blk.0.attn_q_b.weight": Q.Q8_0,
        "blk.0.attn_kv_a_mqa.weight": Q.Q8_0,
        "blk.0.attn_k_b.weight": Q.Q8_0,
        "blk.0.attn_v_b.weight": Q.Q8_0,
        "blk.0.attn_output.weight": Q.Q5_K,
        "blk.0.indexer.attn_q_b.weight": Q.F16,
        "blk.0.indexer.attn_k.weight": Q.BF16,
        "blk.0.ffn_gate.weight": Q.Q4_K,
        "blk.0.ffn_up.weight": Q.Q4_K,
        "blk.0.ffn_down.weight": Q.Q6_K,
        "blk.1.attn_q_a.weight": Q.Q4_K,
        "blk.1.attn_q_b.weight": Q.Q8_0,
        "blk.1.attn_kv_a_mqa.weight": Q.Q6_K,
        "blk.1.attn_k_b.weight": Q.Q8_0,
        "blk.1.attn_v_b.weight": Q.Q8_0,
        "blk.1.attn_output.weight": Q.IQ4_XS,
        "blk.1.indexer.attn_q_b.weight": Q.BF16,
        "blk.1.indexer.attn_k.weight": Q.Q5_K,
        "blk.1.ffn_gate_exps.weight": Q.IQ2_XS,
        "blk.1.ffn_up_exps.weight": Q.IQ3_XXS,
        "blk.1.ffn_down_exps.weight": Q.IQ4_NL,
        "blk.1.ffn_gate_shexp.weight": Q.Q6_K,
        "blk.1.ffn_up_shexp.weight": Q.Q5_K,
        "blk.1.ffn_down_shexp.weight": Q.Q8_0,
    },
    "dsv3-tiny-q": {
        "token_embd.weight": Q.Q4_K,
        "output.weight": Q.Q6_K,
        "blk.0.attn_q_a.weight": Q.Q2_K,
        "blk.0.attn_q_b.weight": Q.Q5_1,
        "blk.0.attn_kv_a_mqa.weight": Q.Q3_K,
        "blk.0.attn_k_b.weight": Q.Q4_0,
        "blk.0.attn_v_b.weight": Q.Q8_0,
        "blk.0.attn_output.weight": Q.Q6_K,
        "blk.0.ffn_gate.weight": Q.IQ1_S,
        "blk.0.ffn_up.weight": Q.IQ2_S,
        "blk.0.ffn_down.weight": Q.IQ4_XS,
        "blk.1.attn_q_a.weight": Q.IQ3_S,
        "blk.1.attn_q_b.weight": Q.BF16,
        "blk.1.attn_kv_a_mqa.weight": Q.Q5_K,
        "blk.1.attn_k_b.weight": Q.Q8_0,
        "blk.1.attn_v_b.weight": Q.Q4_1,
        "blk.1.attn_output.weight": Q.Q4_K,
        "blk.1.ffn_gate_exps.weight": Q.IQ2_XXS,
        "blk.1.ffn_up_exps.weight": Q.IQ3_S,
        "blk.1.ffn_down_exps.weight": Q.MXFP4,
        "blk.1.ffn_gate_shexp.weight": Q.Q2_K,
        "blk.1.ffn_up_shexp.weight": Q.IQ2_XS,
        "blk.1.ffn_down_shexp.weight": Q.Q5_0,
    },
}


# ---------------------------------------------------------------------------------------------
# GGUF tensor <-> transformers parameter (the converter's layout, llama.cpp conversion/deepseek.py
# DeepseekV2Model.modify_tensors, gguf-py tensor_mapping.py)
# ---------------------------------------------------------------------------------------------

_SIMPLE = {
    "attn_q_a": "self_attn.q_a_proj.weight",
    "attn_q_b": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_norm": "input_layernorm.weight",
    "attn_q_a_norm": "self_attn.q_a_layernorm.weight",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "indexer.attn_q_b": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k": "self_attn.indexer.wk.weight",
    "indexer.proj": "self_attn.indexer.weights_proj.weight",
    "indexer.k_norm": "self_attn.indexer.k_norm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_experts.down_proj.weight",
}


def hf_view(model, gguf_name: str) -> torch.Tensor:
    """The transformers values of one GGUF tensor, in the GGUF's numpy shape (ne reversed).

    Returned tensors are views where the layout allows it, so `apply_gguf_to_hf` can write through.
    """
    cfg = model.config
    m = model.model
    if gguf_name == "token_embd.weight":
        return m.embed_tokens.weight.data
    if gguf_name == "output.weight":
        return model.lm_head.weight.data
    if gguf_name == "output_norm.weight":
        return m.norm.weight.data
    mt = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias)", gguf_name)
    if mt is None:
        raise KeyError(gguf_name)
    layer = m.layers[int(mt.group(1))]
    base, kind = mt.group(2), mt.group(3)
    if base == "exp_probs_b" and kind == "bias":
        return layer.mlp.gate.e_score_correction_bias.data
    if base == "indexer.k_norm" and kind == "bias":
        return layer.self_attn.indexer.k_norm.bias.data
    if base in _SIMPLE and kind == "weight":
        return layer.get_submodule(_SIMPLE[base].rsplit(".", 1)[0]).weight.data
    H, nope, v, kvl = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if base in ("attn_k_b", "attn_v_b"):
        kv_b = layer.self_attn.kv_b_proj.weight.data.view(H, nope + v, kvl)
        if base == "attn_k_b":  # [H, kv_lora, nope]
            return kv_b[:, :nope, :].transpose(1, 2)
        return kv_b[:, nope:, :]  # [H, v, kv_lora]
    inter = cfg.moe_intermediate_size
    if base == "ffn_gate_exps":  # [E, I, H]
        return layer.mlp.experts.gate_up_proj.data[:, :inter, :]
    if base == "ffn_up_exps":
        return layer.mlp.experts.gate_up_proj.data[:, inter:, :]
    if base == "ffn_down_exps":  # [E, H, I]
        return layer.mlp.experts.down_proj.data
    raise KeyError(gguf_name)


def apply_gguf_to_hf(model, gguf_name: str, values: np.ndarray) -> None:
    """Write GGUF-layout values into the transformers parameters."""
    view = hf_view(model, gguf_name)
    if tuple(view.shape) != tuple(values.shape):
        raise ValueError(f"{gguf_name}: hf view {tuple(view.shape)} vs gguf {values.shape}")
    with torch.no_grad():
        view.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(view.dtype))


def fan_in(gguf_name: str, shape: tuple[int, ...]) -> int:
    """Input width of a weight in GGUF numpy shape (ne0 is the input for every matmul weight)."""
    if gguf_name == "token_embd.weight":
        return 1  # embeddings: unit variance
    return shape[-1]
