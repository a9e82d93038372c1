"""Float64 golden traces of every hook point (docs/hooks.md) from transformers.

The model runs as transformers builds it (`model.double()`, eager attention, eager experts), with
forward hooks recording the hook points. transformers computes a few parts in float32 even in a
float64 model; those parts are replaced here by float64 versions of the same formulas, so the trace
is a true float64 evaluation of the spec (shared/spec/glm5-architecture.md section 2):

1. RMSNorm (`*RMSNorm.forward`): upcasts to float32. Replaced by `w * x * rsqrt(mean(x^2) + eps)` in
   float64.
2. Rotary embedding (`*RotaryEmbedding`): inv_freq is built in float32 and the angles are computed in
   float32. Replaced by the same formulas (default and YaRN, `_compute_yarn_parameters` of
   transformers `modeling_rope_utils.py`) evaluated in float64.
3. Eager attention (`eager_attention_forward`): softmax with dtype=float32. Replaced by the same
   function with the softmax in float64.
4. Router (`*TopkRouter.forward`): casts input and weight to float32. Replaced by the same noaux_tc
   routing in float64; top-k is taken sorted (descending biased score), which is the hook order.
5. DSA indexer (`GlmMoeDsaIndexer.forward`): casts q, k and the head weights to float32 and, for
   queries that see fewer than index_topk keys, selects masked (future) positions too. Replaced by a
   float64 evaluation of spec 2.2 that keeps k = min(index_topk, t+1) causal positions per query.
   The selected set is what the attention mask uses.

Deviations where transformers and the spec/GGUF disagree (spec section 5), following the GGUF:
- `q_a_layernorm` and `kv_a_layernorm` are built by transformers with eps 1e-6; the GGUF
  (and llama.cpp, vLLM) use rms_norm_eps. Their `variance_epsilon` is set to config.rms_norm_eps.

Element order: hooks keep the GGUF order. transformers' interleaved RoPE helper returns the rotated
pairs de-interleaved (evens then odds); `q_pe_rope` / `k_pe_rope` are re-interleaved here.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _module_for(arch: str):
    if arch == "glm_moe_dsa":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod

        return mod, "GlmMoeDsa"
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    return mod, "DeepseekV3"


def reinterleave(x: torch.Tensor) -> torch.Tensor:
    """Inverse of transformers' de-interleave: [e0..e(n/2-1), o0..] -> [e0, o0, e1, o1, ...]."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., :half]
    out[..., 1::2] = x[..., half:]
    return out


def inv_freq_f64(config) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and cos/sin scaling in float64 (transformers' formulas)."""
    rp = config.rope_parameters
    base = float(rp["rope_theta"])
    dim = config.qk_rope_head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    pos_freqs = base ** exps
    rope_type = rp.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope type {rope_type}")
    factor = float(rp["factor"])
    orig = float(rp["original_max_position_embeddings"])
    beta_fast = float(rp.get("beta_fast") or 32)
    beta_slow = float(rp.get("beta_slow") or 1)

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    attn_factor = rp.get("attention_factor")
    if attn_factor is None:
        if mscale and mscale_all:
            attn_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attn_factor = get_mscale(factor)

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extra = 1.0 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn_factor)


