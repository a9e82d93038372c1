#!/usr/bin/env python3
"""Write the GGUF dequantization fixtures of glmdiff with gguf-py, the independent oracle.

Outputs (under --out-dir, default fixtures/quant):
  all_types.gguf                     one tensor per GGML type glmdiff dequantizes, plus I8/I16/I32
                                     tensors and metadata of every GGUF value type
  all_types.expected.safetensors     gguf.quants.dequantize() of every tensor as F32 (PyTorch shape
                                     = ne reversed); integer tensors stored as they are (I8/I16/I32)
  split/all_types-0000K-of-00003.gguf  the same tensors split into 3 shards by GGUFWriter
  foreign/all_types-0000K-of-00003.gguf  another 3-shard model (different split.tensors.count),
                                     used to check that a shard of another model is rejected
  MANIFEST.json                      provenance: seed, versions, sha256 and role of every file

Blocks are random bytes whose f16 scale fields are overwritten with finite f16 values (this is
how gguf-py's own tests/test_quants.py builds K-quant and IQ blocks), so no quantizer is needed.
Block field offsets follow the block structs of ggml's src/ggml-common.h
(ggml-org/llama.cpp ggml/src/ggml-common.h) and the hsplit()s of gguf-py's gguf/quants.py.

Re-runnable: the same --seed gives byte-identical .gguf and .safetensors files.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.constants import GGML_QUANT_SIZES

DEFAULT_SEED = 20250917

# Name of the test tensor that holds type `t`: `q4_k.weight`, `iq2_xs.weight`, `i32.weight`.
def tensor_name(t: Q) -> str:
    return f"{t.name.lower()}.weight"


# (type, ne) in ggml order, fastest dimension first. Super-block (256) types get 63-64 blocks,
# 32-element types ~320 blocks, to keep the F32 expected file small; shapes mix 2-D, 3-D and 4-D
# and row lengths that are not multiples of 256.
TENSOR_SPECS: list[tuple[Q, list[int]]] = [
    (Q.F32, [64, 7]),
    (Q.F16, [96, 5, 3]),
    (Q.BF16, [128, 6]),
    (Q.Q4_0, [96, 7, 15]),
    (Q.Q4_1, [256, 40]),
    (Q.Q5_0, [64, 5, 4, 8]),
    (Q.Q5_1, [96, 7, 15]),
    (Q.Q8_0, [256, 40]),
    (Q.Q2_K, [512, 32]),
    (Q.Q3_K, [256, 8, 8]),
    (Q.Q4_K, [768, 7, 3]),
    (Q.Q5_K, [1024, 4, 4]),
    (Q.Q6_K, [256, 64]),
    (Q.IQ2_XXS, [512, 32]),
    (Q.IQ2_XS, [256, 8, 8]),
    (Q.IQ2_S, [768, 7, 3]),
    (Q.IQ3_XXS, [1024, 4, 4]),
    (Q.IQ3_S, [256, 64]),
    (Q.IQ1_S, [512, 32]),
    (Q.IQ1_M, [256, 8, 8]),
    (Q.IQ4_NL, [64, 5, 4, 8]),
    (Q.IQ4_XS, [768, 7, 3]),
    (Q.TQ1_0, [1024, 4, 4]),
    (Q.TQ2_0, [256, 64]),
    (Q.MXFP4, [96, 7, 15]),
    (Q.NVFP4, [192, 7, 8]),
    (Q.I8, [32, 5]),
    (Q.I16, [16, 3, 2]),
    (Q.I32, [50]),
]

# Byte offsets of the f16 fields (d, m, dmin) inside one block, from ggml-common.h:
# block_q4_1 {d, m, qs}, block_q2_K {scales[16], qs[64], d, dmin}, block_q3_K {hmask[32], qs[64],
# scales[12], d}, block_q6_K {ql[128], qh[64], scales[16], d}, block_tq1_0 {qs[48], qh[4], d},
# block_tq2_0 {qs[64], d}; every other type listed starts with d (and dmin / m after it).
F16_FIELDS: dict[Q, list[int]] = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.IQ4_NL: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    Q.IQ2_XXS: [0], Q.IQ2_XS: [0], Q.IQ2_S: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0], Q.IQ1_S: [0],
    Q.IQ4_XS: [0], Q.TQ1_0: [52], Q.TQ2_0: [64],
}
# block_iq1_m {qs[32], qh[16], scales[8]}: the f16 scale is the top nibbles of the 4 u16 scales.
IQ1_M_SCALES_OFFSET = 48
# block_nvfp4 {d[4] (UE4M3), qs[32]}; 0x7F is the E4M3 NaN, bit 7 is unused by an unsigned format.
NVFP4_SCALE_BYTES = 4
UE4M3_MAX_FINITE = 0x7E
# block_mxfp4 {e (E8M0), qs[16]}; 0xFF is the E8M0 NaN, and ggml's half scale 2^(e-128) times the
# largest FP4 value 12 overflows f32 from e = 253 on, so exponents stop at 252.
E8M0_MAX_FINITE = 252

TOKEN_COUNT = 150_000
SPLIT_TOKEN_COUNT = 1_000
SPLIT_MAX_TENSORS = 10
TOKEN_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
SPECIAL_TOKENS = {0: "<pad>", 1: "", 2: "\u2581the", 100: "\u4e16\u754c", 149_999: "<|endoftext|>"}


def token(i: int) -> str:
    """Token i of the fixture vocabulary: deterministic, 0-2 characters (tests recompute it)."""
    if i in SPECIAL_TOKENS:
        return SPECIAL_TOKENS[i]
    a = TOKEN_ALPHABET[i % 62]
    return a if i % 3 == 0 else a + TOKEN_ALPHABET[(i // 62) % 62]


def sane_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite f16 bit patterns: magnitudes 2^-14..2^3 with random sign, ~3% subnormal, ~1% zero."""
    sign = rng.integers(0, 2, n, dtype=np.uint16) << np.uint16(15)
    exp = rng.integers(1, 18, n, dtype=np.uint16)  # biased exponent 1..17: 2^-14 .. 2^2 * (1+m)
    mant = rng.integers(0, 1024, n, dtype=np.uint16)
    r = rng.random(n)
    exp = np.where(r < 0.04, np.uint16(0), exp)  # subnormal (or zero when mant == 0)
    mant = np.where(r < 0.01, np.uint16(0), mant)  # signed zero
    return (sign | (exp << np.uint16(10)) | mant).astype(np.uint16)


