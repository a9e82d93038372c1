"""`model_digest` (docs/hooks.md): each tensor's SHA-256 against its byte layout built here by hand, split models,
the tensors a producer lists, refused files, the metadata key and the command line's --gguf."""

import hashlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import PYTHON_DIR
from glmdiff_hooks import build_metadata, digest, names

gguf = pytest.importorskip("gguf")

REPO = PYTHON_DIR.parent
MIB = 1 << 20


def _q8_0_blocks(rows: int, blocks: int, seed: int) -> np.ndarray:
    """Raw Q8_0 blocks (an f16 scale, then 32 int8), [rows, blocks * 34] bytes."""
    rng = np.random.default_rng(seed)
    out = np.empty((rows, blocks, 34), np.uint8)
    out[:, :, :2] = np.full((rows, blocks), 0.01, "<f2").view(np.uint8).reshape(rows, blocks, 2)
    out[:, :, 2:] = rng.integers(-127, 128, (rows, blocks, 32)).astype(np.int8).view(np.uint8)
    return out.reshape(rows, blocks * 34)


def _tensors(seed: int = 0) -> dict:
    """name -> (array as written, raw GGML type or None). numpy shapes are [.., rows, row length]."""
    rng = np.random.default_rng(seed)
    return {
        "token_embd.weight": (rng.standard_normal((300, 1024)).astype(np.float32), None),  # 1.2 MB > 1 MiB
        "output_norm.weight": (rng.standard_normal(64).astype(np.float32), None),
        "blk.0.attn_q_a.weight": (_q8_0_blocks(3, 2, seed), gguf.GGMLQuantizationType.Q8_0),
        "blk.0.attn_norm.weight": (rng.standard_normal((1, 8)).astype(np.float32), None),  # a stored trailing 1
        "blk.0.ffn_up.weight": (rng.standard_normal((4, 8)).astype(np.float16), None),
        "blk.1.ffn_gate_inp.weight": (rng.standard_normal((4, 8)).astype(np.float32), None),
        "blk.1.ffn_up_exps.weight": (rng.standard_normal((4, 2, 8)).astype(np.float32), None),
        "blk.2.ffn_gate_inp.weight": (rng.standard_normal((4, 8)).astype(np.float32), None),
        "blk.10.attn_norm.weight": (rng.standard_normal(8).astype(np.float32), None),
    }


def _write(path, tensors: dict, **kw):
    w = gguf.GGUFWriter(str(path), "glm-dsa", **kw)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _by_hand(name: str, type_id: int, ne: list, data: bytes) -> str:
    """The spec's layout, assembled here: name, 0, type (u32 LE), n_dims (u32 LE), ne (u64 LE), size (u64 LE),
    the first MiB of the data."""
    laid = name.encode() + b"\x00" + struct.pack("<I", type_id) + struct.pack("<I", len(ne))
    for d in ne:
        laid += struct.pack("<Q", d)
    laid += struct.pack("<Q", len(data)) + data[:MIB]
    return hashlib.sha256(laid).hexdigest()


EXPECTED_LAYOUT = {  # name -> (GGML type id, ne as GGUF stores it)
    "token_embd.weight": (0, [1024, 300]),
    "output_norm.weight": (0, [64]),
    "blk.0.attn_q_a.weight": (8, [64, 3]),
    "blk.0.attn_norm.weight": (0, [8, 1]),
    "blk.0.ffn_up.weight": (1, [8, 4]),
    "blk.1.ffn_gate_inp.weight": (0, [8, 4]),
    "blk.1.ffn_up_exps.weight": (0, [8, 2, 4]),
}


def test_sha256_known_answer():
    assert hashlib.sha256(b"abc").hexdigest() == \
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-4


def test_digest_is_the_specs_byte_layout(tmp_path):
    tensors = _tensors()
    p = _write(tmp_path / "m.gguf", tensors)
    text = digest.model_digest(p)
    d = json.loads(text)
    assert d["algorithm"] == "sha256" and d["prefix_bytes"] == MIB
    assert list(d["tensors"]) == sorted(EXPECTED_LAYOUT)  # no output.weight, no blk.2 / blk.10
    for name, (type_id, ne) in EXPECTED_LAYOUT.items():
        data = tensors[name][0].astype(tensors[name][0].dtype.newbyteorder("<")).tobytes()
        assert d["tensors"][name] == _by_hand(name, type_id, ne, data), name
    # the quantized tensor: 3 rows of 2 blocks of 34 bytes, the raw blocks
    assert len(tensors["blk.0.attn_q_a.weight"][0].tobytes()) == 3 * 2 * 34
    # past the first MiB the data does not count
    assert len(tensors["token_embd.weight"][0].tobytes()) > MIB
    # compact JSON, sorted keys (as glmdiff writes it)
    assert text == json.dumps(d, separators=(",", ":"), sort_keys=True)
    assert text.startswith('{"algorithm":"sha256","prefix_bytes":1048576,"tensors":{"blk.0.attn_norm.weight":"')