class Recorder:
    """Collects hook tensors (batch dimension dropped) and decision margins."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.t: dict[str, np.ndarray] = {}
        self.layer: int | None = None
        self.margins: dict[str, list] = {"moe": [], "moe_group": [], "indexer": []}

    def put(self, name: str, x) -> None:
        if name in self.t:
            raise RuntimeError(f"hook {name} recorded twice")
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        self.t[name] = np.ascontiguousarray(x)


@contextlib.contextmanager
def float64_patches(model, arch: str, rec: Recorder):
    """Install float64 replacements and recording wrappers; restore everything on exit."""
    mod, prefix = _module_for(arch)
    cfg = model.config
    saved = []

    def patch(obj, attr, new):
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, new)

    # 1. RMSNorm in float64.
    def rms_forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    patch(getattr(mod, f"{prefix}RMSNorm"), "forward", rms_forward)

    # 2. Rotary embedding in float64.
    inv, attn_scaling = inv_freq_f64(cfg)
    rot = model.model.rotary_emb
    rec.inv_freq_hf = rot.inv_freq.detach().to(torch.float64).clone()
    rec.inv_freq_f64 = inv.clone()

    def rope_forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * attn_scaling).to(x.dtype), (emb.sin() * attn_scaling).to(x.dtype)

    patch(rot, "forward", rope_forward)

    # 3. Eager attention with a float64 softmax.
    orig_eager = mod.eager_attention_forward

    def eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = mod.repeat_kv(key, module.num_key_value_groups)
        value_states = mod.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.functional.softmax(w, dim=-1, dtype=query.dtype)
        out = torch.matmul(w, value_states).transpose(1, 2).contiguous()
        return out, w

    assert orig_eager is not None
    patch(mod, "eager_attention_forward", eager64)

    # Recording wrapper of the interleaved RoPE used by the MLA attention.
    orig_rope_apply = mod.apply_rotary_pos_emb_interleave

    def rope_apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q_e, k_e = orig_rope_apply(q, k, cos, sin, position_ids=position_ids, unsqueeze_dim=unsqueeze_dim)
        L = rec.layer
        # q_e [B, H, T, rope] -> [T, H, rope]; k_e [B, 1, T, rope] -> [T, rope]
        rec.put(f"blk.{L}.q_pe_rope", reinterleave(q_e)[0].transpose(0, 1))
        rec.put(f"blk.{L}.k_pe_rope", reinterleave(k_e)[0, 0])
        return q_e, k_e

    patch(mod, "apply_rotary_pos_emb_interleave", rope_apply)

    # 4. Router in float64, sorted top-k.
    router_layer = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            router_layer[id(layer.mlp.gate)] = i

    def router_forward(self, hidden_states):
        L = router_layer[id(self)]
        h = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        scores = logits.sigmoid()
        sc = scores + self.e_score_correction_bias
        n_tok, n_exp = sc.shape
        per_group = n_exp // self.num_group
        group_scores = sc.view(n_tok, self.num_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        gs_sorted = group_scores.sort(dim=-1, descending=True)[0]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=True)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n_tok, self.num_group, per_group).reshape(n_tok, n_exp)
        sc_masked = sc.masked_fill(~score_mask.bool(), float("-inf"))
        top_sc, top_idx = torch.topk(sc_masked, k=self.top_k, dim=-1, sorted=True)
        w = scores.gather(1, top_idx)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w * self.routed_scaling_factor
        rec.put(f"blk.{L}.moe_logits", logits)
        rec.put(f"blk.{L}.moe_probs", scores)
        rec.put(f"blk.{L}.moe_topk_ids", top_idx.to(torch.int32))
        rec.put(f"blk.{L}.moe_weights", w)
        # margins: k-th selected vs best unselected allowed expert; k-th vs (k+1)-th group
        sorted_all = sc_masked.sort(dim=-1, descending=True)[0]
        k = self.top_k
        if sorted_all.shape[1] > k:
            nxt = sorted_all[:, k]
            m = torch.where(torch.isinf(nxt), torch.full_like(nxt, float("inf")), sorted_all[:, k - 1] - nxt)
            rec.margins["moe"].append(float(m.min()))
        if self.topk_group < self.num_group:
            rec.margins["moe_group"].append(float((gs_sorted[:, self.topk_group - 1] - gs_sorted[:, self.topk_group]).min()))
        return logits, w, top_idx

    patch(getattr(mod, f"{prefix}TopkRouter"), "forward", router_forward)

    # 5. DSA indexer in float64 (GLM-5 only).
    if arch == "glm_moe_dsa":

        def indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                            position_ids=None, cache=None):
            L = self.layer_idx
            B, S, _ = hidden_states.shape
            H, D, R = self.n_heads, self.head_dim, self.qk_rope_head_dim
            cos, sin = position_embeddings
            q = self.wq_b(q_resid).view(B, S, H, D)
            q_rot, q_pass = torch.split(q, [R, D - R], dim=-1)
            k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [R, D - R], dim=-1)
            q_rot, k_rot = orig_rope_apply(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)  # [B, S, H, D]
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, S, D]
            dots = torch.einsum("bshd,btd->bsht", q, k) * (D ** -0.5)
            w = self.weights_proj(hidden_states) * (H ** -0.5)  # [B, S, H]
            scores = torch.einsum("bsh,bsht->bst", w, F.relu(dots))  # [B, S, T]
            causal = torch.ones(S, S, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            n_sel = min(self.index_topk, S)
            sel = torch.full((S, n_sel), -1, dtype=torch.int64)
            for t in range(S):
                kt = min(self.index_topk, t + 1)
                row = scores[0, t, : t + 1]
                order = torch.sort(row, descending=True, stable=True)[1]
                sel[t, :kt] = order[:kt]
                if t + 1 > kt:
                    srt = row[order]
                    gap = float(srt[kt - 1] - srt[kt])
                    scale = float(srt.abs().max())
                    rec.margins["indexer"].append((gap, gap / scale if scale > 0 else float("inf"), L, t))
            rec.put(f"blk.{L}.indexer_scores", scores[0])
            rec.put(f"blk.{L}.indexer_topk", sel.to(torch.int32))
            # For the attention mask: pad each row with its own position (always selected there).
            pad = torch.arange(S).unsqueeze(1).expand(S, n_sel)
            idx = torch.where(sel >= 0, sel, pad)
            return idx.unsqueeze(0).to(torch.int32)

        patch(mod.GlmMoeDsaIndexer, "forward", indexer_forward)

    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def install_hooks(model, rec: Recorder) -> list:
    """Forward hooks for every hook point that is a module input or output."""
    handles = []
    m = model.model

    def out_hook(name):
        def fn(module, args, output):
            rec.put(name.format(L=rec.layer), _first(output)[0])

        return fn

    def in_hook(name):
        def fn(module, args, output):
            rec.put(name.format(L=rec.layer), args[0][0])

        return fn

    handles.append(m.embed_tokens.register_forward_hook(out_hook("token_embd")))
    handles.append(m.norm.register_forward_hook(out_hook("result_norm")))
    handles.append(model.lm_head.register_forward_hook(out_hook("logits")))
    for i, layer in enumerate(m.layers):

        def set_layer(module, args, i=i):
            rec.layer = i

        handles.append(layer.register_forward_pre_hook(set_layer))
        a = layer.self_attn
        handles.append(layer.input_layernorm.register_forward_hook(out_hook("blk.{L}.attn_norm")))
        handles.append(a.q_a_proj.register_forward_hook(out_hook("blk.{L}.q_a")))
        handles.append(a.q_a_layernorm.register_forward_hook(out_hook("blk.{L}.q_a_norm")))
        handles.append(a.q_b_proj.register_forward_hook(out_hook("blk.{L}.q_b")))
        handles.append(a.kv_a_proj_with_mqa.register_forward_hook(out_hook("blk.{L}.kv_a")))
        handles.append(a.kv_a_layernorm.register_forward_hook(out_hook("blk.{L}.kv_a_norm")))
        handles.append(a.o_proj.register_forward_hook(in_hook("blk.{L}.attn_heads")))
        handles.append(a.o_proj.register_forward_hook(out_hook("blk.{L}.attn_out")))
        handles.append(layer.post_attention_layernorm.register_forward_hook(in_hook("blk.{L}.ffn_inp")))
        handles.append(layer.post_attention_layernorm.register_forward_hook(out_hook("blk.{L}.ffn_norm")))
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            handles.append(mlp.experts.register_forward_hook(
                lambda mod_, args, out: rec.put(f"blk.{rec.layer}.moe_routed", out)))
            handles.append(mlp.shared_experts.register_forward_hook(out_hook("blk.{L}.ffn_shexp")))
        else:
            handles.append(mlp.gate_proj.register_forward_hook(out_hook("blk.{L}.ffn_gate")))
            handles.append(mlp.up_proj.register_forward_hook(out_hook("blk.{L}.ffn_up")))
            handles.append(mlp.down_proj.register_forward_hook(in_hook("blk.{L}.ffn_act")))
        handles.append(mlp.register_forward_hook(out_hook("blk.{L}.ffn_out")))
        handles.append(layer.register_forward_hook(out_hook("blk.{L}.l_out")))
    return handles


def fix_mla_norm_eps(model) -> None:
    """Spec section 5: use rms_norm_eps for q_a_layernorm and kv_a_layernorm (transformers: 1e-6)."""
    eps = model.config.rms_norm_eps
    for layer in model.model.layers:
        layer.self_attn.q_a_layernorm.variance_epsilon = eps
        layer.self_attn.kv_a_layernorm.variance_epsilon = eps


def golden_trace(model, arch: str, ids: list[int]) -> Recorder:
    """Run the float64 model on `ids` (one sequence, positions 0..T-1) and record every hook."""
    model = model.double()
    fix_mla_norm_eps(model)
    rec = Recorder(model.config.num_hidden_layers)
    handles = install_hooks(model, rec)
    try:
        with float64_patches(model, arch, rec), torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits[0]
    if not torch.equal(logits, torch.from_numpy(rec.t["logits"])):
        raise RuntimeError("recorded logits differ from the model output")
    return rec


def plain_transformers_logits(model, ids: list[int]) -> np.ndarray:
    """Logits of the unpatched float64 model (with transformers' float32 parts), for comparison."""
    model = model.double()
    fix_mla_norm_eps(model)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].numpy()
