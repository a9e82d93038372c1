#!/usr/bin/env python3
"""Build the model fixtures: tiny random GLM-5 / DeepSeek-V3 GGUFs and float64 golden traces.

For every model of `tiny_models.MODEL_SPECS`:
- a transformers model with seeded random weights and a tiny byte-level BPE is saved to
  reference/work/hf/<name>/ and converted with llama.cpp's own `convert_hf_to_gguf.py`
  (`--outtype f32` and `--outtype f16`; every weight is f16-exact, so both files hold one function),
  or, for the "-q" models, turned into a mixed-quant GGUF whose quant blocks were drawn first and
  whose dequantized values were loaded into the transformers model (quant_oracle.py);
- golden traces of every hook point (golden.py: transformers, float64) are written for two prompts;
- every trace is cross-checked against an independent float64 numpy forward of the spec that reads
  only the GGUF (spec_forward.py), and the GGUF tensors are checked against the transformers
  weights through the converter's layout.
Outputs go to fixtures/models/<name>/ with fixtures/models/MANIFEST.json.

Usage: python reference/make_model_fixtures.py [--llama-cpp DIR] [--out DIR] [--only NAME ...]
DIR is llama.cpp's source root (with convert_hf_to_gguf.py). By default the llama-cpp-python sdist
(which vendors llama.cpp) is fetched with pip into reference/work/ (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work"
sys.path.insert(0, str(HERE))

import golden  # noqa: E402
import quant_oracle as qo  # noqa: E402
import spec_forward as sf  # noqa: E402
import tiny_models as tm  # noqa: E402

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TRACE_FORMAT_VERSION = "1"
GGUF_ARCH = {"glm_moe_dsa": "glm-dsa", "deepseek_v3": "deepseek2"}
TOKENIZER_PRE = {"glm_moe_dsa": "glm4", "deepseek_v3": "deepseek-v3"}
#: Smallest accepted routing / indexer decision margins (float64 golden vs f32 engines).
MIN_MOE_MARGIN = 3e-3
MIN_INDEXER_REL_MARGIN = 3e-3
#: Largest accepted relative difference between the transformers trace and the numpy GGUF forward.
MAX_CROSSCHECK_REL = 1e-9
#: Same, reading yarn_log_multiplier as stored (float32) instead of the config's exact value.
MAX_CROSSCHECK_REL_F32_YARN_META = 1e-7
#: general.file_type written into the mixed-quant files (LLAMA_FTYPE_MOSTLY_Q4_K_M).
MIXED_FILE_TYPE = 15

#: Facts about the converter and transformers found while building these fixtures (MANIFEST "notes").
NOTES = [
    "converter: tokenizer hash check patched at run time (convert_runner.py) to return 'glm4' / 'deepseek-v3'",
    "converter: kv_b_proj is always split into attn_k_b [ne nope, kv_lora, H] and attn_v_b [ne kv_lora, v, H]; "
    "no attn_kv_b is written",
    "converter: --outtype f16 keeps F32 for 1-D tensors, *_norm.weight, biases, ffn_gate_inp and indexer.proj "
    "(conversion/base.py prepare_tensors: 'DSA indexer weights should be F32')",
    "converter (glm-dsa): the NextN/MTP block model.layers.{n} becomes blk.{n} (full layer incl. indexer and MoE) "
    "plus blk.{n}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}; block_count = n + 1, nextn_predict_layers = 1; "
    "attention.indexer.types has n entries (trunk layers only)",
    "converter (deepseek2): MTP layers are skipped (skip_mtp) and no nextn_predict_layers key is written",
    "converter: expert_gating_func is written only when config.json has scoring_func (transformers 5 drops it; "
    "added by save_hf); expert_group_count/expert_group_used_count come from n_group/topk_group (written even "
    "when 1/1)",
    "converter: yarn_log_multiplier = 0.1 * mscale_all_dim is stored as float32 (0.10000000149); traces use the "
    "exact 0.1 of the config, so a float64 engine reading the GGUF differs by ~1e-8 relative (checked)",
    "converter: key_length / value_length are the absorbed MQA widths (kv_lora + rope, kv_lora); the per-head "
    "widths are key_length_mla / value_length_mla",
    "transformers: q_a_layernorm / kv_a_layernorm are built with eps 1e-6; set to rms_norm_eps for the traces",
    "transformers: RMSNorm, RoPE angles, eager softmax, router and DSA indexer run in float32 inside a float64 "
    "model; replaced by float64 versions (golden.py). Unpatched float64 logits differ by ~1e-6",
    "transformers: GlmMoeDsaIndexer takes top-k over all T positions (masked future ones included) for queries "
    "that see fewer than index_topk keys; the trace keeps k = min(index_topk, t+1) causal positions (same mask)",
    "transformers: the interleaved RoPE helper returns rotated pairs de-interleaved (evens, then odds); "
    "q_pe_rope / k_pe_rope are re-interleaved to GGUF order",
    "llama.cpp glm-dsa sets no f_norm_eps, so its indexer k_norm LayerNorm uses eps 0 (deepseek32 sets 1e-6); "
    "the traces use 1e-6 (transformers, spec 2.2)",
    "llama.cpp (CPU) on a host with AMX repacks Q8_0/K-quant weights into AMX buffers; attn_k_b (3-D, batched "
    "matmul) then has no backend and graph scheduling aborts (GGML_ASSERT cur_backend_id != -1); "
    "reference/llama_check.c loads with use_extra_bufts = false",
    "llama.cpp multiplies F16 weights with F16-rounded activations, so its logits on the F16 files differ from "
    "the trace by KL ~1e-6 although the F16 and F32 files hold the same weights (F32 files: KL ~1e-12)",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_or_fetch_llama_cpp(arg: str | None) -> Path:
    """llama.cpp source root: the given path, an unpacked sdist in reference/work, or a fresh one."""
    if arg:
        root = Path(arg).resolve()
    else:
        root = WORK / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        if not (root / "convert_hf_to_gguf.py").exists():
            dl = WORK / "dl"
            dl.mkdir(parents=True, exist_ok=True)
            sdist = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
            if not sdist.exists():
                # --no-binary only for this package: its build tools (cmake, ninja) come as wheels.
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                                "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                                "-d", str(dl)], check=True)
            top = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
            keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "src/llama-vocab.cpp")
            with tarfile.open(sdist) as tf:
                members = [m for m in tf.getmembers()
                           if m.name.startswith(top) and m.name[len(top):].startswith(keep)]
                tf.extractall(WORK, members=members, filter="data")
    if not (root / "convert_hf_to_gguf.py").exists():
        raise SystemExit(f"no convert_hf_to_gguf.py under {root}")
    return root


def converter_provenance(llama: Path) -> dict:
    files = ["convert_hf_to_gguf.py", "conversion/base.py", "conversion/deepseek.py", "conversion/glm.py",
             "gguf-py/gguf/constants.py", "gguf-py/gguf/tensor_mapping.py", "gguf-py/gguf/gguf_writer.py"]
    out = {"source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist, vendor/llama.cpp"
           if f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" in str(llama) else str(llama),
           "sha256": {}}
    for f in files:
        p = llama / f
        if p.exists():
            out["sha256"][f] = sha256(p)
    pyproject = llama / "gguf-py" / "pyproject.toml"
    if pyproject.exists():
        for line in pyproject.read_text().splitlines():
            if line.startswith("version"):
                out["gguf_py_version"] = line.split("=", 1)[1].strip().strip('"')
                break
    return out


def run_converter(llama: Path, tokpre: str, hf_dir: Path, outtype: str, outfile: Path) -> None:
    outfile.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "convert_runner.py"), str(llama), tokpre, str(hf_dir),
           "--outtype", outtype, "--outfile", str(outfile)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-8000:])
        raise SystemExit(f"converter failed for {hf_dir} ({outtype})")
    (outfile.parent / (outfile.name + ".convert.log")).write_text(res.stderr)


def gguf_listing(path: Path) -> dict:
    """Metadata (token arrays summarised) and tensor list [name, type, ne] of a GGUF."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        val = f.contents()
        if isinstance(val, list) and len(val) > 16:
            val = {"array_len": len(val), "first": val[:4], "last": val[-2:]}
        meta[f.name] = {"type": f.types[0].name if f.types else "?", "value": val}
    tensors = [[t.name, t.tensor_type.name, [int(x) for x in t.shape]] for t in r.tensors]
    return {"metadata": meta, "tensors": tensors}


