"""Shape and dtype checks of a trace's hooks before it is written (docs/hooks.md's shape column). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from . import names


def check_hook(name: str, shape: Sequence[int], is_int: bool, tokens: int) -> None:
    """Raises ValueError naming the hook when its shape or kind cannot be what glmdiff reads for `tokens` tokens.

    Every hook is [T, ...] (batch dropped) except `attn_probs`, [H, T, T], and `exp.{e}.out`, [n_e, hidden] with
    n_e <= T tokens routed to the expert. The number of dimensions is the table's; ids hooks are integers and the
    others floats."""
    shape = [int(d) for d in shape]
    layer, point = names.parse_hook(name)
    want = names.rank(name)
    if len(shape) != want:
        raise ValueError(f"glmdiff_hooks: hook {name} has shape {shape}, not {want} dimensions")
    if point == "attn_probs":
        if shape[1:] != [tokens, tokens]:
            raise ValueError(f"glmdiff_hooks: hook {name} has shape {shape}, not [H, {tokens}, {tokens}]")
    elif point == "exp.{e}.out":
        if shape[0] > tokens:
            raise ValueError(f"glmdiff_hooks: hook {name} has {shape[0]} rows, more than the {tokens} tokens")
    elif shape[0] != tokens:
        raise ValueError(f"glmdiff_hooks: hook {name} has shape {shape}, not [{tokens}, ...]")
    ids = point in names.ID_POINTS
    if ids != bool(is_int):
        kind = "integer ids" if ids else "floats"
        raise ValueError(f"glmdiff_hooks: hook {name} must hold {kind}, not {'integers' if is_int else 'floats'}")
