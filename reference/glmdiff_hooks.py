"""glmdiff_hooks: traces of glmdiff's hook points (shared/spec/hooks.md) from the engines users serve with.

One importable file, no dependency beyond torch, numpy and safetensors. It registers forward hooks on a
running model, records every hook point the engine exposes under glmdiff's names, shapes and element
order, and writes a safetensors trace for `glmdiff run MODEL.gguf --against trace:FILE` and
`glmdiff compare`. Nothing in the model's arithmetic is changed: hooks only read.

transformers (`GlmMoeDsaForCausalLM`, `DeepseekV3ForCausalLM`), tested with transformers 5.17:

    import glmdiff_hooks
    with glmdiff_hooks.capture_transformers(model) as rec:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    rec.save("glm5.trace.safetensors", model_file="GLM-5-UD-Q4_K_XL-00001-of-00009.gguf", tokens=ids)

    then: glmdiff run GLM-5-UD-Q4_K_XL-00001-of-00009.gguf --against trace:glm5.trace.safetensors

  or from the command line: python3 glmdiff_hooks.py --hf DIR_OR_HUB_ID --tokens 1,2,3 --gguf-name X.gguf --out T

vLLM (DeepSeek-V2/V3 and GLM-MoE-DSA through vllm/model_executor/models/deepseek_v2.py): written from vLLM's
sources and NOT tested against a live vLLM (see `attach_vllm` for the settings it needs and what it cannot
capture). Tensor parallelism 1 only.

Conventions (shared/spec/hooks.md):
- Every tensor drops the batch dimension (batch size 1); shapes are [T, ...] in PyTorch order.
- Floats are stored as F32 (F64 for a float64 model, so nothing is lost); ids as I32.
- q_pe_rope / k_pe_rope keep the GGUF's element order: rotated adjacent pairs (2i, 2i+1). transformers'
  interleaved-RoPE helper returns them de-interleaved (evens, then odds); they are re-interleaved here.
- moe_topk_ids / moe_weights are sorted by descending selection score (sigmoid(logit) + correction bias);
  indexer_topk keeps the causal positions of the engine's selection (k = min(index_topk, t+1)), -1 padded.
- Hooks that the engine computes inside a fused kernel with no module boundary, or that did not fire, are
  listed in the trace metadata `not_captured` (a JSON object hook -> reason); `glmdiff run` names them and
  shows those hooks as not in the trace.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

__version__ = "1"
TRACE_FORMAT = "1"

#: Per-layer points of shared/spec/hooks.md, in forward order (dense layers use ffn_gate/up/act, MoE layers
#: the moe_* points and ffn_shexp; indexer_* are GLM-5 only).
ATTN_POINTS = ["attn_norm", "q_a", "q_a_norm", "q_b", "q_pe_rope", "kv_a", "kv_a_norm", "k_pe_rope"]
INDEXER_POINTS = ["indexer_scores", "indexer_topk"]
POST_ATTN_POINTS = ["attn_heads", "attn_out", "ffn_inp", "ffn_norm"]
DENSE_POINTS = ["ffn_gate", "ffn_up", "ffn_act"]
MOE_POINTS = ["moe_logits", "moe_probs", "moe_topk_ids", "moe_weights", "moe_routed", "ffn_shexp"]
END_POINTS = ["ffn_out", "l_out"]

ARCH = {"glm_moe_dsa": "glm-dsa", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2",
        "deepseek_v32": "glm-dsa"}


def reinterleave(x: torch.Tensor) -> torch.Tensor:
    """Inverse of transformers' de-interleave: [e0..e(n/2-1), o0..] -> [e0, o0, e1, o1, ...]."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., :half]
    out[..., 1::2] = x[..., half:]
    return out


