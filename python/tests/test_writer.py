"""The safetensors writer: read back by the `safetensors` package and by hand, byte-stable, refusals."""

import json
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from glmdiff_hooks import encode_safetensors, write_safetensors

META = {"glmdiff_trace": "1", "model": "m.gguf", "tokens": "[1, 2]"}


def _tensors():
    rng = np.random.default_rng(3)
    return {
        "logits": rng.standard_normal((2, 5)).astype(np.float64),
        "blk.0.q_pe_rope": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "blk.0.moe_topk_ids": np.array([[3, 1], [0, 7]], dtype=np.int32),
        "token_embd": np.asfortranarray(rng.standard_normal((2, 6)).astype(">f4")),  # big-endian, not C order
    }


def test_safetensors_reads_back_values_and_metadata(tmp_path):
    t = _tensors()
    p = write_safetensors(tmp_path / "sub" / "x.safetensors", t, META)
    back = load_file(str(p))
    assert set(back) == set(t)
    for k, v in t.items():
        assert back[k].shape == v.shape
        assert back[k].dtype == v.dtype.newbyteorder("=")
        np.testing.assert_array_equal(back[k], v)
    with safe_open(str(p), "np") as f:
        assert f.metadata() == META
    assert os.listdir(tmp_path / "sub") == ["x.safetensors"]  # no temporary file left


def test_layout_by_hand():
    t = _tensors()
    b = encode_safetensors(t, META)
    n = int.from_bytes(b[:8], "little")
    assert n % 8 == 0
    header_text = b[8:8 + n].decode("utf-8")
    header = json.loads(header_text)
    assert list(header) == ["__metadata__"] + sorted(t)  # metadata first, tensors sorted
    assert header_text.rstrip(" ") == json.dumps(header, separators=(",", ":"))
    off = 0
    for k in sorted(t):
        h = header[k]
        assert h["data_offsets"][0] == off
        raw = np.ascontiguousarray(t[k], dtype=t[k].dtype.newbyteorder("<")).tobytes()
        assert b[8 + n + off: 8 + n + h["data_offsets"][1]] == raw
        off = h["data_offsets"][1]
    assert len(b) == 8 + n + off
    assert {header[k]["dtype"] for k in t} == {"F64", "F32", "I32"}


def test_identical_input_gives_identical_bytes():
    t = _tensors()
    shuffled = dict(reversed(list(t.items())))
    assert encode_safetensors(t, META) == encode_safetensors(shuffled, dict(reversed(list(META.items()))))


@pytest.mark.parametrize("dt", [np.int64, np.float16, np.bool_, np.uint8])
def test_other_dtypes_are_refused_and_the_old_file_is_kept(tmp_path, dt):
    p = tmp_path / "x.safetensors"
    write_safetensors(p, {"logits": np.zeros((1, 2), np.float32)}, META)
    before = p.read_bytes()
    with pytest.raises(ValueError, match="tensor blk.0.q_a: dtype"):
        write_safetensors(p, {"blk.0.q_a": np.zeros((1, 2), dt)}, META)
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]


def test_empty_and_zero_row_tensors(tmp_path):
    p = write_safetensors(tmp_path / "x.safetensors", {"blk.0.exp.1.out": np.zeros((0, 4), np.float32)}, {})
    back = load_file(str(p))
    assert back["blk.0.exp.1.out"].shape == (0, 4)