def check_gguf_vs_hf(model, tensors: dict[str, np.ndarray], n_layers: int) -> dict:
    """Every trunk GGUF tensor equals the transformers weight mapped through the converter layout."""
    checked, mtp = 0, []
    for name, vals in tensors.items():
        if name.startswith(f"blk.{n_layers}."):
            mtp.append(name)
            continue
        ref = qo.hf_view(model, name).detach().cpu().double().numpy()
        if ref.shape != vals.shape or not np.array_equal(ref, vals):
            diff = np.abs(ref - vals).max() if ref.shape == vals.shape else "shape"
            raise SystemExit(f"gguf tensor {name} differs from the transformers weight: {diff}")
        checked += 1
    return {"tensors_equal_to_hf": checked, "mtp_tensors_not_in_hf_model": len(mtp)}


def write_trace(path: Path, rec: golden.Recorder, meta: dict) -> None:
    """Write a safetensors file with sorted keys, so identical traces give identical bytes.

    (The safetensors package writes `__metadata__` in hash order.) Layout per the safetensors
    format: u64 LE header length, JSON header padded with spaces to 8 bytes, raw little-endian data.
    """
    from safetensors.numpy import load_file

    arrs = {}
    for k in sorted(rec.t):
        v = rec.t[k]
        arrs[k] = np.ascontiguousarray(v.astype("<i4") if v.dtype.kind == "i" else v.astype("<f8"))
    header: dict = {"__metadata__": {k: str(meta[k]) for k in sorted(meta)}}
    off = 0
    for k, v in arrs.items():
        header[k] = {"dtype": "I32" if v.dtype.kind == "i" else "F64", "shape": list(v.shape),
                     "data_offsets": [off, off + v.nbytes]}
        off += v.nbytes
    hb = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for v in arrs.values():
            f.write(v.tobytes())
    back = load_file(str(path))
    for k, v in arrs.items():
        if not np.array_equal(back[k], v, equal_nan=True):
            raise SystemExit(f"{path}: {k} did not read back")