def random_blocks(rng: np.random.Generator, t: Q, n_blocks: int) -> np.ndarray:
    """[n_blocks, type_size] uint8 of valid random blocks of quantized type t."""
    _, ts = GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    if t in F16_FIELDS:
        for off in F16_FIELDS[t]:
            b[:, off:off + 2] = sane_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    elif t == Q.IQ1_M:
        sc = b[:, IQ1_M_SCALES_OFFSET:IQ1_M_SCALES_OFFSET + 8].copy().view("<u2")  # [n, 4]
        d = sane_f16_bits(rng, n_blocks).astype(np.uint16)
        for k in range(4):
            nib = (d >> np.uint16(4 * k)) & np.uint16(0xF)
            sc[:, k] = (sc[:, k] & np.uint16(0x0FFF)) | (nib << np.uint16(12))
        b[:, IQ1_M_SCALES_OFFSET:IQ1_M_SCALES_OFFSET + 8] = sc.view(np.uint8)
    elif t == Q.MXFP4:
        e = rng.integers(0, E8M0_MAX_FINITE + 1, n_blocks, dtype=np.uint8)
        # Force the subnormal (e < 2) and extreme exponents to appear.
        forced = [0, 1, 2, 3, 126, 127, 128, 251, E8M0_MAX_FINITE]
        e[: min(len(forced), n_blocks)] = forced[: min(len(forced), n_blocks)]
        b[:, 0] = e
    elif t == Q.NVFP4:
        b[:, :NVFP4_SCALE_BYTES] = rng.integers(0, UE4M3_MAX_FINITE + 1, (n_blocks, NVFP4_SCALE_BYTES), dtype=np.uint8)
    else:
        raise ValueError(f"no block generator for {t.name}")
    return b


