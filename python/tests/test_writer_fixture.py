"""The committed writer fixture (fixtures/hook_writer/, read by glmdiff's tests/hook_script.rs) is exactly what
the package writes today. After a change of the writer, the metadata or the version, regenerate it:
python3 reference/fixtures/make_hook_writer_fixture.py."""

import hashlib
import importlib.util
import json

import numpy as np
from safetensors import safe_open

from conftest import PYTHON_DIR

REPO = PYTHON_DIR.parent
FIXTURE = REPO / "fixtures" / "hook_writer"
MAKER = REPO / "reference" / "fixtures" / "make_hook_writer_fixture.py"


def _maker():
    spec = importlib.util.spec_from_file_location("make_hook_writer_fixture", MAKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_fixture_is_reproduced(tmp_path):
    mk = _maker()
    p = mk.build(tmp_path)
    committed = FIXTURE / mk.NAME
    assert p.read_bytes() == committed.read_bytes(), \
        "fixtures/hook_writer is stale: python3 reference/fixtures/make_hook_writer_fixture.py"
    m = json.loads((FIXTURE / "MANIFEST.json").read_text())
    entry = m["files"][mk.NAME]
    data = committed.read_bytes()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert entry["fnv1a64"] == f"{mk.fnv1a64(data):016x}"
    assert m["source"]["sha256"] == hashlib.sha256(mk.SOURCE.read_bytes()).hexdigest()


def test_fnv1a64_by_hand():
    mk = _maker()
    assert mk.fnv1a64(b"") == 0xCBF29CE484222325
    assert mk.fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector


def test_fixture_values_are_the_golden_trace_rounded():
    mk = _maker()
    with safe_open(str(FIXTURE / mk.NAME), "np") as f, safe_open(str(mk.SOURCE), "np") as g:
        assert sorted(f.keys()) == sorted(mk.HOOKS)
        for k, dt in mk.HOOKS.items():
            v, src = f.get_tensor(k), g.get_tensor(k)
            assert v.dtype == np.dtype(dt)
            np.testing.assert_array_equal(v, src.astype(dt))
        meta = f.metadata()
    assert json.loads(meta["not_captured"]) == mk.NOT_CAPTURED
    assert meta["tokens"] == g_tokens() and meta["architecture"] == "glm-dsa"


def g_tokens():
    with safe_open(str(_maker().SOURCE), "np") as g:
        return json.dumps(json.loads(g.metadata()["tokens"]))
