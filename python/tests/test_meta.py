"""Trace metadata: every required key, strings only, refused values."""

import json
import re
from pathlib import Path

import pytest

import glmdiff_hooks
from glmdiff_hooks import build_metadata, dtype_word, names

ARGS = dict(model_file="glm5-tiny-f32.gguf", architecture="glm-dsa", tokens=[1, 2, 3], engine="x", dtype="f32")


def test_required_keys_and_the_package_version():
    m = build_metadata(**ARGS)
    assert set(m) == set(names.REQUIRED_KEYS) | {"not_captured", "hook_script"}
    assert all(isinstance(v, str) for v in m.values())
    assert m["glmdiff_trace"] == "1" and m["mode"] == "chained"
    assert json.loads(m["tokens"]) == [1, 2, 3] and json.loads(m["not_captured"]) == {}
    assert m["hook_script"] == f"glmdiff_hooks {glmdiff_hooks.__version__}"


def test_optional_keys():
    m = build_metadata(**ARGS, models=["a.gguf", "b.gguf"], prompt="hi", not_captured={"blk.*.q_a": "fused"},
                       extra={"indexer_dtype": "fp8"})
    assert json.loads(m["models"]) == ["a.gguf", "b.gguf"] and m["prompt"] == "hi"
    assert json.loads(m["not_captured"]) == {"blk.*.q_a": "fused"} and m["indexer_dtype"] == "fp8"
    assert set(m) <= set(names.REQUIRED_KEYS) | set(names.OPTIONAL_KEYS)


@pytest.mark.parametrize("change,msg", [
    ({"model_file": ""}, "model .* is empty"),
    ({"architecture": "?"}, "architecture '\\?' is not one of"),
    ({"architecture": "llama"}, "is not one of"),
    ({"tokens": []}, "tokens is empty"),
    ({"tokens": [1, -2]}, "token 1 is -2"),
    ({"tokens": [1, True]}, "token 1 is True"),
    ({"tokens": [1.5]}, "token 0 is 1.5"),
    ({"tokens": ["a"]}, "token 0 is .a."),
    ({"mode": "isolated"}, "mode 'isolated'"),
    ({"extra": {"model": "other.gguf"}}, "extra key 'model'"),
])
def test_refused(change, msg):
    with pytest.raises(ValueError, match=msg):
        build_metadata(**{**ARGS, **change})


def test_dtype_words():
    assert [dtype_word(x) for x in ("torch.float64", "float32", "torch.bfloat16", "torch.float16")] == \
        ["f64", "f32", "bf16", "f16"]
    assert dtype_word("torch.float8_e4m3fn") == "fp8"
    assert set(dtype_word(x) for x in ("float64", "float32", "bfloat16", "float16")) <= set(names.DTYPE_WORDS)


def test_one_version_for_package_and_metadata():
    pyproject = (Path(glmdiff_hooks.__file__).parent.parent / "pyproject.toml").read_text()
    assert 'version = { attr = "glmdiff_hooks._version.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", glmdiff_hooks.__version__)
