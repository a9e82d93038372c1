"""A trace's `__metadata__` (docs/hooks.md, "Trace files"). Pure."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from . import names
from ._version import __version__

_DTYPE_WORD = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
               "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


def hook_script() -> str:
    """The `hook_script` metadata: this package and its version."""
    return f"glmdiff_hooks {__version__}"


def dtype_word(dt) -> str:
    """The first word of a trace's `dtype` metadata for a compute dtype (a torch dtype or its name)."""
    s = str(dt)
    s = s[len("torch."):] if s.startswith("torch.") else s
    return _DTYPE_WORD.get(s, s)


def _digest_text(value: str | Mapping) -> str:
    """A `model_digest` value checked as glmdiff reads it (docs/hooks.md), as its metadata text."""
    def bad(why: str) -> ValueError:
        return ValueError(f"glmdiff_hooks: metadata: model_digest is malformed: {why} (expected "
                          '{"algorithm": "sha256", "prefix_bytes": N, "tensors": {name: hex}}; docs/hooks.md)')

    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except ValueError as e:
            raise bad(f"not JSON: {e}") from None
    else:
        obj, value = value, None
    if not isinstance(obj, Mapping):
        raise bad("not a JSON object")
    if obj.get("algorithm") != "sha256":
        raise bad(f"algorithm is {obj.get('algorithm')!r}, not 'sha256'")
    pb = obj.get("prefix_bytes")
    if isinstance(pb, bool) or not isinstance(pb, int) or pb <= 0:
        raise bad("prefix_bytes is not a positive integer")
    tensors = obj.get("tensors")
    if not isinstance(tensors, Mapping) or not tensors:
        raise bad("tensors is not a non-empty object")
    for k, h in tensors.items():
        if not isinstance(h, str) or not re.fullmatch(r"[0-9a-f]{64}", h):
            raise bad(f"tensor {k!r}: {h!r} is not 64 lowercase hex digits")
    if value is not None:
        return value
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def build_metadata(*, model_file: str, architecture: str, tokens: Sequence[int], engine: str, dtype: str,
                   mode: str = "chained", not_captured: Mapping[str, str] | None = None,
                   models: Sequence[str] | None = None, prompt: str | None = None,
                   model_digest: str | Mapping | None = None,
                   extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Every metadata key of a trace, as strings.

    model_file: the GGUF file name glmdiff will run; architecture: its `general.architecture`; tokens: the prompt's
    ids (batch of one); engine: who computed it; dtype: compute precision (first word one of names.DTYPE_WORDS);
    not_captured: hook or glob -> why the engine could not give it; models: every GGUF the trace is exact for;
    model_digest: which GGUF file the trace was made from, by content (`digest.model_digest(path)`, its JSON text,
    or the object); extra: further keys (`indexer_dtype` ...), which cannot replace the keys above."""
    if not model_file:
        raise ValueError("glmdiff_hooks: metadata: model (the GGUF file name) is empty")
    known = sorted(set(names.ARCH.values()))
    if architecture not in known:
        raise ValueError(f"glmdiff_hooks: metadata: architecture {architecture!r} is not one of {known}")
    if mode not in names.MODES:
        raise ValueError(f"glmdiff_hooks: metadata: mode {mode!r} is not one of {names.MODES}")
    ids = []
    for i, t in enumerate(tokens):
        try:
            ok = not isinstance(t, bool) and int(t) == t and int(t) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"glmdiff_hooks: metadata: token {i} is {t!r}, not a token id")
        ids.append(int(t))
    if not ids:
        raise ValueError("glmdiff_hooks: metadata: tokens is empty")
    meta = {
        "glmdiff_trace": names.TRACE_FORMAT,
        "model": model_file,
        "architecture": architecture,
        "tokens": json.dumps(ids),
        "engine": engine,
        "dtype": dtype,
        "mode": mode,
        "not_captured": json.dumps(dict(not_captured or {}), sort_keys=True),
        "hook_script": hook_script(),
    }
    if models is not None:
        meta["models"] = json.dumps(list(models))
    if prompt is not None:
        meta["prompt"] = prompt
    if model_digest is not None:
        meta["model_digest"] = _digest_text(model_digest)
    for k, v in (extra or {}).items():
        if k in meta:
            raise ValueError(f"glmdiff_hooks: metadata: extra key {k!r} would replace the package's value")
        meta[k] = str(v)
    return meta
