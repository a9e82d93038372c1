"""A trace's `__metadata__` (docs/hooks.md, "Trace files"). Pure."""

from __future__ import annotations

import json
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


def build_metadata(*, model_file: str, architecture: str, tokens: Sequence[int], engine: str, dtype: str,
                   mode: str = "chained", not_captured: Mapping[str, str] | None = None,
                   models: Sequence[str] | None = None, prompt: str | None = None,
                   extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Every metadata key of a trace, as strings.

    model_file: the GGUF file name glmdiff will run; architecture: its `general.architecture`; tokens: the prompt's
    ids (batch of one); engine: who computed it; dtype: compute precision (first word one of names.DTYPE_WORDS);
    not_captured: hook or glob -> why the engine could not give it; models: every GGUF the trace is exact for;
    extra: further keys (`indexer_dtype` ...), which cannot replace the keys above."""
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
    for k, v in (extra or {}).items():
        if k in meta:
            raise ValueError(f"glmdiff_hooks: metadata: extra key {k!r} would replace the package's value")
        meta[k] = str(v)
    return meta
