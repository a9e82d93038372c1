"""Hooks on transformers' GlmMoeDsaForCausalLM / DeepseekV3ForCausalLM (torch; tested with transformers 5.17).

    import glmdiff_hooks
    with glmdiff_hooks.capture_transformers(model) as rec:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    rec.save("glm5.trace.safetensors", model_file="GLM-5-UD-Q4_K_XL-00001-of-00009.gguf", tokens=ids)

Nothing in the model's arithmetic is changed: hooks only read. transformers' interleaved-RoPE helper has no module;
it is wrapped while the hooks are attached (same values) to record q_pe_rope / k_pe_rope, re-interleaved into the
GGUF's element order. The DSA indexer's scores are internal to its module: its ops are re-run from the module's
inputs and the re-run's selection must equal the engine's.
"""

from __future__ import annotations

import contextlib

import torch

from .meta import dtype_word
from .names import ARCH, INDEXER_POINTS, expected_hooks
from .recorder import Trace, causal_topk, first as _first
from .rope import reinterleave


def _transformers_module(model):
    mt = model.config.model_type
    if mt == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod
    elif mt == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod
    else:
        raise ValueError(f"glmdiff_hooks: transformers model_type {mt!r} is not glm_moe_dsa or deepseek_v3")
    return mod


def _indexer_scores(ix, args, kwargs, rope_apply):
    """transformers' GlmMoeDsaIndexer.forward (5.17), op for op, up to its index scores [B, S, T]
    (before the mask), from the inputs the module was called with."""
    names = ["hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids"]
    a = dict(zip(names, args))
    a.update({k: v for k, v in kwargs.items() if k in names})
    if kwargs.get("past_key_values") is not None:
        raise RuntimeError("a KV cache is in use: run with use_cache=False")
    hs, q_resid = a["hidden_states"], a["q_resid"]
    cos, sin = a["position_embeddings"]
    b, s, _ = hs.shape
    r = ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [r, ix.head_dim - r], dim=-1)
    k = ix.k_norm(ix.wk(hs)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [r, ix.head_dim - r], dim=-1)
    q_rot, k_rot = rope_apply(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale
    scores = torch.nn.functional.relu(scores)
    w = ix.weights_proj(hs.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads ** -0.5)
    raw = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    mask = a["attention_mask"]
    masked = raw.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else raw + mask
    return raw, masked


def attach_transformers(model, rec: Trace | None = None):
    """Registers the hooks on a transformers GlmMoeDsaForCausalLM / DeepseekV3ForCausalLM.

    Returns (trace, detach): call detach() to remove every hook (capture_transformers does it for you).
    The forward pass must be one sequence (batch 1) from position 0 with use_cache=False."""
    mod = _transformers_module(model)
    cfg = model.config
    m = model.model
    layers = list(m.layers)
    dsa = cfg.model_type == "glm_moe_dsa"
    dense = {i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "experts")}
    rec = rec or Trace(len(layers))
    rec.architecture = ARCH[cfg.model_type]
    q_lora = getattr(cfg, "q_lora_rank", None) is not None
    rec.expected = expected_hooks(len(layers), dense, dsa, q_lora=q_lora)
    dt = next(model.parameters()).dtype
    dev = next(model.parameters()).device
    import transformers

    rec.dtype = f"{dtype_word(dt)} (transformers {dt}, attention {cfg._attn_implementation})"
    rec.engine = f"transformers-{transformers.__version__} {dev.type} {str(dt).replace('torch.', '')}"
    handles = []
    restore = []

    def out(name):
        def fn(module, args, output):
            rec.put(name.format(L=rec.layer), _first(output)[0])
        return fn

    def inp(name):
        def fn(module, args, output):
            rec.put(name.format(L=rec.layer), args[0][0])
        return fn

    def hook(module, fn):
        handles.append(module.register_forward_hook(fn))

    hook(m.embed_tokens, out("token_embd"))
    hook(m.norm, out("result_norm"))
    hook(model.lm_head, out("logits"))

    # RoPE has no module: the modeling module's function is wrapped (it computes the same values; the attention's
    # call, unsqueeze_dim 1, is recorded; the indexer's, unsqueeze_dim 2, is not a hook point).
    interleave = getattr(cfg, "rope_interleave", True)
    orig_rope = getattr(mod, "apply_rotary_pos_emb_interleave", None)
    if orig_rope is not None and interleave:
        def rope_apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            q_e, k_e = orig_rope(q, k, cos, sin, position_ids=position_ids, unsqueeze_dim=unsqueeze_dim)
            if unsqueeze_dim == 1:
                # q_e [B, H, T, rope] -> [T, H, rope]; k_e [B, 1, T, rope] -> [T, rope]
                rec.put(f"blk.{rec.layer}.q_pe_rope", reinterleave(q_e)[0].transpose(0, 1))
                rec.put(f"blk.{rec.layer}.k_pe_rope", reinterleave(k_e)[0, 0])
            return q_e, k_e

        mod.apply_rotary_pos_emb_interleave = rope_apply
        restore.append((mod, "apply_rotary_pos_emb_interleave", orig_rope))
    else:
        rec.skip("blk.*.q_pe_rope", "rope_interleave is off: RoPE runs on de-interleaved weights (no GGUF order)")
        rec.skip("blk.*.k_pe_rope", "rope_interleave is off: RoPE runs on de-interleaved weights (no GGUF order)")

    for i, layer in enumerate(layers):
        def set_layer(module, args, i=i):
            rec.layer = i

        handles.append(layer.register_forward_pre_hook(set_layer))
        a = layer.self_attn
        hook(layer.input_layernorm, out("blk.{L}.attn_norm"))
        if q_lora:
            hook(a.q_a_proj, out("blk.{L}.q_a"))
            hook(a.q_a_layernorm, out("blk.{L}.q_a_norm"))
            hook(a.q_b_proj, out("blk.{L}.q_b"))
        else:  # attn_norm . attn_q
            hook(a.q_proj, out("blk.{L}.q_b"))
        hook(a.kv_a_proj_with_mqa, out("blk.{L}.kv_a"))
        hook(a.kv_a_layernorm, out("blk.{L}.kv_a_norm"))
        hook(a.o_proj, inp("blk.{L}.attn_heads"))
        hook(a.o_proj, out("blk.{L}.attn_out"))
        hook(layer.post_attention_layernorm, inp("blk.{L}.ffn_inp"))
        hook(layer.post_attention_layernorm, out("blk.{L}.ffn_norm"))
        ix = getattr(a, "indexer", None) if dsa else None
        if dsa and ix is None:
            for p in INDEXER_POINTS:
                rec.skip(f"blk.{i}.{p}", "this layer reuses an earlier layer's DSA selection")
        if ix is not None:
            def ix_hook(module, args, kwargs, output, i=i):
                sel = output[0]
                rec.put(f"blk.{i}.indexer_topk", causal_topk(sel, module.index_topk))
                try:
                    with torch.no_grad():
                        raw, masked = _indexer_scores(module, args, kwargs, orig_rope)
                    k = min(module.index_topk, masked.shape[-1])
                    again = masked.topk(k, dim=-1).indices
                    if not torch.equal(causal_topk(again[0], k), causal_topk(sel, k)):
                        raise RuntimeError("the re-run selects other keys")
                    s_len = raw.shape[1]
                    causal = torch.ones(s_len, s_len, dtype=torch.bool, device=raw.device).tril()
                    rec.put(f"blk.{i}.indexer_scores", raw[0].masked_fill(~causal, float("-inf")))
                except Exception as e:  # noqa: BLE001 - any mismatch means the scores are not the engine's
                    rec.skip(f"blk.{i}.indexer_scores",
                             f"scores are internal to GlmMoeDsaIndexer; re-running its ops failed: {e}")

            handles.append(ix.register_forward_hook(ix_hook, with_kwargs=True))
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            def gate_hook(module, args, output, i=i):
                logits, w, idx = output
                probs = logits.sigmoid()  # the router's own scores (transformers: router_logits.sigmoid())
                bias = module.e_score_correction_bias
                order = torch.sort((probs + bias).gather(1, idx), dim=-1, descending=True, stable=True)[1]
                rec.put(f"blk.{i}.moe_logits", logits)
                rec.put(f"blk.{i}.moe_probs", probs)
                rec.put(f"blk.{i}.moe_topk_ids", idx.gather(1, order).to(torch.int32))
                rec.put(f"blk.{i}.moe_weights", w.gather(1, order))

            hook(mlp.gate, gate_hook)
            handles.append(mlp.experts.register_forward_hook(
                lambda module, args, output: rec.put(f"blk.{rec.layer}.moe_routed", _first(output))))
            hook(mlp.shared_experts, out("blk.{L}.ffn_shexp"))
        else:
            hook(mlp.gate_proj, out("blk.{L}.ffn_gate"))
            hook(mlp.up_proj, out("blk.{L}.ffn_up"))
            hook(mlp.down_proj, inp("blk.{L}.ffn_act"))
        hook(mlp, out("blk.{L}.ffn_out"))
        hook(layer, out("blk.{L}.l_out"))

    def detach():
        for h in handles:
            h.remove()
        handles.clear()
        for obj, attr, old in reversed(restore):
            setattr(obj, attr, old)
        restore.clear()

    return rec, detach


@contextlib.contextmanager
def capture_transformers(model):
    """`with capture_transformers(model) as trace: model(...)`; hooks are removed on exit."""
    rec, detach = attach_transformers(model)
    try:
        yield rec
    finally:
        detach()


