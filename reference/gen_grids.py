#!/usr/bin/env python3
"""Generate src/quant/grids.rs (the i-quant lookup grids) from gguf-py, and the hash fixture
fixtures/quant/grids.fnv1a64.json that the Rust unit test in grids.rs checks the tables against.

Source: gguf-py (PyPI package `gguf`, 0.19.x), `gguf/quants.py`: the classes IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S and IQ1_S keep each ggml grid (ggml `ggml/src/ggml-common.h`,
`iq2xxs_grid` ...) as `grid_hex`: a hex string of bytes in which every grid element is packed
into `ceil(log2(len(grid_map)))` bits, lowest bits first, and `grid_map` turns the packed code
back into the byte that ggml stores. `IQ2_XXS.ksigns` is ggml's `ksigns_iq2xs`.

Two independent decodings are compared before anything is written:
  1. this script's own unpacking of `grid_hex` into ggml's u64/u32 entries (what grids.rs holds);
  2. gguf-py's `init_grid()` (the float32 grid its dequantizers use), read back as bytes.
The hash fixture is computed from (2), so the Rust test compares grids.rs with gguf-py's own
decoding. Hash: FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3) over each
table's little-endian bytes, i.e. ggml's in-memory layout (entry 0 byte 0 first).

Run from the repository root:  python3 reference/gen_grids.py
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import numpy as np
from gguf import quants as gq

ROOT = Path(__file__).resolve().parent.parent
RUST_OUT = ROOT / "src" / "quant" / "grids.rs"
JSON_OUT = ROOT / "fixtures" / "quant" / "grids.fnv1a64.json"

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1

# (Rust name, gguf-py class, entries, bytes per entry, ggml name)
GRIDS = [
    ("IQ2XXS_GRID", gq.IQ2_XXS, 256, 8, "iq2xxs_grid"),
    ("IQ2XS_GRID", gq.IQ2_XS, 512, 8, "iq2xs_grid"),
    ("IQ2S_GRID", gq.IQ2_S, 1024, 8, "iq2s_grid"),
    ("IQ3XXS_GRID", gq.IQ3_XXS, 256, 4, "iq3xxs_grid"),
    ("IQ3S_GRID", gq.IQ3_S, 512, 4, "iq3s_grid"),
    ("IQ1S_GRID", gq.IQ1_S, 2048, 8, "iq1s_grid"),
]


def fnv1a64(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h ^= b
        h = (h * FNV_PRIME) & MASK64
    return h


def unpack_hex_grid(cls, n_entries: int, entry_bytes: int) -> list[int]:
    """Own decoding of `cls.grid_hex` into ggml's little-endian u64/u32 grid entries."""
    assert cls.grid_shape == (n_entries, entry_bytes), (cls.__name__, cls.grid_shape)
    packed = bytes.fromhex(cls.grid_hex.decode("ascii"))
    bits = math.ceil(math.log2(len(cls.grid_map)))
    per_byte = 8 // bits  # 4 codes of 2 bits, or 2 codes of 3 bits (in nibbles)
    step = 8 // per_byte
    assert len(packed) * per_byte == n_entries * entry_bytes, cls.__name__
    entries = []
    for i in range(n_entries):
        value = 0
        for j in range(entry_bytes):
            k = i * entry_bytes + j
            code = (packed[k // per_byte] >> (step * (k % per_byte))) & ((1 << bits) - 1)
            elem = int(cls.grid_map[code]) & 0xFF  # IQ1_S: -1 is stored as the i8 byte 0xff
            value |= elem << (8 * j)
        entries.append(value)
    return entries


def gguf_py_grid_bytes(cls, n_entries: int, entry_bytes: int) -> bytes:
    """gguf-py's own decoding (`init_grid`), as the bytes ggml stores (i8 for IQ1_S)."""
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(n_entries, entry_bytes)
    as_int = grid.astype(np.int64)
    assert np.array_equal(as_int.astype(np.float32), grid), cls.__name__  # integral values
    return (as_int & 0xFF).astype(np.uint8).tobytes()


def le_bytes(entries: list[int], width: int) -> bytes:
    return b"".join(v.to_bytes(width, "little") for v in entries)


def rust_table(name: str, ty: str, values: list[int], per_line: int, hex_digits: int, doc: list[str]) -> str:
    lines = [f"/// {d}" for d in doc]
    lines += ["#[rustfmt::skip]", f"pub(crate) static {name}: [{ty}; {len(values)}] = ["]
    for start in range(0, len(values), per_line):
        row = values[start : start + per_line]
        lines.append("    " + " ".join(f"0x{v:0{hex_digits}x}," for v in row))
    lines.append("];")
    return "\n".join(lines)


RUST_TEST = r'''
#[cfg(test)]
mod tests {
    use super::*;

    /// FNV-1a 64 hashes of gguf-py's decoding of each table, written by `reference/gen_grids.py`.
    const HASHES_JSON: &str = include_str!("../../fixtures/quant/grids.fnv1a64.json");

    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

    fn fnv1a64(bytes: impl IntoIterator<Item = u8>) -> u64 {
        bytes.into_iter().fold(FNV_OFFSET, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
        })
    }

    fn expected(name: &str) -> (u64, usize) {
        let json: serde_json::Value = serde_json::from_str(HASHES_JSON).unwrap();
        assert_eq!(json["hash"].as_str().unwrap(), "fnv1a-64");
        let t = &json["tables"][name];
        let hex = t["fnv1a64"].as_str().unwrap();
        let hash = u64::from_str_radix(hex.trim_start_matches("0x"), 16).unwrap();
        (hash, t["bytes"].as_u64().unwrap() as usize)
    }

    fn check(name: &str, bytes: Vec<u8>) {
        let (hash, len) = expected(name);
        assert_eq!(bytes.len(), len, "{name}: byte length");
        assert_eq!(
            fnv1a64(bytes),
            hash,
            "{name}: fnv1a-64 differs from gguf-py"
        );
    }

    #[test]
    fn fnv1a64_known_vectors() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(*b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn grids_match_gguf_py_hashes() {
        let u64s = |t: &[u64]| t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let u32s = |t: &[u32]| t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        check("iq2xxs_grid", u64s(&IQ2XXS_GRID));
        check("iq2xs_grid", u64s(&IQ2XS_GRID));
        check("iq2s_grid", u64s(&IQ2S_GRID));
        check("iq3xxs_grid", u32s(&IQ3XXS_GRID));
        check("iq3s_grid", u32s(&IQ3S_GRID));
        check("iq1s_grid", u64s(&IQ1S_GRID));
        check("ksigns_iq2xs", KSIGNS_IQ2XS.to_vec());
    }

    #[test]
    fn entries_match_ggml_common_h() {
        // Read by hand from ggml `ggml/src/ggml-common.h` (ggml-org/llama.cpp).
        assert_eq!(IQ2XXS_GRID[1], 0x0808_0808_0808_082b);
        assert_eq!(IQ2XXS_GRID[252], 0x2b2b_082b_0808_0808);
        assert_eq!(IQ2XXS_GRID[255], 0x2b2b_2b19_0808_1908);
        assert_eq!(IQ2XS_GRID[7], 0x0808_0808_0819_192b);
        assert_eq!(IQ2XS_GRID[510], 0x2b2b_2b2b_2b19_0819);
        assert_eq!(IQ2S_GRID[1022], 0x2b2b_2b2b_2b08_2b08);
        assert_eq!(IQ2S_GRID[1023], 0x2b2b_2b2b_2b2b_2b2b);
        assert_eq!(IQ3XXS_GRID[5], 0x0404_0c3e);
        assert_eq!(IQ3XXS_GRID[255], 0x3e34_1c04);
        assert_eq!(IQ3S_GRID[3], 0x0101_010b);
        assert_eq!(IQ3S_GRID[511], 0x0f0f_0101);
        assert_eq!(IQ1S_GRID[1], 0xffff_ffff_ffff_ff01);
        assert_eq!(IQ1S_GRID[2046], 0x0101_0101_0101_01ff);
        assert_eq!(IQ1S_GRID[2047], 0x0101_0101_0101_0101);
        assert_eq!(KSIGNS_IQ2XS[64..72], [192, 65, 66, 195, 68, 197, 198, 71]);
    }

    #[test]
    fn ksigns_is_index_with_parity_bit() {
        for (i, &s) in KSIGNS_IQ2XS.iter().enumerate() {
            let parity = (i as u32).count_ones() as u8 & 1;
            assert_eq!(s, i as u8 | parity << 7, "ksigns_iq2xs[{i}]");
        }
        for (j, &m) in KMASK_IQ2XS.iter().enumerate() {
            assert_eq!(m, 1u8 << j);
        }
    }
}
'''


def main() -> None:
    version = importlib.metadata.version("gguf")
    tables_rs = []
    hashes = {}
    for rust_name, cls, n, width, ggml_name in GRIDS:
        own = unpack_hex_grid(cls, n, width)
        theirs = gguf_py_grid_bytes(cls, n, width)
        if le_bytes(own, width) != theirs:
            raise SystemExit(f"gen_grids: {ggml_name}: own unpacking differs from gguf-py init_grid()")
        hashes[ggml_name] = {
            "entries": n,
            "bytes_per_entry": width,
            "bytes": len(theirs),
            "fnv1a64": f"0x{fnv1a64(theirs):016x}",
        }
        ty, per_line, digits = ("u64", 4, 16) if width == 8 else ("u32", 8, 8)
        doc = [
            f"ggml `{ggml_name}`: {n} entries of {width} {'i8' if cls is gq.IQ1_S else 'u8'} values, "
            "value j in byte j (little-endian);",
            f"from gguf-py `{cls.__name__}.grid_hex`.",
        ]
        tables_rs.append(rust_table(rust_name, ty, own, per_line, digits, doc))

    ksigns = bytes(gq.IQ2_XXS.ksigns)
    assert len(ksigns) == 128
    for i, s in enumerate(ksigns):
        assert s == i | ((bin(i).count("1") & 1) << 7), f"ksigns[{i}]"
    hashes["ksigns_iq2xs"] = {
        "entries": 128,
        "bytes_per_entry": 1,
        "bytes": 128,
        "fnv1a64": f"0x{fnv1a64(ksigns):016x}",
    }
    ksigns_rs = rust_table(
        "KSIGNS_IQ2XS",
        "u8",
        list(ksigns),
        16,
        2,
        [
            "ggml `ksigns_iq2xs`: 7 sign bits plus an 8th bit that makes the count of set bits",
            "even; from gguf-py `IQ2_XXS.ksigns`.",
        ],
    )
    delta = float(gq.IQ1_S.delta)
    assert delta == float(gq.IQ1_M.delta) == 0.125

    header = f"""//! Lookup grids of the i-quants (ggml `ggml/src/ggml-common.h`: `iq2xxs_grid`, `iq2xs_grid`,
//! `iq2s_grid`, `iq3xxs_grid`, `iq3s_grid`, `iq1s_grid`, `ksigns_iq2xs`, `kmask_iq2xs`,
//! `IQ1S_DELTA`).
//!
//! GENERATED by `reference/gen_grids.py` from gguf-py {version} (`gguf/quants.py`, the packed
//! `grid_hex` of each class): do not edit by hand, re-run the script. Each u64 (u32) entry holds 8
//! (4) grid values, value j in byte j, exactly as ggml stores them. The test below hashes every
//! table (FNV-1a 64 over its little-endian bytes) against `fixtures/quant/grids.fnv1a64.json`,
//! which the script computes from gguf-py's own decoding of the grids. The tables keep ggml's line
//! layout (4 u64 or 8 u32 per line) so they can be diffed against ggml-common.h; as generated
//! data this file is longer than hand-written modules.

/// ggml `kmask_iq2xs`: bit j selects the sign of value j of a group of 8.
pub(crate) const KMASK_IQ2XS: [u8; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// ggml `IQ1S_DELTA`: the offset added to every IQ1_S / IQ1_M grid value (sign from `qh`).
pub(crate) const IQ1S_DELTA: f32 = {delta!r};
"""
    text = header + "\n" + "\n\n".join([ksigns_rs] + tables_rs) + "\n" + RUST_TEST
    RUST_OUT.write_text(text)

    doc = {
        "hash": "fnv1a-64",
        "hash_params": {"offset_basis": "0xcbf29ce484222325", "prime": "0x100000001b3"},
        "bytes": "each table's little-endian bytes in ggml's layout (entry 0 byte 0 first)",
        "source": f"gguf-py {version}, gguf/quants.py: init_grid() of IQ2_XXS, IQ2_XS, IQ2_S, "
        "IQ3_XXS, IQ3_S, IQ1_S; IQ2_XXS.ksigns",
        "generator": "reference/gen_grids.py",
        "tables": hashes,
    }
    JSON_OUT.parent.mkdir(parents=True, exist_ok=True)
    JSON_OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(hashes, indent=2))
    print(f"wrote {RUST_OUT.relative_to(ROOT)} and {JSON_OUT.relative_to(ROOT)} (gguf-py {version})")


if __name__ == "__main__":
    main()
