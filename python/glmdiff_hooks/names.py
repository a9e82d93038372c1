"""Hook names of a glmdiff trace (docs/hooks.md), read from the package's `hooks.json`.

Pure: no torch, no numpy. `hooks.json` is the one list of hook points and metadata keys the package
uses; glmdiff's own test suite (tests/hook_script.rs) checks it against glmdiff's steps and docs/hooks.md.
"""

from __future__ import annotations

import json
import re
from importlib import resources

#: The parsed `hooks.json`.
SPEC: dict = json.loads(resources.files(__package__).joinpath("hooks.json").read_text(encoding="utf-8"))

#: Value of the `glmdiff_trace` metadata key.
TRACE_FORMAT: str = SPEC["trace_format"]
#: transformers / vLLM `model_type` -> GGUF `general.architecture`.
ARCH: dict[str, str] = dict(SPEC["architectures"])
#: Metadata keys every trace carries, and the optional ones.
REQUIRED_KEYS: list[str] = list(SPEC["metadata"]["required"])
OPTIONAL_KEYS: list[str] = list(SPEC["metadata"]["optional"])
#: First words of the `dtype` metadata that set tolerance floors.
DTYPE_WORDS: list[str] = list(SPEC["dtype_words"])
#: Values of the `mode` metadata.
MODES: list[str] = list(SPEC["modes"])

#: Per-layer points in forward order, each with the condition under which a layer has it
#: (`always`, `q_lora`: models with a q LoRA, `dsa`: GLM-5's indexer, `dense` / `moe` layers).
LAYER_POINTS: list[dict] = list(SPEC["layer_points"])
#: Global hooks before and after the layers.
GLOBAL_FIRST: list[str] = [p["point"] for p in SPEC["global_first"]]
GLOBAL_LAST: list[str] = [p["point"] for p in SPEC["global_last"]]
#: Per-layer points glmdiff produces only when asked (`--hook`); `exp.{e}.out` stands for every expert.
OPTIONAL_LAYER_POINTS: list[str] = [p["point"] for p in SPEC["optional_layer_points"]]
#: Points stored as integer ids (I32).
ID_POINTS: frozenset[str] = frozenset(p["point"] for p in LAYER_POINTS if p.get("ids"))

INDEXER_POINTS: list[str] = [p["point"] for p in LAYER_POINTS if p["when"] == "dsa"]
DENSE_POINTS: list[str] = [p["point"] for p in LAYER_POINTS if p["when"] == "dense"]
MOE_POINTS: list[str] = [p["point"] for p in LAYER_POINTS if p["when"] == "moe"]

_GLOBAL_RANK = {p["point"]: p["rank"] for p in SPEC["global_first"] + SPEC["global_last"]}
_LAYER_RANK = {p["point"]: p["rank"] for p in LAYER_POINTS + SPEC["optional_layer_points"]}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXP_OUT = re.compile(r"^exp\.\d+\.out$")


def layer_points(*, dense: bool, dsa: bool, q_lora: bool = True) -> list[str]:
    """The standard points of one layer, in forward order."""
    on = {"always": True, "q_lora": q_lora, "dsa": dsa, "dense": dense, "moe": not dense}
    return [p["point"] for p in LAYER_POINTS if on[p["when"]]]


def expected_hooks(n_layers: int, dense: set[int], dsa: bool, q_lora: bool = True) -> list[str]:
    """Every standard hook of a model with `n_layers` run layers (`dense`: the dense ones), in forward order."""
    names = list(GLOBAL_FIRST)
    for L in range(n_layers):
        names += [f"blk.{L}.{p}" for p in layer_points(dense=L in dense, dsa=dsa, q_lora=q_lora)]
    return names + list(GLOBAL_LAST)


def parse_hook(name: str) -> tuple[int | None, str]:
    """(layer, point) of a hook name: (None, "logits"), (3, "q_a"), and (3, "exp.{e}.out") for blk.3.exp.7.out.

    Raises ValueError for a name that is not one of glmdiff's hooks (glmdiff would not compare it)."""
    if name in _GLOBAL_RANK:
        return None, name
    m = _BLK.match(name)
    if m:
        layer, point = int(m.group(1)), m.group(2)
        if _EXP_OUT.match(point):
            return layer, "exp.{e}.out"
        if point in _LAYER_RANK and point != "exp.{e}.out":
            return layer, point
    raise ValueError(f"glmdiff_hooks: {name!r} is not a glmdiff hook name (docs/hooks.md)")


def rank(name: str) -> int:
    """Number of dimensions of hook `name` (docs/hooks.md's shape column)."""
    layer, point = parse_hook(name)
    return _GLOBAL_RANK[point] if layer is None else _LAYER_RANK[point]


def is_id_hook(name: str) -> bool:
    """Whether hook `name` holds integer ids (stored as I32)."""
    return parse_hook(name)[1] in ID_POINTS


def glob_matches(pattern: str, name: str) -> bool:
    """glmdiff's hook globs (src/util/glob.rs): `*` any run of characters (dots included), `?` one character."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, name, flags=re.DOTALL) is not None
