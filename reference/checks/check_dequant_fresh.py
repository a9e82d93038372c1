#!/usr/bin/env python3
"""Check `glmdiff dequant` bit for bit against gguf-py on freshly drawn random blocks.

Draws new random blocks of every type (seed from --seed, else from the clock; always printed so a
failure can be replayed), writes them into a GGUF in a temporary directory with gguf-py's
GGUFWriter (--split: a 3-shard model), runs

    glmdiff dequant MODEL TENSOR --out X.npy            (whole tensor)
    glmdiff dequant MODEL TENSOR --rows A..B --out Y.npy (a row range)

for every tensor, and compares the f32 bits with gguf.quants.dequantize. Prints one table row per
tensor; exits 0 when all match, 1 on any mismatch or failed command, 2 on a setup error.

Block generation is shared with reference/fixtures/make_quant_fixtures.py.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))  # make_quant_fixtures
import make_quant_fixtures as mk  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402

N_SPLIT_SHARDS = 3
INT_TYPES = (Q.I8, Q.I16, Q.I32)


def load_f32(path: Path) -> np.ndarray:
    """The single f32 array of a .npy or .safetensors output."""
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    from safetensors.numpy import load_file
    d = load_file(str(path))
    if len(d) != 1:
        raise ValueError(f"{path}: expected one tensor, found {sorted(d)}")
    return next(iter(d.values()))


def compare(got: np.ndarray, want: np.ndarray) -> str:
    """'ok', or a description of the first difference in shape, dtype or bits."""
    if got.dtype != np.float32:
        return f"dtype {got.dtype}, expected float32"
    if list(got.shape) != list(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    g = np.ascontiguousarray(got).reshape(-1).view(np.uint32)
    w = np.ascontiguousarray(want, dtype=np.float32).reshape(-1).view(np.uint32)
    bad = np.flatnonzero(g != w)
    if bad.size == 0:
        return "ok"
    i = int(bad[0])
    gv, wv = g[i:i + 1].view(np.float32)[0], w[i:i + 1].view(np.float32)[0]
    return (f"{bad.size} of {g.size} differ; first [{i}]: glmdiff {gv.item():.9g} ({g[i]:#010x}), "
            f"gguf-py {wv.item():.9g} ({w[i]:#010x})")


def run_dequant(bin_path: Path, model: Path, name: str, out: Path, rows: tuple[int, int] | None) -> str | None:
    """Runs glmdiff dequant; returns None on success, else the command's error text."""
    cmd = [str(bin_path), "dequant", str(model), name, "--out", str(out)]
    if rows is not None:
        cmd[4:4] = ["--rows", f"{rows[0]}..{rows[1]}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        lines = (p.stderr.strip() or p.stdout.strip() or f"exit {p.returncode}").splitlines()
        return f"exit {p.returncode}: {lines[-1] if lines else ''}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="RNG seed (default: from the clock, printed)")
    ap.add_argument("--bin", type=Path, default=Path("target/release/glmdiff"), help="glmdiff binary")
    ap.add_argument("--split", action="store_true", help=f"write a {N_SPLIT_SHARDS}-shard model and go through it")
    ap.add_argument("--scale", type=int, default=1, help="multiply the slowest dimension of every tensor by this")
    ap.add_argument("--types", default="", help="only these types, comma separated (e.g. q4_k,iq2_xs)")
    ap.add_argument("--format", choices=["npy", "safetensors"], default="npy", help="output format to request")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory and print its path")
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else time.time_ns() % (2**32)
    if not args.bin.is_file():
        print(f"check_dequant_fresh: no glmdiff binary at {args.bin} (build it with cargo build --release, "
              "or pass --bin)", file=sys.stderr)
        return 2
    only = {s.strip().upper() for s in args.types.split(",") if s.strip()}
    unknown = only - {t.name for t, _ in mk.TENSOR_SPECS}
    if unknown:
        print(f"check_dequant_fresh: unknown types {sorted(unknown)}", file=sys.stderr)
        return 2
    print(f"seed {seed} (replay with --seed {seed}{' --split' if args.split else ''}"
          f"{f' --scale {args.scale}' if args.scale != 1 else ''})")

    rng = np.random.default_rng(seed)
    cases = []  # (name, type, ne, array for the writer, expected f32 in PyTorch order)
    for t, ne in mk.TENSOR_SPECS:
        ne = ne[:-1] + [ne[-1] * args.scale]
        arr, expected = mk.make_tensor(rng, t, ne)  # drawn for every type, so --types keeps the values
        if only and t.name not in only:
            continue
        cases.append((mk.tensor_name(t), t, ne, arr, expected.astype(np.float32)))

    if args.split and len(cases) < N_SPLIT_SHARDS:
        print(f"check_dequant_fresh: --split needs at least {N_SPLIT_SHARDS} tensors, --types leaves {len(cases)}",
              file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="glmdiff-fresh-"))
    try:
        tensors = [(name, arr, t) for name, t, _, arr, _ in cases]
        meta = [("general.name", f"fresh random blocks, seed {seed}", V.STRING, None)]
        split_max = math.ceil(len(tensors) / N_SPLIT_SHARDS) if args.split else 0
        files = mk.write_gguf(tmp / "fresh.gguf", tensors, meta, split_max_tensors=split_max)
        print(f"wrote {len(files)} file(s), {sum(f.stat().st_size for f in files)} bytes, in {tmp}")

        header = f"{'type':<8} {'tensor':<16} {'shape':<16} {'elems':>7} {'via':<14} {'whole':<6} {'rows':<14} result"
        print(header)
        print("-" * len(header))
        n_bad = 0
        for i, (name, t, ne, _, want) in enumerate(cases):
            k = i % len(files)  # every shard serves as the entry point
            model = files[k]
            via = f"shard {k + 1}/{len(files)}" if len(files) > 1 else model.name
            out = tmp / f"{name}.{args.format}"
            err = run_dequant(args.bin, model, name, out, None)
            whole = err if err is not None else compare(load_f32(out), want)
            n_rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
            a, b = n_rows // 3, max(n_rows // 3 + 1, (2 * n_rows) // 3)
            want_rows = want.reshape(n_rows, ne[0])[a:b]
            err = run_dequant(args.bin, model, name, out, (a, b))
            rows = err if err is not None else compare(load_f32(out), want_rows)
            ok = whole == "ok" and rows == "ok"
            n_bad += not ok
            detail = "match" if ok else "; ".join(
                f"{what}: {r}" for what, r in (("whole", whole), ("rows", rows)) if r != "ok")
            shape = "x".join(str(d) for d in reversed(ne))
            print(f"{t.name:<8} {name:<16} {shape:<16} {int(np.prod(ne)):>7} {via:<14} "
                  f"{'ok' if whole == 'ok' else 'FAIL':<6} {f'{a}..{b} ' + ('ok' if rows == 'ok' else 'FAIL'):<14} {detail}")
        print(f"{len(cases) - n_bad} of {len(cases)} tensors match gguf-py bit for bit (seed {seed})")
        return 1 if n_bad else 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            for f in sorted(tmp.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            tmp.rmdir()


if __name__ == "__main__":
    sys.exit(main())
