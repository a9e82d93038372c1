"""Hooks on vLLM's DeepSeek-V2/V3 and GLM-MoE-DSA model modules (vllm/model_executor/models/deepseek_v2.py; torch).

Written from vLLM's sources and NOT tested against a live vLLM (see `attach_vllm` for the settings it needs and
what it cannot capture). Tensor parallelism 1 only.
"""

from __future__ import annotations

import torch

from .meta import dtype_word
from .names import ARCH, INDEXER_POINTS, expected_hooks
from .recorder import Trace, causal_topk, first as _first


#: What vLLM computes inside fused kernels, with no module output to hook.
VLLM_FUSED = {
    "blk.*.moe_probs": "computed inside vLLM's fused grouped top-k routing kernel",
    "blk.*.moe_topk_ids": "computed inside vLLM's fused grouped top-k routing kernel",
    "blk.*.moe_weights": "computed inside vLLM's fused grouped top-k routing kernel",
    "blk.*.moe_routed": "FusedMoE's output: depending on the vLLM version it already holds the shared experts "
                        "or lacks routed_scaling_factor, so it is not the hook's value",
    "blk.*.indexer_scores": "computed inside vLLM's fused FP8 MQA-logits indexer kernel",
}


def attach_vllm(model, tokens: int, rec: Trace | None = None):
    """Registers the hooks on vLLM's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM / GLM-MoE-DSA model module
    (the torch module inside the worker). Returns (trace, detach). UNTESTED against a live vLLM.

    Needs: LLM(..., enforce_eager=True (torch.compile and CUDA graphs bypass module hooks),
    tensor_parallel_size=1, enable_prefix_caching=False, max_num_batched_tokens >= the prompt) and one prompt per
    trace; `tokens` is its length: forwards over another token count (warm-up, decode) are ignored. With vLLM's V1
    engine the model lives in a worker process: register and save through LLM.apply_model / collective_rpc, e.g.
        llm.apply_model(lambda m: glmdiff_hooks.vllm_start(m, len(ids)))
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1))
        llm.apply_model(lambda m: glmdiff_hooks.vllm_save(m, "x.trace.safetensors", ids, "model.gguf"))
    prompt_logprobs makes vLLM compute logits for every prompt position (without it only the last row exists and
    `logits` is listed as not captured).

    Fused ranges (VLLM_FUSED) are listed in `not_captured`; every other hook that does not fire in the installed
    version (a kernel fused there) is listed too, when the trace is saved."""
    inner = model.model
    cfg = inner.config
    layers = list(inner.layers)
    rec = rec or Trace(len(layers), tokens=tokens)
    rec.tokens = tokens
    dsa = hasattr(cfg, "index_topk")
    dense = {i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "experts")}
    rec.architecture = ARCH.get(getattr(cfg, "model_type", ""), "deepseek2")
    q_lora = getattr(cfg, "q_lora_rank", None)
    rec.expected = expected_hooks(len(layers), dense, dsa, q_lora=q_lora is not None)
    for k, v in VLLM_FUSED.items():
        if dsa or "indexer" not in k:
            rec.skip(k, v)
    dt = next(model.parameters()).dtype
    try:
        import vllm

        ver = vllm.__version__
    except Exception:  # noqa: BLE001
        ver = "?"
    rec.engine = f"vllm-{ver} {str(dt).replace('torch.', '')}"
    rec.dtype = f"{dtype_word(dt)} (vLLM)"
    handles = []

    def hook(module, fn):
        if module is not None:
            handles.append(module.register_forward_hook(fn))

    def put_out(name):
        return lambda module, args, output: rec.put(name.format(L=rec.layer), _first(output))

    hook(inner.embed_tokens, put_out("token_embd"))

    def final_norm(module, args, output):
        if isinstance(output, (tuple, list)):  # fused add + RMSNorm: (normed, residual = last l_out)
            rec.put(f"blk.{len(layers) - 1}.l_out", output[1])
        rec.put("result_norm", _first(output))

    hook(inner.norm, final_norm)

    def logits_hook(module, args, output):
        if output is not None and output.dim() == 2 and output.shape[0] == tokens:
            rec.put("logits", output)

    hook(getattr(model, "logits_processor", None), logits_hook)
    for i, layer in enumerate(layers):
        def set_layer(module, args, i=i):
            rec.layer = i

        handles.append(layer.register_forward_pre_hook(set_layer))

        def in_norm(module, args, output, i=i):
            if isinstance(output, (tuple, list)):  # (normed, residual = previous layer's l_out)
                rec.put(f"blk.{i - 1}.l_out", output[1])
            rec.put(f"blk.{i}.attn_norm", _first(output))

        hook(layer.input_layernorm, in_norm)
        a = layer.self_attn
        fused = getattr(a, "fused_qkv_a_proj", None)
        if fused is not None and q_lora is not None:
            def qkv_a(module, args, output, i=i):
                x = _first(output)
                rec.put(f"blk.{i}.q_a", x[:, :q_lora])
                rec.put(f"blk.{i}.kv_a", x[:, q_lora:])

            hook(fused, qkv_a)
        else:
            hook(getattr(a, "q_a_proj", None), put_out("blk.{L}.q_a"))
            hook(getattr(a, "kv_a_proj_with_mqa", None), put_out("blk.{L}.kv_a"))
        hook(getattr(a, "q_a_layernorm", None), put_out("blk.{L}.q_a_norm"))
        q_b = getattr(a, "q_b_proj", None) if q_lora is not None else getattr(a, "q_proj", None)
        hook(q_b, put_out("blk.{L}.q_b"))
        hook(getattr(a, "kv_a_layernorm", None), put_out("blk.{L}.kv_a_norm"))

        def rope(module, args, output, i=i):
            # DeepSeek's rotary_emb is not NeoX style: pairs (2i, 2i+1), the GGUF order. q_pe [T, H, rope],
            # k_pe [T, 1, rope]; the first call of the layer is the attention's.
            q_pe, k_pe = output[0], output[1]
            name = f"blk.{i}.q_pe_rope"
            if name not in rec.t:
                rec.put(name, q_pe.reshape(q_pe.shape[0], -1, q_pe.shape[-1]))
                rec.put(f"blk.{i}.k_pe_rope", k_pe.reshape(k_pe.shape[0], -1))

        hook(getattr(a, "rotary_emb", None), rope)
        o = getattr(a, "o_proj", None)
        if o is not None:
            handles.append(o.register_forward_hook(
                lambda module, args, output, i=i: (rec.put(f"blk.{i}.attn_heads", args[0]),
                                                   rec.put(f"blk.{i}.attn_out", _first(output)))))
        ix = getattr(a, "indexer", None)
        if ix is not None:
            k = int(cfg.index_topk)

            def ix_hook(module, args, output, i=i, k=k):
                sel = _first(output)
                if torch.is_tensor(sel) and not sel.is_floating_point() and sel.dim() == 2:
                    rec.put(f"blk.{i}.indexer_topk", causal_topk(sel, k))
                else:
                    rec.skip(f"blk.{i}.indexer_topk", "the indexer's output is not a [T, k] index tensor here")

            hook(ix, ix_hook)
        elif dsa:
            for p in INDEXER_POINTS:
                rec.skip(f"blk.{i}.{p}", "this layer reuses an earlier layer's DSA selection")

        def post_norm(module, args, output, i=i):
            if isinstance(output, (tuple, list)):  # fused add + RMSNorm: (normed, residual = h + attn_out)
                rec.put(f"blk.{i}.ffn_inp", output[1])
            rec.put(f"blk.{i}.ffn_norm", _first(output))

        hook(layer.post_attention_layernorm, post_norm)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            def gate(module, args, output, i=i):
                x = _first(output)
                if torch.is_tensor(x) and x.dim() == 2:
                    rec.put(f"blk.{i}.moe_logits", x)

            hook(getattr(mlp, "gate", None), gate)
            hook(getattr(mlp, "shared_experts", None), put_out("blk.{L}.ffn_shexp"))
        else:
            def gate_up(module, args, output, i=i):
                x = _first(output)
                half = x.shape[-1] // 2
                rec.put(f"blk.{i}.ffn_gate", x[:, :half])
                rec.put(f"blk.{i}.ffn_up", x[:, half:])

            hook(getattr(mlp, "gate_up_proj", None), gate_up)
            hook(getattr(mlp, "act_fn", None), put_out("blk.{L}.ffn_act"))
        hook(mlp, put_out("blk.{L}.ffn_out"))

    def detach():
        for h in handles:
            h.remove()
        handles.clear()

    return rec, detach


def vllm_start(model, tokens: int) -> None:
    """For LLM.apply_model: attaches the hooks and keeps the trace on the model."""
    rec, detach = attach_vllm(model, tokens)
    model._glmdiff_trace = (rec, detach)


def vllm_save(model, path: str, tokens: list[int], model_file: str | None = None, **kw) -> str:
    """For LLM.apply_model: removes the hooks and writes the trace kept by vllm_start (keywords as Trace.save:
    gguf_path=THE.gguf writes its model_digest and names the model after it when model_file is not given)."""
    rec, detach = model._glmdiff_trace
    detach()
    del model._glmdiff_trace
    return str(rec.save(path, model_file=model_file, tokens=tokens, **kw))


