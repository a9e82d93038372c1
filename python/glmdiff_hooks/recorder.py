"""The recorder of one forward pass (torch): hook tensors under glmdiff's names, what could not be captured,
and the trace file written through the pure parts (names, shapes, meta, writer)."""

from __future__ import annotations

from pathlib import Path

import torch

from . import names, selection, shapes
from .digest import model_digest
from .meta import build_metadata
from .writer import write_safetensors


def first(x):
    """The first element of a module output that is a tuple or list, else the output itself."""
    return x[0] if isinstance(x, (tuple, list)) else x


def causal_topk(sel: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k'] selected positions -> [T, min(k, T)] I32, as selection.causal_topk_rows."""
    rows = selection.causal_topk_rows(sel.detach().to("cpu").long().tolist(), k)
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), min(k, len(rows)))


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
        self.architecture: str | None = None

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
        for name in self.expected:
            if name not in self.t and not any(names.glob_matches(p, name) for p in self.not_captured):
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

    def save(self, path: str | Path, *, model_file: str | None = None, tokens: list[int],
             models: list[str] | None = None, prompt: str | None = None, architecture: str | None = None,
             extra: dict | None = None, gguf_path: str | Path | None = None) -> Path:
        """Writes the trace (safetensors, sorted keys, written to a temporary file and renamed).

        model_file: the GGUF file name glmdiff will run (metadata `model`); gguf_path: that GGUF file itself (any
        shard of a split model): the trace then carries its `model_digest` (docs/hooks.md; needs gguf-py), and
        model_file defaults to its base name; one of the two is required. models: every GGUF the trace is exact
        for (metadata `models`); tokens: the prompt's ids (batch of one)."""
        if model_file is None and gguf_path is None:
            raise TypeError("glmdiff_hooks: Trace.save() needs model_file (the GGUF file name) or gguf_path")
        if not self.t:
            raise RuntimeError("glmdiff_hooks: nothing was recorded (did the forward pass run inside capture?)")
        tensors = self.tensors()
        for k, v in tensors.items():
            shapes.check_hook(k, list(v.shape), not v.is_floating_point(), len(tokens))
        digest = None
        if gguf_path is not None:
            digest = model_digest(gguf_path)
            if model_file is None:
                model_file = Path(gguf_path).name
        meta = build_metadata(model_file=model_file, architecture=architecture or self.architecture or "?",
                              tokens=tokens, engine=self.engine, dtype=self.dtype, not_captured=self.missing(),
                              models=models, prompt=prompt, model_digest=digest, extra=extra)
        return write_safetensors(Path(path), {k: v.numpy() for k, v in tensors.items()}, meta)