def float_values(rng: np.random.Generator, t: Q, n: int) -> np.ndarray:
    """Raw little-endian bytes of n F32/F16/BF16 values: normal draws plus edge values."""
    x = (rng.standard_normal(n) * 2.0).astype(np.float32)
    if t == Q.F32:
        edge = np.array([0.0, -0.0, 1e-45, -1.17e-38, 3.4e38, np.inf, -np.inf], dtype=np.float32)
        x[: len(edge)] = edge
        raw = x.view(np.uint32).copy()
        raw[len(edge)] = 0x7FC12345  # a quiet NaN with a payload: copied, never computed
        return raw.view(np.uint8)
    if t == Q.F16:
        h = x.astype(np.float16)
        edge = np.array([0.0, -0.0, 6e-8, -6.1e-5, 65504.0, np.inf, -np.inf], dtype=np.float16)
        h[: len(edge)] = edge
        return h.view(np.uint8)
    if t == Q.BF16:
        bits = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        edge = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0x7F80, 0xFF80, 0x7FC1]  # 0x7FC1: quiet NaN
        bits[: len(edge)] = edge
        return bits.view(np.uint8)
    raise ValueError(t.name)


def int_values(rng: np.random.Generator, t: Q, n: int) -> np.ndarray:
    dt = {Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32}[t]
    info = np.iinfo(dt)
    v = rng.integers(info.min, int(info.max) + 1, n, dtype=dt)
    v[:3] = [info.min, info.max, 0]
    return v