def test_data_and_shape_changes_change_the_digest_only_within_the_prefix(tmp_path):
    base = _tensors()
    d0 = json.loads(digest.model_digest(_write(tmp_path / "a.gguf", base)))["tensors"]
    late = dict(base)
    emb = base["token_embd.weight"][0].copy()
    emb[-1, -1] += 1  # beyond the first MiB
    late["token_embd.weight"] = (emb, None)
    q = base["blk.0.attn_q_a.weight"][0].copy()
    q[2, 67] ^= 1  # the last byte of a quantized tensor
    late["blk.0.attn_q_a.weight"] = (q, gguf.GGMLQuantizationType.Q8_0)
    late["blk.0.ffn_up.weight"] = (base["blk.0.ffn_up.weight"][0].reshape(8, 4), None)  # same bytes, new shape
    d1 = json.loads(digest.model_digest(_write(tmp_path / "b.gguf", late)))["tensors"]
    changed = sorted(k for k in d0 if d0[k] != d1[k])
    assert changed == ["blk.0.attn_q_a.weight", "blk.0.ffn_up.weight"]


def test_split_model_every_shard_and_each_tensor_from_its_shard(tmp_path):
    tensors = _tensors(seed=3)
    whole = digest.model_digest(_write(tmp_path / "one.gguf", tensors))
    _write(tmp_path / "m.gguf", tensors, split_max_tensors=3)
    shards = sorted(p.name for p in tmp_path.glob("m-*.gguf"))
    assert shards == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    assert digest.shard_paths(tmp_path / shards[1]) == [tmp_path / s for s in shards]
    holders = {t.name: t.path.name for t in digest.model_tensors(tmp_path / shards[0])}
    assert holders["token_embd.weight"] == shards[0] and holders["blk.1.ffn_up_exps.weight"] == shards[2]
    assert digest.model_digest(tmp_path / shards[0]) == whole  # a digest does not depend on the file layout
    assert digest.model_digest(tmp_path / shards[2]) == whole  # any shard opens the model


def test_split_model_refusals(tmp_path):
    _write(tmp_path / "m.gguf", _tensors(), split_max_tensors=5)
    first, second = tmp_path / "m-00001-of-00002.gguf", tmp_path / "m-00002-of-00002.gguf"
    renamed = tmp_path / "x.gguf"
    renamed.write_bytes(first.read_bytes())
    with pytest.raises(ValueError, match=r"split.count = 2.*NAME-0000K-of-00002\.gguf"):
        digest.model_digest(renamed)
    (tmp_path / "n-00001-of-00003.gguf").write_bytes(first.read_bytes())
    (tmp_path / "n-00002-of-00003.gguf").write_bytes(second.read_bytes())
    with pytest.raises(FileNotFoundError, match=r"n-00003-of-00003\.gguf does not exist \(shard of the 3-shard"):
        digest.model_digest(tmp_path / "n-00001-of-00003.gguf")
    (tmp_path / "n-00003-of-00003.gguf").write_bytes(second.read_bytes())
    with pytest.raises(ValueError, match="split.count is 2, but the model has 3 shards"):
        digest.model_digest(tmp_path / "n-00001-of-00003.gguf")
    (tmp_path / "s-00001-of-00002.gguf").write_bytes(second.read_bytes())
    (tmp_path / "s-00002-of-00002.gguf").write_bytes(first.read_bytes())
    with pytest.raises(ValueError, match="split.no is 1, expected 0 for shard 1 of 2"):
        digest.model_digest(tmp_path / "s-00002-of-00002.gguf")
    with pytest.raises(ValueError, match="shard number 3 in the file name is outside 1..2"):
        digest.model_digest(tmp_path / "m-00003-of-00002.gguf")


