"""A float64 numpy forward pass of the spec, reading only a GGUF (through gguf-py).

This is a cross-check of the golden traces, not a source of them: it evaluates
shared/spec/glm5-architecture.md section 2 directly on the converter's tensors (absorbed MLA with
attn_k_b / attn_v_b, stacked experts, metadata keys as written by the converter), so agreement with
the transformers trace checks the GGUF layout, the hook definitions and the element order at once.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFReader
from gguf import quants as gq


def load_gguf(path) -> tuple[dict, dict[str, np.ndarray], dict[str, dict]]:
    """(metadata, float64 tensors in numpy shape, tensor info) of a GGUF file."""
    r = GGUFReader(str(path))
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        meta[f.name] = f.contents()
    tensors, info = {}, {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        vals = gq.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
        tensors[t.name] = vals
        info[t.name] = {"type": t.tensor_type.name, "ne": [int(x) for x in t.shape]}
    return meta, tensors, info


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope_inv_freq(meta: dict, arch: str, n_rot: int) -> tuple[np.ndarray, float]:
    """Interleaved-RoPE inverse frequencies and the YaRN attention mscale (1.0 without YaRN)."""
    base = float(meta[f"{arch}.rope.freq_base"])
    i = np.arange(0, n_rot, 2, dtype=np.float64)
    inv_extra = base ** (-i / n_rot)
    stype = meta.get(f"{arch}.rope.scaling.type", "none")
    if stype in ("none", None):
        return inv_extra, 1.0
    if stype != "yarn":
        raise ValueError(f"rope scaling {stype}")
    factor = float(meta[f"{arch}.rope.scaling.factor"])
    orig = float(meta[f"{arch}.rope.scaling.original_context_length"])
    beta_fast = float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0))
    beta_slow = float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))

    def corr(beta):
        return n_rot * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), n_rot - 1)
    ramp = np.clip((np.arange(n_rot // 2) - low) / max(high - low, 0.001), 0, 1)
    mask = 1.0 - ramp
    inv = inv_extra * mask + (inv_extra / factor) * (1 - mask)
    log_mul = float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    mscale = 1.0 + log_mul * math.log(factor)
    return inv, mscale


def rope(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """Interleaved RoPE on the last axis; x is [T, ..., n_rot] with T first."""
    ang = pos[:, None] * inv[None, :]  # [T, n_rot/2]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (ang.shape[1],)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    out = np.empty_like(x)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def forward(meta: dict, W: dict[str, np.ndarray], ids: list[int]) -> dict[str, np.ndarray]:
    """Every hook point of docs/hooks.md, computed from the GGUF in float64."""
    arch = meta["general.architecture"]
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    n_layer = int(g("block_count")) - int(g("nextn_predict_layers", 0))
    H = int(g("attention.head_count"))
    kvl = int(g("attention.kv_lora_rank"))
    qk = int(g("attention.key_length_mla"))
    vdim = int(g("attention.value_length_mla"))
    n_rot = int(g("rope.dimension_count"))
    nope = qk - n_rot
    eps = float(g("attention.layer_norm_rms_epsilon"))
    n_dense = int(g("leading_dense_block_count", 0))
    k_used = int(g("expert_used_count"))
    n_grp = int(g("expert_group_count", 1))
    grp_used = int(g("expert_group_used_count", n_grp))
    w_scale = float(g("expert_weights_scale", 1.0))
    w_norm = bool(g("expert_weights_norm", False))
    gating = int(g("expert_gating_func", 2 if arch == "glm-dsa" else 1))
    if gating != 2:
        raise ValueError(f"{arch}: expert_gating_func {gating} is not sigmoid")
    inv, mscale = rope_inv_freq(meta, arch, n_rot)
    scale = mscale * mscale / math.sqrt(qk)
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    causal = np.tril(np.ones((T, T), dtype=bool))
    out: dict[str, np.ndarray] = {}

    h = W["token_embd.weight"][ids]  # [T, hidden]
    out["token_embd"] = h
    for L in range(n_layer):
        p = f"blk.{L}."
        w = lambda n: W[p + n]  # noqa: E731
        a = rms_norm(h, w("attn_norm.weight"), eps)
        q_a = a @ w("attn_q_a.weight").T
        cq = rms_norm(q_a, w("attn_q_a_norm.weight"), eps)
        q = cq @ w("attn_q_b.weight").T  # [T, H*(nope+rope)]
        qh = q.reshape(T, H, qk)
        q_nope, q_pe = qh[..., :nope], rope(qh[..., nope:], pos, inv)
        kv = a @ w("attn_kv_a_mqa.weight").T  # [T, kvl + rope]
        c = rms_norm(kv[:, :kvl], w("attn_kv_a_norm.weight"), eps)
        k_pe = rope(kv[:, kvl:], pos, inv)  # [T, rope]
        out.update({p + "attn_norm": a, p + "q_a": q_a, p + "q_a_norm": cq, p + "q_b": q,
                    p + "q_pe_rope": q_pe, p + "kv_a": kv, p + "kv_a_norm": c, p + "k_pe_rope": k_pe})
        mask = causal.copy()
        if arch == "glm-dsa":
            nh = int(g("attention.indexer.head_count"))
            hd = int(g("attention.indexer.key_length"))
            topk = int(g("attention.indexer.top_k"))
            qi = (cq @ w("indexer.attn_q_b.weight").T).reshape(T, nh, hd)
            qi = np.concatenate([rope(qi[..., :n_rot], pos, inv), qi[..., n_rot:]], axis=-1)
            ki = a @ w("indexer.attn_k.weight").T  # [T, hd]
            mu = ki.mean(-1, keepdims=True)
            var = ((ki - mu) ** 2).mean(-1, keepdims=True)
            ki = (ki - mu) / np.sqrt(var + 1e-6) * w("indexer.k_norm.weight") + w("indexer.k_norm.bias")
            ki = np.concatenate([rope(ki[:, :n_rot], pos, inv), ki[:, n_rot:]], axis=-1)
            wi = (a @ w("indexer.proj.weight").T) * (nh ** -0.5) * (hd ** -0.5)  # [T, nh]
            dots = np.einsum("thd,sd->ths", qi, ki)
            I = np.einsum("th,ths->ts", wi, np.maximum(dots, 0.0))
            I = np.where(causal, I, -np.inf)
            n_sel = min(topk, T)
            sel = np.full((T, n_sel), -1, dtype=np.int32)
            mask = np.zeros((T, T), dtype=bool)
            for t in range(T):
                kt = min(topk, t + 1)
                order = np.argsort(-I[t, : t + 1], kind="stable")[:kt]
                sel[t, :kt] = order
                mask[t, order] = True
            out[p + "indexer_scores"] = I
            out[p + "indexer_topk"] = sel
        # absorbed MLA: q_lat[h][c] = sum_d k_b[h][c][d] q_nope[h][d]
        k_b, v_b = w("attn_k_b.weight"), w("attn_v_b.weight")  # [H, kvl, nope], [H, v, kvl]
        q_lat = np.einsum("hcd,thd->thc", k_b, q_nope)
        s = (np.einsum("thc,sc->hts", q_lat, c) + np.einsum("thr,sr->hts", q_pe, k_pe)) * scale
        s = np.where(mask[None], s, -np.inf)
        s = s - s.max(-1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(-1, keepdims=True)
        o_lat = np.einsum("hts,sc->thc", pr, c)
        heads = np.einsum("hjc,thc->thj", v_b, o_lat).reshape(T, H * vdim)
        attn_out = heads @ w("attn_output.weight").T
        h = h + attn_out
        f = rms_norm(h, w("ffn_norm.weight"), eps)
        out.update({p + "attn_heads": heads, p + "attn_out": attn_out, p + "ffn_inp": h, p + "ffn_norm": f})
        if L < n_dense:
            gate = f @ w("ffn_gate.weight").T
            up = f @ w("ffn_up.weight").T
            act = silu(gate) * up
            ffn = act @ w("ffn_down.weight").T
            out.update({p + "ffn_gate": gate, p + "ffn_up": up, p + "ffn_act": act})
        else:
            logits = f @ w("ffn_gate_inp.weight").T
            probs = sigmoid(logits)
            sc = probs + w("exp_probs_b.bias")
            E = sc.shape[1]
            ids_k = np.zeros((T, k_used), dtype=np.int32)
            for t in range(T):
                allowed = np.ones(E, dtype=bool)
                if grp_used < n_grp:
                    gs = np.sort(sc[t].reshape(n_grp, -1), axis=-1)[:, ::-1][:, :2].sum(-1)
                    keep = np.argsort(-gs, kind="stable")[:grp_used]
                    allowed = np.zeros((n_grp, E // n_grp), dtype=bool)
                    allowed[keep] = True
                    allowed = allowed.reshape(E)
                cand = np.where(allowed, sc[t], -np.inf)
                ids_k[t] = np.argsort(-cand, kind="stable")[:k_used]
            wk = np.take_along_axis(probs, ids_k, axis=1)
            if w_norm:
                wk = wk / wk.sum(-1, keepdims=True)
            wk = wk * w_scale
            ge, ue, de = w("ffn_gate_exps.weight"), w("ffn_up_exps.weight"), w("ffn_down_exps.weight")
            routed = np.zeros_like(f)
            for t in range(T):
                for j in range(k_used):
                    e = ids_k[t, j]
                    y = silu(ge[e] @ f[t]) * (ue[e] @ f[t])
                    routed[t] += wk[t, j] * (de[e] @ y)
            shexp = (silu(f @ w("ffn_gate_shexp.weight").T) * (f @ w("ffn_up_shexp.weight").T)) @ w(
                "ffn_down_shexp.weight").T
            ffn = routed + shexp
            out.update({p + "moe_logits": logits, p + "moe_probs": probs, p + "moe_topk_ids": ids_k,
                        p + "moe_weights": wk, p + "moe_routed": routed, p + "ffn_shexp": shexp})
        h = h + ffn
        out[p + "ffn_out"] = ffn
        out[p + "l_out"] = h
    rn = rms_norm(h, W["output_norm.weight"], eps)
    out["result_norm"] = rn
    out["logits"] = rn @ W.get("output.weight", W["token_embd.weight"]).T
    return out


def compare(golden: dict[str, np.ndarray], mine: dict[str, np.ndarray]) -> dict:
    """Per-hook max |diff| / max |golden| (finite entries), exact for integer hooks."""
    if set(golden) != set(mine):
        raise ValueError(f"hook sets differ: {sorted(set(golden) ^ set(mine))}")
    res = {}
    for k, gv in golden.items():
        mv = mine[k]
        if gv.shape != mv.shape:
            raise ValueError(f"{k}: shape {gv.shape} vs {mv.shape}")
        if gv.dtype.kind == "i":
            res[k] = 0.0 if np.array_equal(gv, mv) else float("inf")
            continue
        fin = np.isfinite(gv)
        if not np.array_equal(fin, np.isfinite(mv)) or not np.array_equal(gv[~fin], mv[~fin]):
            res[k] = float("inf")
            continue
        den = np.abs(gv[fin]).max() if fin.any() else 1.0
        res[k] = float(np.abs(gv[fin] - mv[fin]).max() / den) if fin.any() else 0.0
    return res
