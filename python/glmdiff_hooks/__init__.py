"""glmdiff_hooks: traces of glmdiff's hook points (docs/hooks.md) from the engines users serve with.

It registers forward hooks on a running model, records every hook point the engine exposes under glmdiff's
names, shapes and element order, and writes a safetensors trace for `glmdiff run MODEL.gguf --against
trace:FILE` and `glmdiff compare`. Nothing in the model's arithmetic is changed: hooks only read.

transformers (`GlmMoeDsaForCausalLM`, `DeepseekV3ForCausalLM`), tested with transformers 5.17:

    import glmdiff_hooks
    with glmdiff_hooks.capture_transformers(model) as rec:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    rec.save("glm5.trace.safetensors", gguf_path="GLM-5-UD-Q4_K_XL-00001-of-00009.gguf", tokens=ids)

    then: glmdiff run GLM-5-UD-Q4_K_XL-00001-of-00009.gguf --against trace:glm5.trace.safetensors

  or from the command line: glmdiff-hooks --hf DIR_OR_HUB_ID --tokens 1,2,3 --gguf X.gguf --out T

  gguf_path (--gguf) writes the GGUF's `model_digest` (docs/hooks.md; needs gguf-py), which glmdiff checks against
  the model it runs: a trace of another model file is an error. model_file= (--gguf-name) only names the file.

vLLM (DeepSeek-V2/V3 and GLM-MoE-DSA through vllm/model_executor/models/deepseek_v2.py): written from vLLM's
sources and NOT tested against a live vLLM (`attach_vllm`, `vllm_start`, `vllm_save`). Tensor parallelism 1 only.

Conventions (docs/hooks.md):
- Every tensor drops the batch dimension (batch size 1); shapes are [T, ...] in PyTorch order.
- Floats are stored as F32 (F64 for a float64 model, so nothing is lost); ids as I32.
- q_pe_rope / k_pe_rope keep the GGUF's element order: rotated adjacent pairs (2i, 2i+1). transformers'
  interleaved-RoPE helper returns them de-interleaved (evens, then odds); they are re-interleaved here.
- moe_topk_ids / moe_weights are sorted by descending selection score (sigmoid(logit) + correction bias);
  indexer_topk keeps the causal positions of the engine's selection (k = min(index_topk, t+1)), -1 padded.
- Hooks that the engine computes inside a fused kernel with no module boundary, or that did not fire, are
  listed in the trace metadata `not_captured` (a JSON object hook -> reason); `glmdiff run` names them and
  shows those hooks as not in the trace.

Modules: the pure parts import without torch (`names` and its data file `hooks.json`, `shapes`, `rope`,
`selection`, `meta`, `digest` (a GGUF's `model_digest`, with gguf-py imported on use), and `writer`, which needs
numpy); the hooks (`recorder`, `transformers_hooks`, `vllm_hooks`) import torch, and are loaded on first use of
their names here.
"""

from __future__ import annotations

import importlib

from ._version import __version__
from .digest import model_digest
from .meta import build_metadata, dtype_word, hook_script
from .names import ARCH, TRACE_FORMAT, expected_hooks, glob_matches, parse_hook
from .rope import deinterleave_perm, reinterleave, reinterleave_perm
from .selection import causal_topk_rows
from .shapes import check_hook
from .writer import encode_safetensors, write_safetensors

#: Names served by a torch module, imported on first access (PEP 562).
_LAZY = {
    "Trace": "recorder",
    "causal_topk": "recorder",
    "attach_transformers": "transformers_hooks",
    "capture_transformers": "transformers_hooks",
    "attach_vllm": "vllm_hooks",
    "vllm_start": "vllm_hooks",
    "vllm_save": "vllm_hooks",
    "VLLM_FUSED": "vllm_hooks",
    "main": "cli",
}

__all__ = ["__version__", "ARCH", "TRACE_FORMAT", "build_metadata", "causal_topk_rows", "check_hook",
           "deinterleave_perm", "dtype_word", "encode_safetensors", "expected_hooks", "glob_matches", "hook_script",
           "model_digest", "parse_hook", "reinterleave", "reinterleave_perm", "write_safetensors", *_LAZY]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'glmdiff_hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