def dsa_effect(model, ids: list[int]) -> float:
    """max |logits(sparse DSA) - logits(dense attention)|: the indexer pruning must matter."""
    rec = golden.golden_trace(model, "glm_moe_dsa", ids)
    saved = []
    for layer in model.model.layers:
        saved.append(layer.self_attn.indexer.index_topk)
        layer.self_attn.indexer.index_topk = 1 << 30
    try:
        dense = golden.golden_trace(model, "glm_moe_dsa", ids)
    finally:
        for layer, k in zip(model.model.layers, saved):
            layer.self_attn.indexer.index_topk = k
    return float(np.abs(rec.t["logits"] - dense.t["logits"]).max())


def copy_as_mixed(src: Path, dst: Path, arch: str, raw: dict[str, tuple]) -> None:
    """Write `dst` with `src`'s metadata and tensors, replacing planned tensors by raw data."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        val = f.contents()
        if f.name == "general.file_type":
            val = MIXED_FILE_TYPE
        main = f.types[0]
        if main == GGUFValueType.ARRAY:
            w.add_key_value(f.name, val, main, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, val, main)
    for t in r.tensors:
        if t.name in raw:
            data, qtype = raw[t.name]
            if qtype.name in ("F32", "F16"):
                w.add_tensor(t.name, data)
            else:
                w.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            shape = tuple(int(x) for x in reversed(t.shape))
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def draw_plan(spec, model, rng) -> tuple[dict, dict]:
    """Draw the planned tensors (quant blocks, or rounded values) and load them into the model.

    Shapes and current values come from the converter layout (`quant_oracle.hf_view`); pass 1 of the
    converter checks that layout. Returns (raw data by GGUF name, exact float32 values by name).
    """
    plan = qo.PLANS[spec.name]
    raw, exact = {}, {}
    for name in sorted(plan):
        qtype = plan[name]
        cur = qo.hf_view(model, name).detach().cpu().numpy().astype(np.float32)
        if qtype.name in ("F32", "F16", "BF16"):
            data, vals = qo.round_to(qtype, cur)
        else:
            std = qo.WEIGHT_GAIN / np.sqrt(qo.fan_in(name, cur.shape))
            data, vals = qo.draw_tensor(qtype, cur.shape, std, rng)
        raw[name] = (data, qtype)
        exact[name] = vals
        qo.apply_gguf_to_hf(model, name, vals)
    return raw, exact


def build_quantized(spec, model, tok, hf_dir: Path, llama: Path, out_gguf: Path, rng) -> dict:
    """Steps 1-3 of quant_oracle.py; returns check results."""
    pre = TOKENIZER_PRE[spec.arch]
    plan = qo.PLANS[spec.name]
    pass1 = WORK / "gguf" / f"{spec.name}-pass1-f32.gguf"
    run_converter(llama, pre, hf_dir, "f32", pass1)
    _, t1, _ = sf.load_gguf(pass1)
    missing = sorted(set(plan) - set(t1))
    if missing:
        raise SystemExit(f"plan names tensors the converter did not write: {missing}")
    check_gguf_vs_hf(model, t1, spec.layers)  # the layout used by draw_plan is the converter's
    raw, exact = draw_plan(spec, model, rng)
    tm.save_hf(model, tok, spec, hf_dir)
    pass2 = WORK / "gguf" / f"{spec.name}-pass2-f32.gguf"
    run_converter(llama, pre, hf_dir, "f32", pass2)
    _, t2, _ = sf.load_gguf(pass2)
    for name, vals in t2.items():
        want = exact[name].astype(np.float64) if name in exact else t1[name]
        if not np.array_equal(want, vals):
            raise SystemExit(f"pass-2 tensor {name} differs from the planned values")
    copy_as_mixed(pass2, out_gguf, GGUF_ARCH[spec.arch], raw)
    _, tq, info = sf.load_gguf(out_gguf)
    for name, vals in tq.items():
        if not np.array_equal(vals, t2[name]):
            raise SystemExit(f"mixed tensor {name} does not dequantize to the pass-2 values")
        want_type = plan[name].name if name in plan else "F32"
        if info[name]["type"] != want_type:
            raise SystemExit(f"mixed tensor {name} has type {info[name]['type']}, planned {want_type}")
    return {"planned_tensors": len(plan), "pass2_equals_dequantized_blocks": True,
            "mixed_dequantizes_to_pass2": True,
            "types": sorted({v.name for v in plan.values()})}


def margins_for_seed(spec, seed: int) -> dict:
    """Decision margins of the golden run for one seed (same random stream as build_one)."""
    spec = tm.ModelSpec(**dict(vars(spec), seed=seed))
    rng = np.random.default_rng(spec.seed)
    tok = tm.build_tokenizer(spec)
    model = tm.make_model(spec, tm.make_config(spec, tok))
    if spec.nextn:
        tm.mtp_extra_tensors(model, spec, rng)
    if spec.quantized:
        draw_plan(spec, model, rng)
    out = {}
    for pname, text in spec.prompts.items():
        ids = tok.encode(text, add_special_tokens=False)
        m = golden.golden_trace(model, spec.arch, ids).margins
        out[pname] = (len(ids), min(m["moe"]) if m["moe"] else None,
                      min(m["moe_group"]) if m["moe_group"] else None,
                      min(x[1] for x in m["indexer"]) if m["indexer"] else None)
    return out


def build_one(spec, llama: Path, out_root: Path) -> dict:
    import torch

    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)
    out_dir = out_root / spec.name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    hf_dir = WORK / "hf" / spec.name
    if hf_dir.exists():
        shutil.rmtree(hf_dir)

    tok = tm.build_tokenizer(spec)
    cfg = tm.make_config(spec, tok)
    model = tm.make_model(spec, cfg)
    extra = tm.mtp_extra_tensors(model, spec, rng) if spec.nextn else None
    tm.save_hf(model, tok, spec, hf_dir, extra)
    pre = TOKENIZER_PRE[spec.arch]
    entry: dict = {"architecture": GGUF_ARCH[spec.arch], "hf_model_type": spec.arch, "seed": spec.seed,
                   "spec": {k: v for k, v in vars(spec).items() if k not in ("prompts",)},
                   "hf_config": json.loads((hf_dir / "config.json").read_text())}

    ggufs: list[Path] = []
    if spec.quantized:
        g = out_dir / f"{spec.name}-mixed.gguf"
        entry["quant_checks"] = build_quantized(spec, model, tok, hf_dir, llama, g, rng)
        ggufs.append(g)
    else:
        for outtype in ("f32", "f16"):
            g = out_dir / f"{spec.name}-{outtype}.gguf"
            run_converter(llama, pre, hf_dir, outtype, g)
            ggufs.append(g)
    loaded = {g.name: sf.load_gguf(g) for g in ggufs}
    entry["gguf_checks"] = {}
    for g in ggufs:
        _, tensors, _ = loaded[g.name]
        entry["gguf_checks"][g.name] = check_gguf_vs_hf(model, tensors, spec.layers)
    for g in ggufs:  # move converter logs out of the fixtures
        log = g.parent / (g.name + ".convert.log")
        if log.exists():
            (WORK / "logs").mkdir(parents=True, exist_ok=True)
            shutil.move(str(log), WORK / "logs" / log.name)

    # tokenizer test pairs and prompts
    pairs = tm.tokenizer_pairs(tok)
    prompts = {}
    for pname, text in spec.prompts.items():
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        prompts[pname] = {"text": text, "ids": ids}
    tok_json = {"tokenizer_pre": pre, "add_bos_in_prompts": False,
                "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens
                                   + list(tok.get_added_vocab().keys())},
                "pairs": pairs, "prompts": prompts,
                "note": "ids from the transformers tokenizer with add_special_tokens=False"}
    (out_dir / "tokenizer_tests.json").write_text(json.dumps(tok_json, indent=1, ensure_ascii=False) + "\n")

    # golden traces
    import transformers

    entry["traces"] = {}
    for pname, pr in prompts.items():
        ids = pr["ids"]
        rec = golden.golden_trace(model, spec.arch, ids)
        plain = golden.plain_transformers_logits(model, ids)
        rec = golden.golden_trace(model, spec.arch, ids)  # fresh record after the plain run
        mm = rec.margins
        moe_m = min(mm["moe"]) if mm["moe"] else None
        grp_m = min(mm["moe_group"]) if mm["moe_group"] else None
        idx_m = min(mm["indexer"], key=lambda x: x[1]) if mm["indexer"] else None
        if moe_m is not None and moe_m < MIN_MOE_MARGIN:
            raise SystemExit(f"{spec.name}/{pname}: expert selection margin {moe_m:.3g} too small")
        if grp_m is not None and grp_m < MIN_MOE_MARGIN:
            raise SystemExit(f"{spec.name}/{pname}: group selection margin {grp_m:.3g} too small")
        if idx_m is not None and idx_m[1] < MIN_INDEXER_REL_MARGIN:
            raise SystemExit(f"{spec.name}/{pname}: indexer selection margin {idx_m} too small")
        trace_name = f"{spec.name}.{pname}.trace.safetensors"
        meta = {
            "glmdiff_trace": TRACE_FORMAT_VERSION,
            "model": ggufs[0].name,
            "models": json.dumps([g.name for g in ggufs]),
            "architecture": GGUF_ARCH[spec.arch],
            "tokens": json.dumps(ids),
            "prompt": pr["text"],
            "engine": f"transformers-{transformers.__version__} float64",
            "dtype": "float64",
            "mode": "chained",
            "glmdiff_version": "none (reference/make_model_fixtures.py)",
        }
        write_trace(out_dir / trace_name, rec, meta)
        cross = {}
        for g in ggufs:
            meta_g, tensors, _ = loaded[g.name]
            res = sf.compare(rec.t, sf.forward(meta_g, tensors, ids))
            worst = max(res.items(), key=lambda kv: kv[1])
            cross[g.name] = {"max_rel": worst[1], "at": worst[0]}
            limit = MAX_CROSSCHECK_REL
            key = f"{GGUF_ARCH[spec.arch]}.rope.scaling.yarn_log_multiplier"
            if key in meta_g:
                # The converter stores 0.1 * mscale_all_dim as float32 (0.10000000149...); the trace
                # uses the config's exact value. Check with the exact value, and bound the difference.
                exact = dict(meta_g)
                exact[key] = 0.1 * float(spec.yarn["mscale_all_dim"])
                res2 = sf.compare(rec.t, sf.forward(exact, tensors, ids))
                worst2 = max(res2.items(), key=lambda kv: kv[1])
                cross[g.name]["max_rel_with_exact_yarn_log_multiplier"] = worst2[1]
                if worst2[1] > MAX_CROSSCHECK_REL:
                    raise SystemExit(f"{spec.name}/{pname}/{g.name}: numpy GGUF forward differs at {worst2}")
                limit = MAX_CROSSCHECK_REL_F32_YARN_META
            if worst[1] > limit:
                raise SystemExit(f"{spec.name}/{pname}/{g.name}: numpy GGUF forward differs at {worst}")
        t_entry = {
            "file": trace_name, "prompt": pr["text"], "tokens": ids, "n_tokens": len(ids),
            "hooks": len(rec.t),
            "min_expert_margin": moe_m, "min_group_margin": grp_m,
            "min_indexer_margin": None if idx_m is None else
            {"abs": idx_m[0], "rel": idx_m[1], "layer": idx_m[2], "token": idx_m[3]},
            "unpatched_transformers_max_abs_logit_diff": float(np.abs(plain - rec.t["logits"]).max()),
            "rope_inv_freq_f32_vs_f64_max_rel": float((rec.inv_freq_hf / rec.inv_freq_f64 - 1).abs().max()),
            "numpy_gguf_forward_vs_trace": cross,
        }
        if spec.arch == "glm_moe_dsa":
            t_entry["dsa_vs_dense_max_abs_logit_diff"] = dsa_effect(model, ids)
            t_entry["indexer_selected"] = {f"blk.{L}": rec.t[f"blk.{L}.indexer_topk"].tolist()
                                           for L in range(spec.layers)}
        entry["traces"][pname] = t_entry

    entry["files"] = {}
    for p in sorted(out_dir.iterdir()):
        entry["files"][p.name] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    entry["gguf_listing"] = {g.name: gguf_listing(g) for g in ggufs}
    return entry


def versions(llama: Path) -> dict:
    import gguf
    import safetensors
    import tokenizers
    import torch
    import transformers

    try:
        from importlib.metadata import version

        gguf_v = version("gguf")
    except Exception:  # noqa: BLE001
        gguf_v = getattr(gguf, "__version__", "?")
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__, "gguf (pip)": gguf_v,
            "llama.cpp converter": converter_provenance(llama)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", help="llama.cpp source root (default: fetch llama-cpp-python sdist)")
    ap.add_argument("--out", default=str(REPO / "fixtures" / "models"))
    ap.add_argument("--only", nargs="*", help="model names to build (default: all)")
    ap.add_argument("--search-seeds", type=int, default=0,
                    help="only print decision margins for N seeds from each spec's seed, then exit")
    args = ap.parse_args()
    if args.search_seeds:
        for spec in tm.MODEL_SPECS:
            if args.only and spec.name not in args.only:
                continue
            for seed in range(spec.seed, spec.seed + args.search_seeds):
                print(spec.name, seed, margins_for_seed(spec, seed), flush=True)
        return
    llama = find_or_fetch_llama_cpp(args.llama_cpp)
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    manifest_path = out_root / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"models": {}}
    specs = [s for s in tm.MODEL_SPECS if not args.only or s.name in args.only]
    for spec in specs:
        print(f"== {spec.name}", flush=True)
        manifest["models"][spec.name] = build_one(spec, llama, out_root)
        write_manifest(manifest, manifest_path, llama)


def write_manifest(manifest: dict, manifest_path: Path, llama: Path) -> None:
    manifest["script"] = "reference/make_model_fixtures.py (with tiny_models.py, golden.py, quant_oracle.py, " \
                         "spec_forward.py, convert_runner.py)"
    manifest["command"] = "python3 reference/make_model_fixtures.py"
    manifest["versions"] = versions(llama)
    manifest["notes"] = NOTES
    manifest["trace_format"] = {
        "dtype": "F64 (I32 for moe_topk_ids and indexer_topk)",
        "hook_names": "shared/spec/hooks.md",
        "moe_topk_ids_order": "descending selection score sigmoid(logit) + exp_probs_b; moe_weights same order",
        "indexer_topk_order": "descending index score, -1 padded; k = min(index_topk, t+1)",
        "q_pe_rope/k_pe_rope": "GGUF element order (interleaved pairs)",
        "mla_norm_eps": "q_a/kv_a norms use rms_norm_eps (spec section 5)",
        "trace_applies_to": "every GGUF of the model (metadata key 'models'); F32 and F16 files hold the same "
                            "weights because every weight is f16-representable",
    }
    total = sum(f["bytes"] for m in manifest["models"].values() for f in m["files"].values())
    manifest["total_bytes"] = total
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"total fixture bytes: {total}", flush=True)


if __name__ == "__main__":
    main()