def test_tensor_in_two_shards_is_refused(tmp_path):
    t = _tensors()
    _write(tmp_path / "a.gguf", {k: t[k] for k in ["token_embd.weight", "output_norm.weight"]},
           split_max_tensors=1)
    _write(tmp_path / "b.gguf", {k: t[k] for k in ["output_norm.weight", "token_embd.weight"]},
           split_max_tensors=1)
    (tmp_path / "a-00002-of-00002.gguf").write_bytes((tmp_path / "b-00002-of-00002.gguf").read_bytes())
    with pytest.raises(ValueError, match=r"token_embd.weight is in both \S*a-00001-of-00002.gguf and \S*a-00002-of"):
        digest.model_digest(tmp_path / "a-00001-of-00002.gguf")


@pytest.mark.parametrize("names_in,listed", [
    (["token_embd.weight", "output_norm.weight", "output.weight", "blk.0.a", "blk.1.a", "blk.1.ffn_gate_inp.weight",
      "blk.2.ffn_gate_inp.weight", "blk.10.a", "blk.01.a", "blk.0"],
     ["token_embd.weight", "output_norm.weight", "output.weight", "blk.0.a", "blk.1.a",
      "blk.1.ffn_gate_inp.weight"]),
    (["blk.3.ffn_gate_inp.weight", "blk.12.ffn_gate_inp.weight", "blk.3.x", "blk.12.x", "blk.30.x",
      "token_embd.weight", "blk.0.x"],
     ["blk.3.ffn_gate_inp.weight", "blk.3.x", "token_embd.weight", "blk.0.x"]),
    (["token_embd.weight", "blk.0.a", "blk.1.a", "blk.1.ffn_gate_inp.weight.x", "output.weight.x"],
     ["token_embd.weight", "blk.0.a"]),  # no router: block 0 only; output.weight only by its exact name
    (["blk.0.ffn_gate_inp.weight", "blk.0.a", "blk.1.a"], ["blk.0.ffn_gate_inp.weight", "blk.0.a"]),
])
def test_selection_convention(names_in, listed):
    assert digest.select_tensors(names_in) == listed


def test_selection_with_and_without_output_weight(tmp_path):
    t = _tensors()
    with_out = dict(t, **{"output.weight": (np.ones((4, 8), np.float32), None)})
    d = json.loads(digest.model_digest(_write(tmp_path / "o.gguf", with_out)))["tensors"]
    assert sorted(d) == sorted([*EXPECTED_LAYOUT, "output.weight"])
    assert d["output.weight"] == _by_hand("output.weight", 0, [8, 4], np.ones(32, "<f4").tobytes())
    dense = {k: v for k, v in t.items() if "ffn_gate_inp" not in k}
    d = json.loads(digest.model_digest(_write(tmp_path / "d.gguf", dense)))["tensors"]
    assert sorted(d) == sorted(k for k in EXPECTED_LAYOUT if not k.startswith("blk.1."))


def test_refused_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        digest.model_digest(tmp_path / "nope.gguf")
    with pytest.raises(IsADirectoryError, match="is not a regular file"):
        digest.model_digest(tmp_path)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="text.gguf is not a GGUF file .it does not start with 'GGUF'"):
        digest.model_digest(tmp_path / "text.gguf")
    good = _write(tmp_path / "good.gguf", _tensors()).read_bytes()
    (tmp_path / "header.gguf").write_bytes(good[:40])
    with pytest.raises(ValueError, match="header.gguf is not a GGUF file gguf-py can read"):
        digest.model_digest(tmp_path / "header.gguf")
    (tmp_path / "cut.gguf").write_bytes(good[:-100])
    with pytest.raises(ValueError, match="cut.gguf is not a GGUF file gguf-py can read .truncated or damaged"):
        digest.model_digest(tmp_path / "cut.gguf")
    none = _write(tmp_path / "none.gguf", {"blk.1.a": (np.ones(4, np.float32), None)})
    with pytest.raises(ValueError, match="none of the tensors a digest lists"):
        digest.model_digest(none)