def make_tensor(rng: np.random.Generator, t: Q, ne: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(array to hand to GGUFWriter.add_tensor, expected values), both in PyTorch order.

    Quantized and BF16 data are uint8 arrays of byte shape [..., row_bytes]; the writer turns
    that into the element shape itself. Expected values come from gguf.quants.dequantize.
    """
    shape = list(reversed(ne))
    n = int(np.prod(ne))
    if t in (Q.I8, Q.I16, Q.I32):
        v = int_values(rng, t, n).reshape(shape)
        return v, v
    bs, ts = GGML_QUANT_SIZES[t]
    if t in (Q.F32, Q.F16, Q.BF16):
        raw = float_values(rng, t, n)
    else:
        raw = random_blocks(rng, t, n // bs).reshape(-1)
    raw = raw.reshape(shape[:-1] + [ne[0] // bs * ts])
    expected = np.ascontiguousarray(gguf.quants.dequantize(raw, t), dtype=np.float32)
    assert list(expected.shape) == shape, (t.name, expected.shape, shape)
    if t not in (Q.F32, Q.F16, Q.BF16):  # the float tensors carry inf and NaN on purpose
        assert np.isfinite(expected).all(), f"{t.name}: non-finite expected values"
    if t == Q.F32:
        return raw.view(np.float32), expected
    if t == Q.F16:
        return raw.view(np.float16), expected
    return raw, expected


def metadata_items(n_tokens: int) -> list[tuple[str, object, V, V | None]]:
    """(key, value, type, array element type) for every metadata key the fixture carries."""
    tokens = [token(i) for i in range(n_tokens)]
    if n_tokens < TOKEN_COUNT:
        tokens[-1] = SPECIAL_TOKENS[TOKEN_COUNT - 1]
    return [
        ("general.name", "glmdiff quant fixture", V.STRING, None),
        ("glm-dsa.block_count", 78, V.UINT32, None),
        ("glm-dsa.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32, None),
        ("test.u8", 200, V.UINT8, None),
        ("test.i8", -100, V.INT8, None),
        ("test.u16", 60000, V.UINT16, None),
        ("test.i16", -30000, V.INT16, None),
        ("test.u32", 4_000_000_000, V.UINT32, None),
        ("test.i32", -2_000_000_000, V.INT32, None),
        ("test.f32", 0.1, V.FLOAT32, None),
        ("test.bool_true", True, V.BOOL, None),
        ("test.bool_false", False, V.BOOL, None),
        ("test.string", "h\u00e9llo \u2581\u4e16\u754c \U0001f642", V.STRING, None),
        ("test.u64", 2**63 + 5, V.UINT64, None),
        ("test.i64", -(2**62) - 3, V.INT64, None),
        ("test.f64", 1.0 / 3.0, V.FLOAT64, None),
        ("test.array.u8", [0, 1, 255], V.ARRAY, V.UINT8),
        ("test.array.i8", [-128, 0, 127], V.ARRAY, V.INT8),
        ("test.array.u16", [0, 65535], V.ARRAY, V.UINT16),
        ("test.array.i16", [-32768, 32767], V.ARRAY, V.INT16),
        ("test.array.u32", [0, 4294967295], V.ARRAY, V.UINT32),
        ("test.array.i32", [-(2**31), 2**31 - 1], V.ARRAY, V.INT32),
        ("test.array.f32", [1.5, -0.0, 3.25e-5], V.ARRAY, V.FLOAT32),
        ("test.array.bool", [True, False, True], V.ARRAY, V.BOOL),
        ("test.array.u64", [0, 2**64 - 1], V.ARRAY, V.UINT64),
        ("test.array.i64", [-(2**63), 2**63 - 1], V.ARRAY, V.INT64),
        ("test.array.f64", [5e-324, 1e300, -2.5], V.ARRAY, V.FLOAT64),
        ("test.array.string", ["a", "", "\u00fc"], V.ARRAY, V.STRING),
        # Arrays of arrays: inner element types are inferred by gguf-py (int -> i32).
        ("test.nested", [[1, 2, 3], [4], [5, 6]], V.ARRAY, V.ARRAY),
        ("test.nested_strings", [["x", "yz"], ["w"]], V.ARRAY, V.ARRAY),
        ("test.nested3", [[[1], [2, 3]], [[4]]], V.ARRAY, V.ARRAY),
        ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
    ]


def write_gguf(path: Path, tensors: list[tuple[str, np.ndarray, Q]], metadata, split_max_tensors: int = 0,
               arch: str = "quant-fixture") -> list[Path]:
    """Write a model (split when split_max_tensors > 0); returns the files written, in shard order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, val, vt, sub in metadata:
        w.add_key_value(key, val, vt, sub_type=sub)
    for name, arr, t in tensors:
        raw_dtype = t if arr.dtype == np.uint8 else None
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    files = w.format_shard_names(path)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return files


def split_name(prefix: str, k: int, n: int) -> str:
    """llama.cpp's shard name, `llama_split_path` in ggml-org/llama.cpp src/llama.cpp."""
    return "%s-%05d-of-%05d.gguf" % (prefix, k, n)


def check_written(path: Path, tensors: list[tuple[str, np.ndarray, Q]]) -> None:
    """Read a written file back with gguf.GGUFReader and check that the bytes are ours."""
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    for name, arr, t in tensors:
        if name not in by_name:
            continue
        rt = by_name[name]
        assert rt.tensor_type == t, (name, rt.tensor_type, t)
        got = np.asarray(rt.data).view(np.uint8).reshape(-1)
        want = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        assert np.array_equal(got, want), f"{path}: {name}: bytes differ after writing"


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_tensors(seed: int):
    """[(name, array for the writer, type, ne, expected)] drawn from one generator seeded `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for t, ne in TENSOR_SPECS:
        arr, expected = make_tensor(rng, t, ne)
        out.append((tensor_name(t), arr, t, ne, expected))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"RNG seed (default {DEFAULT_SEED})")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "fixtures" / "quant")
    args = ap.parse_args()
    out: Path = args.out_dir
    print(f"seed {args.seed}, gguf {pkg_version('gguf')}, numpy {np.__version__}, writing to {out}")

    from safetensors.numpy import save_file

    built = build_tensors(args.seed)
    tensors = [(name, arr, t) for name, arr, t, _, _ in built]
    roles: dict[str, str] = {}

    main_path = out / "all_types.gguf"
    write_gguf(main_path, tensors, metadata_items(TOKEN_COUNT))
    check_written(main_path, tensors)
    roles["all_types.gguf"] = (f"one tensor per type ({len(tensors)} tensors) and metadata of every GGUF value "
                               f"type, including a {TOKEN_COUNT}-entry string array")

    exp_path = out / "all_types.expected.safetensors"
    save_file({name: exp for name, _, _, _, exp in built}, str(exp_path),
              # One key: safetensors writes its metadata map in no fixed order.
              metadata={"source": f"gguf.quants.dequantize, gguf {pkg_version('gguf')}, seed {args.seed}"})
    roles[exp_path.name] = "gguf-py dequantization of every tensor of all_types.gguf (F32, PyTorch shape); ints as stored"

    split_files = write_gguf(out / "split" / "all_types.gguf", tensors, metadata_items(SPLIT_TOKEN_COUNT),
                             split_max_tensors=SPLIT_MAX_TENSORS)
    n_split = len(split_files)
    assert n_split == 3, f"expected 3 shards, gguf-py wrote {n_split}"
    for k, f in enumerate(split_files, 1):
        assert f.name == split_name("all_types", k, n_split), (f.name, "differs from llama.cpp's naming")
        check_written(f, tensors)
        roles[f"split/{f.name}"] = (f"shard {k} of {n_split} of the same tensors (split_max_tensors="
                                    f"{SPLIT_MAX_TENSORS}); metadata as all_types.gguf but the token array "
                                    f"cut to {SPLIT_TOKEN_COUNT} entries" if k == 1 else
                                    f"shard {k} of {n_split} of the same tensors")
    shard_of = {}
    for k, f in enumerate(split_files):
        for t in gguf.GGUFReader(f).tensors:
            shard_of[t.name] = k

    # A different model split into 3 shards: 5 small F32 tensors, so split.tensors.count is 5.
    frng = np.random.default_rng(args.seed + 1)
    foreign = [(f"foreign.{i}.weight", frng.standard_normal((2, 32)).astype(np.float32), Q.F32) for i in range(5)]
    foreign_files = write_gguf(out / "foreign" / "all_types.gguf", foreign,
                               [("general.name", "another model", V.STRING, None)], split_max_tensors=2)
    assert len(foreign_files) == 3, len(foreign_files)
    for k, f in enumerate(foreign_files, 1):
        check_written(f, foreign)
        roles[f"foreign/{f.name}"] = (f"shard {k} of 3 of another model (split.tensors.count = {len(foreign)}), "
                                      "same file names as split/, to test that mixed shards are rejected")

    files = {}
    total = 0
    for rel, role in roles.items():
        p = out / rel
        size = p.stat().st_size
        total += size
        files[rel] = {"sha256": sha256(p), "bytes": size, "what": role}
    manifest = {
        "script": "reference/make_quant_fixtures.py",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "seed": args.seed,
        "versions": {"python": platform.python_version(), "gguf": pkg_version("gguf"),
                     "numpy": np.__version__, "safetensors": pkg_version("safetensors")},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "files": files,
        "total_bytes": total,
        "tensors": [
            {"name": name, "type": t.name, "ne": ne, "shape": list(reversed(ne)),
             "blocks": int(np.prod(ne)) // GGML_QUANT_SIZES[t][0], "split_shard_index": shard_of[name]}
            for name, _, t, ne, _ in built
        ],
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    for rel, f in files.items():
        print(f"  {f['bytes']:>9}  {rel}")
    print(f"  {total:>9}  total (plus MANIFEST.json)")
    return 0


def pkg_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    sys.exit(main())