def causal_topk(sel: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k'] selected positions (an engine may also pick masked future ones) -> [T, min(k, T)] causal
    positions in the engine's order, -1 padded, as shared/spec/hooks.md's indexer_topk."""
    s = sel.detach().to("cpu").long()
    t_len = s.shape[0]
    width = min(k, t_len)
    out = torch.full((t_len, width), -1, dtype=torch.int32)
    for t in range(t_len):
        row = [int(x) for x in s[t] if 0 <= int(x) <= t][: min(width, t + 1)]
        if row:
            out[t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def dtype_word(dt: torch.dtype) -> str:
    """The first word of a trace's `dtype` metadata for a torch compute dtype."""
    return {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(dt, str(dt))


class Trace:
    """Hook tensors of one forward pass, under glmdiff's names, and what could not be captured."""

    def __init__(self, n_layers: int, tokens: int | None = None):
        self.n_layers = n_layers
        self.tokens = tokens  # when set, forwards over another number of tokens are ignored (vLLM warm-up, decode)
        self.t: dict[str, torch.Tensor] = {}
        self.layer: int | None = None
        self.not_captured: dict[str, str] = {}
        self.expected: list[str] = []  # every hook the architecture has (filled by the attach functions)
        self.complete = False
        self.engine = "?"
        self.dtype = "?"

    def put(self, name: str, x: torch.Tensor) -> None:
        """Records one hook (batch dimension already dropped). A second value for a name is an error."""
        if self.complete:
            return
        if self.tokens is not None and x.dim() > 0 and x.shape[0] != self.tokens:
            return
        if name in self.t:
            raise RuntimeError(f"glmdiff_hooks: hook {name} recorded twice (run one forward pass per trace)")
        self.t[name] = x.detach().to("cpu").clone().contiguous()

    def skip(self, pattern: str, reason: str) -> None:
        """Lists a hook (or a glob such as blk.*.moe_probs) the engine cannot give."""
        self.not_captured.setdefault(pattern, reason)

    def missing(self) -> dict[str, str]:
        """`not_captured` plus every expected hook that no hook recorded."""
        out = dict(self.not_captured)
        covered = [re.compile("^" + re.escape(p).replace(r"\*", ".*") + "$") for p in out]
        for name in self.expected:
            if name not in self.t and not any(c.match(name) for c in covered):
                out[name] = "no hook fired (computed inside a fused kernel in this engine or version)"
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The recorded tensors as stored: floats as F32 (F64 when computed in float64), ids as I32."""
        out = {}
        for k, v in self.t.items():
            if not v.is_floating_point():
                out[k] = v.to(torch.int32)
            elif v.dtype == torch.float64:
                out[k] = v
            else:
                out[k] = v.to(torch.float32)
        return out

    def save(self, path: str | Path, *, model_file: str, tokens: list[int], models: list[str] | None = None,
             prompt: str | None = None, architecture: str | None = None, extra: dict | None = None) -> Path:
        """Writes the trace (safetensors, sorted keys, written to a temporary file and renamed).

        model_file: the GGUF file name glmdiff will run (metadata `model`); models: every GGUF the trace is
        exact for (metadata `models`); tokens: the prompt's ids (batch of one)."""
        if not self.t:
            raise RuntimeError("glmdiff_hooks: nothing was recorded (did the forward pass run inside capture?)")
        t_len = len(tokens)
        for k, v in self.t.items():
            if v.dim() == 0 or v.shape[0] != t_len and not k.endswith("attn_probs"):
                raise RuntimeError(f"glmdiff_hooks: hook {k} has shape {list(v.shape)}, not [{t_len}, ...]")
        meta = {
            "glmdiff_trace": TRACE_FORMAT,
            "model": model_file,
            "architecture": architecture or getattr(self, "architecture", "?"),
            "tokens": json.dumps([int(x) for x in tokens]),
            "engine": self.engine,
            "dtype": self.dtype,
            "mode": "chained",
            "not_captured": json.dumps(self.missing(), sort_keys=True),
            "hook_script": f"glmdiff_hooks.py {__version__}",
        }
        if models is not None:
            meta["models"] = json.dumps(models)
        if prompt is not None:
            meta["prompt"] = prompt
        meta.update({k: str(v) for k, v in (extra or {}).items()})
        return write_safetensors(Path(path), self.tensors(), meta)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """safetensors with sorted keys (identical traces give identical bytes), written atomically."""
    st = {torch.float64: "F64", torch.float32: "F32", torch.int32: "I32"}
    header: dict = {"__metadata__": {k: str(meta[k]) for k in sorted(meta)}}
    blobs, off = [], 0
    for k in sorted(tensors):
        v = tensors[k].contiguous()
        if v.dtype not in st:
            raise RuntimeError(f"glmdiff_hooks: {k}: unexpected dtype {v.dtype}")
        raw = v.numpy().astype(v.numpy().dtype.newbyteorder("<")).tobytes()
        header[k] = {"dtype": st[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for b in blobs:
            f.write(b)
    tmp.replace(path)
    return path


def expected_hooks(n_layers: int, dense: set[int], dsa: bool) -> list[str]:
    """Every standard hook of a model with `n_layers` run layers (`dense`: the dense ones)."""
    names = ["token_embd"]
    for L in range(n_layers):
        pts = ATTN_POINTS + (INDEXER_POINTS if dsa else []) + POST_ATTN_POINTS
        pts += DENSE_POINTS if L in dense else MOE_POINTS
        names += [f"blk.{L}.{p}" for p in pts + END_POINTS]
    return names + ["result_norm", "logits"]


# ---------------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------------

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
    rec.expected = expected_hooks(len(layers), dense, dsa)
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
        hook(a.q_a_proj, out("blk.{L}.q_a"))
        hook(a.q_a_layernorm, out("blk.{L}.q_a_norm"))
        hook(a.q_b_proj, out("blk.{L}.q_b"))
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


# ---------------------------------------------------------------------------------------------------------
# vLLM (written from vllm/model_executor/models/deepseek_v2.py; not run against a live vLLM)
# ---------------------------------------------------------------------------------------------------------

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
    rec.expected = expected_hooks(len(layers), dense, dsa)
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
    q_lora = getattr(cfg, "q_lora_rank", None)

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
        hook(getattr(a, "q_b_proj", None), put_out("blk.{L}.q_b"))
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


def vllm_save(model, path: str, tokens: list[int], model_file: str, **kw) -> str:
    """For LLM.apply_model: removes the hooks and writes the trace kept by vllm_start."""
    rec, detach = model._glmdiff_trace
    detach()
    del model._glmdiff_trace
    return str(rec.save(path, model_file=model_file, tokens=tokens, **kw))


# ---------------------------------------------------------------------------------------------------------

def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Trace a transformers GLM-5 / DeepSeek-V3 model for glmdiff.")
    ap.add_argument("--hf", required=True, help="transformers checkpoint (directory or hub id)")
    ap.add_argument("--tokens", required=True, help="prompt ids, comma separated (as glmdiff run --tokens)")
    ap.add_argument("--gguf-name", required=True, help="the GGUF file name glmdiff will run (metadata `model`)")
    ap.add_argument("--out", required=True, help="output .safetensors")
    ap.add_argument("--dtype", default="bfloat16", choices=["float64", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="eager").to(args.device).eval()
    ids = [int(x) for x in args.tokens.split(",")]
    with capture_transformers(model) as rec, torch.no_grad():
        model(input_ids=torch.tensor([ids], device=args.device), use_cache=False)
    p = rec.save(args.out, model_file=args.gguf_name, tokens=ids)
    print(f"{p}: {len(rec.t)} hooks; not captured: {json.dumps(rec.missing())}")


if __name__ == "__main__":
    main()
