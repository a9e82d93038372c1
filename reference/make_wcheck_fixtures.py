#!/usr/bin/env python3
"""Build the `weights-check` fixtures: tiny Hugging Face checkpoints, the GGUFs converted from them,
and GGUFs with planted mapping bugs. Everything here is independent of glmdiff: transformers and
numpy make the weights, llama.cpp's converter and its own quantizers (ggml_quantize_chunk through
reference/ggml_quant.py) make the GGUFs, gguf-py writes the broken ones.

Outputs (fixtures/wcheck/, see its README.md and MANIFEST.json):
- glm5-tiny-hf/, dsv3-tiny-hf/ (F16; dsv3 in two shards with model.safetensors.index.json): the
  checkpoints the committed fixtures/models/{glm5,dsv3}-tiny/*-{f32,f16}.gguf were converted from.
  They are regenerated with the seeds of tiny_models.MODEL_SPECS (the same random stream as
  make_model_fixtures.build_one) and every GGUF tensor is checked bit for bit against them through
  the converter's layout (gguf-py reads the GGUF). F16 is lossless: those weights are f16-exact.
- glm5-tiny-q-bf16-hf/ (BF16, three shards + index) and glm5-tiny-q-bf16.gguf: the glm5-tiny-q
  model's own random weights rounded to BF16, converted with llama.cpp's converter (--outtype f32)
  and quantized tensor by tensor with ggml to the types of quant_oracle.PLANS (with a seeded
  synthetic importance matrix, as llama-quantize --imatrix would).
- dsv3-tiny-q-fp8-hf/ (FP8 E4M3 weights with 128x128 weight_scale_inv blocks, BF16 elsewhere,
  as DeepSeek's FP8 release) and dsv3-tiny-q-fp8.gguf: converted by llama.cpp's converter (which
  dequantizes the FP8 blocks) and quantized the same way.
- broken/: copies with one planted mapping bug each (experts permuted, kv_b split as all K then
  all V rows, a transposed projection, two layers' tensors swapped), with the expected diagnosis in
  MANIFEST.json.

Usage: python3 reference/make_wcheck_fixtures.py [--llama-cpp DIR]
(the llama.cpp source as make_model_fixtures.py fetches it; libggml-base is built with cmake.)
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "wcheck"
OUT = REPO / "fixtures" / "wcheck"
sys.path.insert(0, str(HERE))

import make_model_fixtures as mmf  # noqa: E402
import quant_oracle as qo  # noqa: E402
import spec_forward as sf  # noqa: E402
import tiny_models as tm  # noqa: E402
from ggml_quant import GgmlQuant, build_libggml  # noqa: E402

#: Seed of the synthetic importance matrices and of the planted expert permutation.
SEED = 7731
#: FP8 block of DeepSeek's and GLM's FP8 releases.
FP8_BLOCK = 128
#: Planted expert permutation (GGUF expert i holds HF expert PERM[i]).
EXPERT_PERM = [2, 0, 1, 3, 4, 7, 5, 6]

# ---------------------------------------------------------------------------------------------
# The converter's layout, written from the architecture spec section 3 (independent of glmdiff)
# ---------------------------------------------------------------------------------------------

SIMPLE = dict(qo._SIMPLE)
SIMPLE.update({
    "attn_kv_b": "self_attn.kv_b_proj.weight",
    "nextn.eh_proj": "eh_proj.weight", "nextn.enorm": "enorm.weight", "nextn.hnorm": "hnorm.weight",
    "nextn.shared_head_norm": "shared_head.norm.weight",
})


def gguf_from_hf(name: str, hf: dict[str, np.ndarray], cfg: dict) -> np.ndarray:
    """The values of GGUF tensor `name` (numpy shape = ne reversed) from HF tensors `hf`."""
    glob = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
            "output_norm.weight": "model.norm.weight"}
    if name in glob:
        return hf[glob[name]]
    _, layer, rest = name.split(".", 2)
    base, kind = rest.rsplit(".", 1)
    pre = f"model.layers.{layer}."
    if base == "exp_probs_b":
        return hf[pre + "mlp.gate.e_score_correction_bias"]
    if base == "indexer.k_norm" and kind == "bias":
        return hf[pre + "self_attn.indexer.k_norm.bias"]
    if base in SIMPLE:
        return hf[pre + SIMPLE[base]]
    h, nope, v, kvl = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                       cfg["kv_lora_rank"])
    if base in ("attn_k_b", "attn_v_b"):
        kv = hf[pre + "self_attn.kv_b_proj.weight"].reshape(h, nope + v, kvl)
        return kv[:, :nope, :].transpose(0, 2, 1) if base == "attn_k_b" else kv[:, nope:, :]
    proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[base]
    return np.stack([hf[f"{pre}mlp.experts.{e}.{proj}.weight"] for e in range(cfg["n_routed_experts"])])


# ---------------------------------------------------------------------------------------------
# Deterministic safetensors (sorted keys, fixed header), torch dtypes
# ---------------------------------------------------------------------------------------------

ST_DTYPE = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
            "torch.float8_e4m3fn": "F8_E4M3"}


def write_safetensors(path: Path, tensors: dict) -> None:
    import torch
    from safetensors.torch import load_file

    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    blobs = []
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        b = t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": ST_DTYPE[str(t.dtype)], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for b in blobs:
            f.write(b)
    back = load_file(str(path))
    for k, t in tensors.items():
        if not torch.equal(back[k].view(torch.uint8), t.contiguous().view(torch.uint8)):
            raise SystemExit(f"{path}: {k} did not read back")


def write_checkpoint(out: Path, tensors: dict, config: dict, shards: int) -> None:
    """config.json and `shards` safetensors files (with an index when more than one)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(out / "model.safetensors", tensors)
        return
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / fname, {k: tensors[k] for k in part})
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_work_hf(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

def spec_named(name: str):
    return next(s for s in tm.MODEL_SPECS if s.name == name)


def regenerate(spec, hf_dir: Path, round_to=None):
    """The tiny model of `spec` as make_model_fixtures.build_one makes it (same seeds and random
    stream), saved to hf_dir (f32, per-expert tensors, tokenizer). `round_to` ("bf16") rounds every
    weight first. Returns (hf tensors by name, config dict)."""
    import torch

    torch.manual_seed(spec.seed)
    rng = np.random.default_rng(spec.seed)
    tok = tm.build_tokenizer(spec)
    cfg = tm.make_config(spec, tok)
    model = tm.make_model(spec, cfg)
    extra = tm.mtp_extra_tensors(model, spec, rng) if spec.nextn else None
    if round_to == "bf16":
        with torch.no_grad():
            for p in model.state_dict().values():
                if p.is_floating_point():
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    tm.save_hf(model, tok, spec, hf_dir, extra)
    return load_work_hf(hf_dir), json.loads((hf_dir / "config.json").read_text())


def check_gguf(gguf: Path, hf: dict[str, np.ndarray], cfg: dict, exact: bool = True) -> dict:
    """Every GGUF tensor equals the HF values through the converter layout (gguf-py dequantizes)."""
    _, tensors, info = sf.load_gguf(gguf)
    worst = 0.0
    for name, vals in tensors.items():
        want = gguf_from_hf(name, hf, cfg).astype(np.float64)
        if want.shape != vals.shape:
            raise SystemExit(f"{gguf.name}: {name} shape {vals.shape} vs HF {want.shape}")
        if exact and not np.array_equal(want, vals):
            raise SystemExit(f"{gguf.name}: {name} differs from the HF checkpoint "
                             f"(max {np.abs(want - vals).max():.3g})")
        worst = max(worst, float(np.abs(want - vals).max()))
    return {"tensors": len(tensors), "bit_exact": exact, "max_abs_diff": worst,
            "types": sorted({i["type"] for i in info.values()})}


def synthetic_imatrix(n: int, rng) -> np.ndarray:
    """Per-column importance as llama-quantize --imatrix passes it (mean squared activations)."""
    return np.exp(rng.normal(0.0, 1.0, n)).astype(np.float32)


def quantize_like_plan(q: GgmlQuant, f32_gguf: Path, out: Path, plan: dict, arch: str, rng) -> dict:
    """llama.cpp's quantizers on each planned tensor of a converter F32 GGUF; the rest stay F32."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants as gq

    _, tensors, _ = sf.load_gguf(f32_gguf)
    raw = {}
    for name, qtype in sorted(plan.items()):
        x = tensors[name].astype(np.float32)
        if qtype == Q.F16:
            raw[name] = (x.astype(np.float16), qtype)
        elif qtype == Q.BF16:
            raw[name] = (gq.quantize(x, Q.BF16), qtype)
        elif qtype == Q.F32:
            raw[name] = (x, qtype)
        else:
            mats = x.reshape(-1, *x.shape[-2:]) if x.ndim == 3 else x.reshape(1, -1, x.shape[-1])
            blocks = [q.quantize(qtype, m, synthetic_imatrix(m.shape[-1], rng)) for m in mats]
            data = np.stack(blocks) if x.ndim == 3 else blocks[0].reshape(*x.shape[:-1], -1)
            raw[name] = (data, qtype)
    mmf.copy_as_mixed(f32_gguf, out, arch, raw)
    return {"quantized": {k: v[1].name for k, v in sorted(raw.items())},
            "quantizer": "ggml_quantize_chunk (llama.cpp), synthetic log-normal imatrix, seed %d" % SEED}


def to_fp8_blocks(w: np.ndarray):
    """FP8 E4M3 weights and f32 weight_scale_inv per 128x128 block (scale = amax / 448)."""
    import torch

    r, c = w.shape
    br, bc = -(-r // FP8_BLOCK), -(-c // FP8_BLOCK)
    scale = np.zeros((br, bc), np.float32)
    q = np.zeros_like(w, dtype=np.float32)
    for i in range(br):
        for j in range(bc):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            s = np.float32(max(np.abs(blk).max(), 1e-12) / 448.0)
            scale[i, j] = s
            q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = blk / s
    fp8 = torch.from_numpy(q).to(torch.float8_e4m3fn)
    deq = (fp8.to(torch.float32).numpy() * np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[:r, :c])
    return fp8, torch.from_numpy(scale), deq.astype(np.float32)


def is_fp8_weight(name: str, shape) -> bool:
    """The linear weights DeepSeek's FP8 release stores in FP8 (not embeddings, head, router)."""
    return (len(shape) == 2 and name.endswith("proj.weight") and "embed" not in name
            and "lm_head" not in name and "weights_proj" not in name)


# ---------------------------------------------------------------------------------------------
# Broken GGUFs
# ---------------------------------------------------------------------------------------------

def copy_gguf(src: Path, dst: Path, arch: str, replace: dict) -> None:
    """`src` rewritten with gguf-py: same metadata and tensors in the same order, except the
    tensors in `replace` (name -> (array, type): element arrays for F32/F16, raw blocks otherwise)."""
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        main = f.types[0]
        if main == GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), main, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), main)
    for t in r.tensors:
        data, qt = replace.get(t.name, (None, t.tensor_type))
        if data is None:
            data = np.asarray(t.data)
            if qt in (Q.F32, Q.F16):
                data = data.reshape(tuple(int(x) for x in reversed(t.shape)))
        if qt in (Q.F32, Q.F16):
            w.add_tensor(t.name, np.ascontiguousarray(data))
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reader_tensors(path: Path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {t.name: t for t in r.tensors}


def plant_experts_permuted(src: Path, dst: Path, arch: str, layer: int) -> dict:
    ts = reader_tensors(src)
    raw = {}
    for proj in ("gate", "up", "down"):
        n = f"blk.{layer}.ffn_{proj}_exps.weight"
        t = ts[n]
        data = np.asarray(t.data)
        raw[n] = (np.ascontiguousarray(data[EXPERT_PERM]), t.tensor_type)
    copy_gguf(src, dst, arch, raw)
    return {n: {"diagnosis": "experts_permuted", "permutation": EXPERT_PERM} for n in raw}


def plant_kv_b_concat(src: Path, dst: Path, arch: str, hf, cfg, q: GgmlQuant, rng) -> dict:
    """kv_b_proj split as if its rows were [all K heads; all V heads] (the wrong converter)."""
    from gguf import GGMLQuantizationType as Q

    ts = reader_tensors(src)
    h, nope, v, kvl = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                       cfg["kv_lora_rank"])
    raw, planted = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        w = hf[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
        k_b = w[:h * nope].reshape(h, nope, kvl).transpose(0, 2, 1)
        v_b = w[h * nope:].reshape(h, v, kvl)
        for n, x in ((f"blk.{layer}.attn_k_b.weight", k_b), (f"blk.{layer}.attn_v_b.weight", v_b)):
            qt = ts[n].tensor_type
            x = np.ascontiguousarray(x, np.float32)
            if qt in (Q.F32, Q.F16):
                raw[n] = (x.astype(np.float16 if qt == Q.F16 else np.float32), qt)
            else:
                raw[n] = (np.stack([q.quantize(qt, m, synthetic_imatrix(m.shape[-1], rng)) for m in x]), qt)
            planted[n] = {"diagnosis": "kv_b_concatenated"}
    copy_gguf(src, dst, arch, raw)
    return planted


def plant_transposed(src: Path, dst: Path, arch: str, name: str) -> dict:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants as gq

    t = reader_tensors(src)[name]
    shape = tuple(int(x) for x in reversed(t.shape))
    vals = gq.dequantize(t.data, t.tensor_type).reshape(shape)
    assert t.tensor_type in (Q.F16, Q.F32)
    dt = np.float16 if t.tensor_type == Q.F16 else np.float32
    copy_gguf(src, dst, arch, {name: (np.ascontiguousarray(vals.T.astype(dt)), t.tensor_type)})
    return {name: {"diagnosis": "transposed"}}


def plant_layer_swap(src: Path, dst: Path, arch: str, a: int, b: int) -> dict:
    from gguf import GGMLQuantizationType as Q

    ts = reader_tensors(src)
    raw, planted = {}, {}
    for n, t in ts.items():
        for x, y in ((a, b), (b, a)):
            if n.startswith(f"blk.{x}."):
                other = ts[f"blk.{y}." + n.split(".", 2)[2]]
                data = np.asarray(other.data)
                shape = tuple(int(s) for s in reversed(other.shape))
                if other.tensor_type in (Q.F32, Q.F16):
                    data = data.reshape(shape)
                raw[n] = (data, other.tensor_type)
                planted[n] = {"diagnosis": "layer_shift", "layer": y}
    copy_gguf(src, dst, arch, raw)
    return planted


# ---------------------------------------------------------------------------------------------

def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", help="llama.cpp source root (default: as make_model_fixtures.py)")
    args = ap.parse_args()
    llama = mmf.find_or_fetch_llama_cpp(args.llama_cpp)
    q = GgmlQuant(build_libggml(llama))
    rng = np.random.default_rng(SEED)
    WORK.mkdir(parents=True, exist_ok=True)
    if OUT.exists():  # README.md is written by hand and kept
        for p in OUT.iterdir():
            if p.name != "README.md":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    (OUT / "broken").mkdir(parents=True)
    manifest: dict = {"checkpoints": {}, "ggufs": {}, "broken": {}}
    models = REPO / "fixtures" / "models"

    # 1. The checkpoints of the committed f32/f16 GGUFs (F16 safetensors: lossless).
    for name, shards in (("glm5-tiny", 1), ("dsv3-tiny", 2)):
        spec = spec_named(name)
        hf, cfg = regenerate(spec, WORK / "hf" / name)
        for k, v in hf.items():
            if not np.array_equal(v.astype(np.float16).astype(np.float32), v):
                raise SystemExit(f"{name}: {k} is not f16-exact")
        out = OUT / f"{name}-hf"
        write_checkpoint(out, {k: torch.from_numpy(v.astype(np.float16)) for k, v in hf.items()}, cfg, shards)
        checks = {g.name: check_gguf(g, hf, cfg) for g in sorted((models / name).glob("*.gguf"))}
        manifest["checkpoints"][out.name] = {"model": name, "seed": spec.seed, "dtype": "F16",
                                             "shards": shards, "tensors": len(hf),
                                             "source_of": {f"fixtures/models/{name}/{g}": c
                                                           for g, c in checks.items()}}
        print(f"{out.name}: {len(hf)} tensors, equal to {sorted(checks)}", flush=True)

    # 2. glm5-tiny-q in BF16, converted and quantized by llama.cpp.
    spec = spec_named("glm5-tiny-q")
    hf, cfg = regenerate(spec, WORK / "hf" / "glm5-tiny-q-bf16", round_to="bf16")
    out = OUT / "glm5-tiny-q-bf16-hf"
    write_checkpoint(out, {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in hf.items()}, cfg, 3)
    f32 = WORK / "gguf" / "glm5-tiny-q-bf16-f32.gguf"
    mmf.run_converter(llama, "glm4", WORK / "hf" / "glm5-tiny-q-bf16", "f32", f32)
    conv = check_gguf(f32, hf, cfg)
    g = OUT / "glm5-tiny-q-bf16.gguf"
    quant = quantize_like_plan(q, f32, g, qo.PLANS["glm5-tiny-q"], "glm-dsa", rng)
    manifest["checkpoints"][out.name] = {"model": spec.name, "seed": spec.seed, "dtype": "BF16", "shards": 3,
                                         "tensors": len(hf), "converter_f32_equals_checkpoint": conv}
    manifest["ggufs"][g.name] = {"from": out.name, "converter": "--outtype f32", **quant,
                                 "check": check_gguf(g, hf, cfg, exact=False)}
    glm_q = (g, hf, cfg)

    # 3. dsv3-tiny-q in FP8 E4M3 with 128x128 block scales, converted by llama.cpp (dequantizes).
    spec = spec_named("dsv3-tiny-q")
    hf32, cfg = regenerate(spec, WORK / "hf" / "dsv3-tiny-q-fp8-src", round_to="bf16")
    st, deq = {}, {}
    for k, v in hf32.items():
        if is_fp8_weight(k, v.shape):
            fp8, scale, d = to_fp8_blocks(v)
            st[k], st[k + "_scale_inv"], deq[k] = fp8, scale, d
        elif k.endswith("e_score_correction_bias"):
            st[k], deq[k] = torch.from_numpy(v), v
        else:
            st[k], deq[k] = torch.from_numpy(v).to(torch.bfloat16), v
    cfg_fp8 = dict(cfg, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                             "quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
    out = OUT / "dsv3-tiny-q-fp8-hf"
    write_checkpoint(out, st, cfg_fp8, 1)
    conv_dir = WORK / "hf" / "dsv3-tiny-q-fp8"  # the same files plus the tokenizer, for the converter
    if conv_dir.exists():
        shutil.rmtree(conv_dir)
    shutil.copytree(WORK / "hf" / "dsv3-tiny-q-fp8-src", conv_dir)
    (conv_dir / "model.safetensors").unlink()
    shutil.copy(out / "model.safetensors", conv_dir / "model.safetensors")
    shutil.copy(out / "config.json", conv_dir / "config.json")
    f32 = WORK / "gguf" / "dsv3-tiny-q-fp8-f32.gguf"
    mmf.run_converter(llama, "deepseek-v3", conv_dir, "f32", f32)
    conv = check_gguf(f32, deq, cfg)
    g = OUT / "dsv3-tiny-q-fp8.gguf"
    quant = quantize_like_plan(q, f32, g, qo.PLANS["dsv3-tiny-q"], "deepseek2", rng)
    manifest["checkpoints"][out.name] = {
        "model": spec.name, "seed": spec.seed, "dtype": "F8_E4M3 (linear weights, 128x128 weight_scale_inv "
        "F32, scale = block amax / 448) + BF16 (+ F32 e_score_correction_bias)", "shards": 1,
        "fp8_tensors": sum(1 for k in st if k.endswith("_scale_inv")),
        "converter_f32_equals_dequantized_checkpoint": conv}
    manifest["ggufs"][g.name] = {"from": out.name, "converter": "--outtype f32", **quant,
                                 "check": check_gguf(g, deq, cfg, exact=False)}

    # 4. Planted mapping bugs.
    broken = OUT / "broken"
    g, hf, cfg = glm_q
    plants = {
        "glm5-tiny-q-bf16.experts_permuted.gguf":
            ("glm5-tiny-q-bf16-hf", lambda d: plant_experts_permuted(g, d, "glm-dsa", 1)),
        "glm5-tiny-q-bf16.kv_b_concat.gguf":
            ("glm5-tiny-q-bf16-hf", lambda d: plant_kv_b_concat(g, d, "glm-dsa", hf, cfg, q, rng)),
        "dsv3-tiny-f16.transposed.gguf":
            ("dsv3-tiny-hf", lambda d: plant_transposed(models / "dsv3-tiny" / "dsv3-tiny-f16.gguf", d,
                                                        "deepseek2", "blk.0.attn_q_a.weight")),
        "dsv3-tiny-f16.layer_shift.gguf":
            ("dsv3-tiny-hf", lambda d: plant_layer_swap(models / "dsv3-tiny" / "dsv3-tiny-f16.gguf", d,
                                                        "deepseek2", 1, 2)),
    }
    for fname, (ref, make) in plants.items():
        manifest["broken"][fname] = {"reference": ref, "planted": make(broken / fname)}
        print(f"broken/{fname}: {len(manifest['broken'][fname]['planted'])} tensors planted", flush=True)

    import gguf
    import safetensors
    import transformers
    from importlib.metadata import version

    manifest["script"] = "reference/make_wcheck_fixtures.py (with tiny_models.py, make_model_fixtures.py, " \
                         "quant_oracle.py, spec_forward.py, ggml_quant.py)"
    manifest["seeds"] = {"tiny models": "tiny_models.MODEL_SPECS", "imatrix and quantization": SEED,
                         "expert permutation": EXPERT_PERM}
    manifest["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                            "numpy": np.__version__, "gguf (pip)": version("gguf"),
                            "llama.cpp": mmf.converter_provenance(llama)}
    manifest["files"] = {str(p.relative_to(OUT)): {"bytes": p.stat().st_size, "sha256": mmf.sha256(p)}
                         for p in sorted(OUT.rglob("*")) if p.is_file() and p.name not in ("MANIFEST.json", "README.md")}
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    _ = gguf
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"total bytes: {manifest['total_bytes']}")


if __name__ == "__main__":
    main()