def test_without_gguf_py_an_import_error_says_how_to_install():
    code = ("import sys; sys.modules['gguf'] = None\nfrom glmdiff_hooks import digest\n"
            "try:\n    digest.model_digest('x.gguf')\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=PYTHON_DIR, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "pip install gguf" in r.stdout


def test_metadata_key(tmp_path):
    text = digest.model_digest(_write(tmp_path / "m.gguf", _tensors()))
    args = dict(model_file="m.gguf", architecture="glm-dsa", tokens=[1, 2], engine="x", dtype="f32")
    m = build_metadata(**args, model_digest=text)
    assert m["model_digest"] == text and "model_digest" in names.OPTIONAL_KEYS
    assert build_metadata(**args, model_digest=json.loads(text))["model_digest"] == text
    assert "model_digest" not in build_metadata(**args)
    d = json.loads(text)
    for bad, msg in [("{", "not JSON"), ("[]", "not a JSON object"), (dict(d, algorithm="md5"), "algorithm is 'md5'"),
                     (dict(d, prefix_bytes=0), "prefix_bytes"), (dict(d, tensors={}), "tensors is not a non-empty"),
                     (dict(d, tensors={"a": "AB" * 32}), "tensor 'a': 'AB.* is not 64 lowercase hex")]:
        with pytest.raises(ValueError, match=f"model_digest is malformed: {msg}"):
            build_metadata(**args, model_digest=bad if isinstance(bad, str) else json.dumps(bad))


BLOCK = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "


def _cli(*argv) -> subprocess.CompletedProcess:
    code = BLOCK + f"from glmdiff_hooks.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=PYTHON_DIR, capture_output=True, text=True)


def test_cli_gguf_or_gguf_name(tmp_path):
    base = ["--hf", "x", "--tokens", "1,2", "--out", str(tmp_path / "o.safetensors")]
    r = _cli(*base)
    assert r.returncode == 2 and "one of the arguments --gguf --gguf-name is required" in r.stderr
    r = _cli(*base, "--gguf", "a.gguf", "--gguf-name", "a.gguf")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = _cli(*base, "--gguf", str(tmp_path / "missing.gguf"))  # the GGUF is read before torch is needed
    assert r.returncode == 2 and r.stderr.startswith("glmdiff-hooks: ") and "missing.gguf does not exist" in r.stderr
    r = _cli(*base, "--gguf", str(_write(tmp_path / "m.gguf", _tensors())))
    assert r.returncode == 2 and "torch" in r.stderr and "digest" not in r.stderr


def test_trace_save_with_gguf_path(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    from glmdiff_hooks.recorder import Trace

    p = _write(tmp_path / "m.gguf", _tensors())
    rec = Trace(1)
    rec.architecture, rec.engine, rec.dtype = "glm-dsa", "test", "f32"
    rec.put("token_embd", torch.zeros(2, 8))
    out = rec.save(tmp_path / "t.safetensors", gguf_path=p, tokens=[1, 2])
    with safe_open(str(out), "np") as f:
        meta = f.metadata()
    assert meta["model"] == "m.gguf" and meta["model_digest"] == digest.model_digest(p)
    out = rec.save(tmp_path / "u.safetensors", model_file="other.gguf", gguf_path=p, tokens=[1, 2])
    with safe_open(str(out), "np") as f:
        assert f.metadata()["model"] == "other.gguf"
    out = rec.save(tmp_path / "v.safetensors", model_file="other.gguf", tokens=[1, 2])
    with safe_open(str(out), "np") as f:
        assert "model_digest" not in f.metadata()
    with pytest.raises(TypeError, match="model_file .* or gguf_path"):
        rec.save(tmp_path / "w.safetensors", tokens=[1, 2])


def test_committed_reference_digests_are_reproduced():
    """fixtures/digests/digests.json (reference/fixtures/model_digests.py) is what the package computes today for
    every fixture GGUF, and its MANIFEST names each file's sha256."""
    fixture = REPO / "fixtures" / "digests"
    committed = json.loads((fixture / "digests.json").read_text())
    manifest = json.loads((fixture / "MANIFEST.json").read_text())
    models = REPO / "fixtures" / "models"
    on_disk = sorted(str(p.relative_to(models)) for p in models.rglob("*.gguf")
                     if (s := digest.split_name(p)) is None or s[1] == 1)
    assert sorted(committed["models"]) == on_disk
    text = (fixture / "digests.json").read_bytes()
    assert manifest["files"]["digests.json"]["sha256"] == hashlib.sha256(text).hexdigest()
    for rel, d in committed["models"].items():
        assert d == json.loads(digest.model_digest(models / rel)), rel
        for shard in digest.shard_paths(models / rel):
            key = str(shard.relative_to(REPO))
            assert manifest["models"][key]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest(), key
