"""`glmdiff-hooks`: trace a transformers GLM-5 / DeepSeek-V3 checkpoint for glmdiff from the command line.

    glmdiff-hooks --hf DIR_OR_HUB_ID --tokens 1,2,3 --gguf X.gguf --out T.safetensors

then `glmdiff run X.gguf --against trace:T.safetensors`. `--gguf PATH` names the model after the file and writes
its `model_digest` (read before the model is loaded; needs gguf-py); `--gguf-name NAME` only names it.
Exit codes: 0 written, 2 an error (one line on stderr).
torch and transformers are imported only after the arguments are read (`--help` needs neither).
"""

from __future__ import annotations

import argparse
import json
import sys

from ._version import __version__
from .digest import model_digest


def _ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not comma-separated token ids") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{s!r} is not comma-separated token ids")
    return ids


def parser() -> argparse.ArgumentParser:
    """The command line of `glmdiff-hooks`."""
    ap = argparse.ArgumentParser(prog="glmdiff-hooks",
                                 description="Trace a transformers GLM-5 / DeepSeek-V3 model for glmdiff.")
    ap.add_argument("--hf", required=True, help="transformers checkpoint (directory or hub id)")
    ap.add_argument("--tokens", required=True, type=_ids,
                    help="prompt ids, comma separated (as glmdiff run --tokens)")
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--gguf", metavar="PATH",
                       help="the GGUF file glmdiff will run (any shard of a split model): metadata `model` is its "
                            "base name and `model_digest` its content digest (needs gguf-py: pip install gguf)")
    model.add_argument("--gguf-name", metavar="NAME",
                       help="only the GGUF file name glmdiff will run (metadata `model`, no `model_digest`)")
    ap.add_argument("--out", required=True, help="output .safetensors")
    ap.add_argument("--dtype", default="bfloat16", choices=["float64", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--version", action="version", version=f"glmdiff_hooks {__version__}")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit code."""
    args = parser().parse_args(argv)
    try:
        if args.gguf is not None:  # the GGUF's errors (missing, not a GGUF, no gguf-py) before the model loads
            model_digest(args.gguf)
        import torch
        from transformers import AutoModelForCausalLM

        from .transformers_hooks import capture_transformers

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=getattr(torch, args.dtype),
                                                     attn_implementation="eager").to(device).eval()
        with capture_transformers(model) as rec, torch.no_grad():
            model(input_ids=torch.tensor([args.tokens], device=device), use_cache=False)
        if args.gguf is not None:
            p = rec.save(args.out, gguf_path=args.gguf, tokens=args.tokens)
        else:
            p = rec.save(args.out, model_file=args.gguf_name, tokens=args.tokens)
    except (ImportError, OSError, ValueError, RuntimeError) as e:
        print(f"glmdiff-hooks: {e}", file=sys.stderr)
        return 2
    print(f"{p}: {len(rec.t)} hooks; not captured: {json.dumps(rec.missing())}")
    return 0


def run() -> None:
    """Console entry point."""
    sys.exit(main())
