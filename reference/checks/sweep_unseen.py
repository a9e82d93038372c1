#!/usr/bin/env python3
"""Sweep glmdiff's `trace` over random tiny GLM-5 / DeepSeek-V3 models it has never seen.

For N seeded random configs per architecture (plus transformers' own default configs, scaled down
and initialised by transformers itself) this script:
1. builds the transformers model (`GlmMoeDsaConfig` / `DeepseekV3Config`) with random weights and
   saves it (tiny byte-level BPE tokenizer from tiny_models.py, MTP tensors when the config has
   NextN layers, `scoring_func` in config.json only for some configs: transformers 5 drops it);
2. converts it with llama.cpp's own `convert_hf_to_gguf.py` (`--outtype f32`, and f16 / bf16 /
   q8_0 on some), in one long-lived converter process for the whole sweep;
3. loads every GGUF tensor, dequantized with gguf-py, back into the transformers model through the
   converter's layout (quant_oracle.hf_view), so the golden trace describes the weights AS STORED
   (for the f32 file this is checked to be a no-op: the converter's layout is verified);
4. records the float64 golden trace of every hook with golden.py (the code that made the
   committed traces), runs `glmdiff trace MODEL --tokens ... --out X`, and compares every hook:
   relative L2 <= 1e-5, `moe_topk_ids` / `indexer_topk` as sets, top-1 of the logits per position,
   and the hook names themselves (missing / extra).
Variants are converter outtypes with optional converter flags: `f32`, `f16`, `bf16`, `q8_0`,
`tq1_0`, `tq2_0`, and `+split` (--split-max-tensors), `+fused` (--fuse-gate-up-exps), `+be`
(--bigendian), `+nomtp` / `+mtp` (GLM NextN block dropped / alone). Also checked on the f32 file:
`glmdiff trace --prompt` ids vs the transformers tokenizer, glmdiff's logits vs transformers run in
float64 WITHOUT golden.py's patches (what a naive checker sees), and indexer selections decided by
exactly equal scores.

Status per (config, variant): PASS; TIE (a selection differs where the golden run's own decision
margin is below float32 resolution: not a glmdiff defect, everything downstream excused); FAIL;
REFUSED (glmdiff exits 2 with an error message: right for what it cannot support); ERR (a crash);
CONV (the converter failed); HF (transformers or the oracle cannot build/run the config: glmdiff's
reaction to the converted file is noted); ORACLE / LAYOUT (the GGUF could not be mapped back onto
the transformers weights / the f32 GGUF is not the transformers weights). "hook convention" notes
are hook-set differences that are explained and checked (no shared expert; shared DSA layers).

Usage: python3 reference/checks/sweep_unseen.py [--n 6] [--seed 1] [--only ds|glm|default|special]
        [--configs 3,7] [--glmdiff target/release/glmdiff] [--llama-cpp DIR] [--keep]
Outputs (git-ignored): reference/work/sweep/ (models, traces, results.json, converter.log).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORK = REPO / "reference" / "work" / "sweep"

#: Largest accepted relative L2 error at any hook (tests/reference.rs MAX_REL_L2).
MAX_REL_L2 = 1e-5
#: Expert-selection margins (biased sigmoid scores, absolute) below this are float32 coin flips.
TIE_MOE = 1e-4
#: Indexer-selection margins (relative to the row's largest |score|) below this likewise.
TIE_INDEXER_REL = 1e-4
#: Redraws of the random weights when a routing margin of the f32 model is below TIE_MOE.
MAX_REDRAWS = 4

POINTS = ["attn_norm", "q_a", "q_a_norm", "q_b", "q_pe_rope", "kv_a", "kv_a_norm", "k_pe_rope",
          "indexer_scores", "indexer_topk", "attn_heads", "attn_out", "ffn_inp", "ffn_norm",
          "ffn_gate", "ffn_up", "ffn_act", "moe_logits", "moe_probs", "moe_topk_ids", "moe_weights",
          "moe_routed", "ffn_shexp", "ffn_out", "l_out"]
SELECTIONS = ("moe_topk_ids", "indexer_topk")
RANK = {"PASS": 0, "TIE": 1, "FAIL": 2, "REFUSED": 3, "ERR": 3}


# ---------------------------------------------------------------------------------------------
# Converter worker: one process imports llama.cpp's converter once and converts on request.
# ---------------------------------------------------------------------------------------------

def converter_worker(llama_dir: str) -> None:
    """Serve JSON requests {tokpre, args} on stdin; answer {error} lines on the original stdout.

    The tokenizer-hash check is answered as in convert_runner.py (TextModel.get_vocab_base_pre).
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the converter prints goes to the log
    sys.stdout = sys.stderr
    llama = Path(llama_dir).resolve()
    sys.path.insert(0, str(llama))
    sys.path.insert(1, str(llama / "gguf-py"))
    import convert_hf_to_gguf  # noqa: E402

    try:
        from conversion.base import TextModel
    except ImportError:
        TextModel = convert_hf_to_gguf.TextModel
    state = {"pre": None}
    TextModel.get_vocab_base_pre = lambda self, tokenizer: state["pre"]  # noqa: ARG005
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        state["pre"] = req["tokpre"]
        sys.argv = ["convert_hf_to_gguf.py"] + req["args"]
        print(f"=== convert {req['args']}", file=sys.stderr, flush=True)
        err = None
        try:
            convert_hf_to_gguf.main()
        except SystemExit as e:
            if e.code not in (0, None):
                err = f"converter exit {e.code}"
        except Exception:  # noqa: BLE001
            err = traceback.format_exc()[-2500:]
        reset_mtp_flags(TextModel)
        proto.write(json.dumps({"error": err}) + "\n")


def reset_mtp_flags(cls) -> None:
    """convert_hf_to_gguf.main() sets `mtp_only` / `no_mtp` on the model class for --mtp / --no-mtp
    and never clears them; in a long-lived process they would leak into later conversions."""
    root = next(c for c in cls.__mro__ if "mtp_only" in vars(c))
    todo = list(root.__subclasses__())
    while todo:
        c = todo.pop()
        todo.extend(c.__subclasses__())
        for attr in ("mtp_only", "no_mtp"):
            if attr in vars(c):
                delattr(c, attr)


class Converter:
    def __init__(self, llama: Path, log: Path):
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--converter-worker", str(llama)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready = self.p.stdout.readline()
        if not ready:
            raise SystemExit(f"converter worker did not start; see {log}")

    def convert(self, tokpre: str, hf_dir: Path, outtype: str, out: Path, extra: list[str] = ()) -> str | None:
        req = {"tokpre": tokpre, "args": [str(hf_dir), "--outtype", outtype, "--outfile", str(out), *extra]}
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit("converter worker died")
        return json.loads(line)["error"]

    def close(self):
        self.p.stdin.close()
        self.p.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

GROUPINGS = [(1, 1), (2, 1), (4, 2), (8, 4), (2, 2)]


def random_config(arch: str, rng: random.Random, idx: int) -> dict:
    """One random tiny config (transformers kwargs plus sweep options)."""
    layers = rng.choice([1, 2, 2, 3, 3, 4])
    experts = rng.choice([4, 8, 8, 16])
    groups = [g for g in GROUPINGS if experts % g[0] == 0 and experts // g[0] >= 2]
    n_group, topk_group = groups[idx % len(groups)] if idx < len(groups) else rng.choice(groups)
    allowed = topk_group * (experts // n_group)
    qk_rope = rng.choice([2, 4, 8, 16, 32, 64])
    qk_nope = rng.choice([4, 8, 16, 24, 32])
    v_head = rng.choice([x for x in (8, 12, 16, 24, 40) if x != qk_nope])
    heads = rng.choice([1, 2, 3, 4, 8, 16])
    kw = dict(
        hidden_size=rng.choice([32, 48, 64, 96, 128]),
        intermediate_size=rng.choice([16, 40, 64, 96]),
        moe_intermediate_size=rng.choice([8, 16, 24, 32]),
        num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        n_routed_experts=experts, num_experts_per_tok=rng.randint(1, min(allowed, 6)),
        n_shared_experts=rng.choice([0, 1, 1, 2]),
        routed_scaling_factor=rng.choice([1.0, 2.5, 1.8, 0.75]),
        kv_lora_rank=rng.choice([16, 24, 32, 40, 64]),
        q_lora_rank=rng.choice([16, 24, 32, 48]),
        qk_rope_head_dim=qk_rope, qk_nope_head_dim=qk_nope, v_head_dim=v_head,
        n_group=n_group, topk_group=topk_group,
        norm_topk_prob=rng.random() < 0.6,
        first_k_dense_replace=rng.choice(sorted({0, 1, 2, layers})),
        rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-8, 3e-5]),
        tie_word_embeddings=rng.random() < 0.25,
        attention_bias=False,
    )
    theta = rng.choice([10000.0, 1.0e6, 50000.0, 500.0])
    rope = {"rope_type": "default", "rope_theta": theta}
    yarn_p = 0.6 if arch == "deepseek_v3" else 0.2
    if rng.random() < yarn_p:
        m = rng.choice([(1.0, 1.0), (0.707, 0.707), (None, None), (1.0, None), (0.0, 0.0), (2.0, 2.0)])
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": rng.choice([2.0, 4.0, 16.0, 40.0]),
                "original_max_position_embeddings": rng.choice([64, 256, 4096])}
        if rng.random() < 0.3:
            rope.update(beta_fast=rng.choice([16.0, 32.0, 64.0]), beta_slow=rng.choice([1.0, 2.0]))
        if m[0] is not None:
            rope["mscale"] = m[0]
        if m[1] is not None:
            rope["mscale_all_dim"] = m[1]
    kw["rope_parameters"] = rope
    kw["max_position_embeddings"] = 4096 if rope["rope_type"] == "default" else 4096 * 16
    opts = dict(nextn=rng.choice([0, 0, 1, 2]) if arch == "glm_moe_dsa" else rng.choice([0, 1]),
                scoring_func=rng.random() < 0.5, vocab_extra=rng.choice([0, 10, 64]),
                init="random")
    if arch == "deepseek_v3":
        if rng.random() < 0.25:
            kw["q_lora_rank"] = None  # DeepSeek-V2-Lite style: plain q_proj
    else:
        kw["qk_rope_head_dim"] = qk_rope = rng.choice([4, 8, 16, 32])
        ihd = rng.choice([qk_rope, qk_rope + 8, 32, 64])
        kw.update(index_n_heads=rng.choice([1, 2, 4, 8, 16]), index_head_dim=max(ihd, qk_rope),
                  index_topk=rng.choice([1, 2, 4, 8, 64]))
        if layers >= 2 and rng.random() < 0.3:
            kw["indexer_types"] = ["full"] + [rng.choice(["full", "shared"]) for _ in range(layers - 1)]
    return {"arch": arch, "kw": kw, "opts": opts}


def default_configs() -> list[dict]:
    """transformers' own defaults, only sizes scaled down; weights from transformers' init."""
    common = dict(vocab_size=0, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
                  v_head_dim=32)
    out = []
    glm = dict(common, n_routed_experts=16, index_n_heads=4, index_head_dim=32)
    out.append({"arch": "glm_moe_dsa", "kw": glm, "opts": dict(nextn=0, scoring_func=False, vocab_extra=0,
                                                                init="transformers")})
    glm2 = dict(glm, index_topk=4)
    out.append({"arch": "glm_moe_dsa", "kw": glm2, "opts": dict(nextn=1, scoring_func=False, vocab_extra=0,
                                                                 init="transformers")})
    ds = dict(common, n_routed_experts=16)  # n_group 8 / topk_group 4 / 8 experts per token by default
    out.append({"arch": "deepseek_v3", "kw": ds, "opts": dict(nextn=0, scoring_func=False, vocab_extra=0,
                                                               init="transformers")})
    ds_yarn = dict(ds, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                        "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                   max_position_embeddings=163840)
    out.append({"arch": "deepseek_v3", "kw": ds_yarn, "opts": dict(nextn=0, scoring_func=True, vocab_extra=0,
                                                                    init="transformers")})
    glm3 = dict(glm, num_hidden_layers=2)  # default first_k_dense_replace = 3 > layers
    out.append({"arch": "glm_moe_dsa", "kw": glm3, "opts": dict(nextn=0, scoring_func=False, vocab_extra=0,
                                                                 init="transformers")})
    return out


def special_configs() -> list[dict]:
    """Configs that the GGUF cannot (fully) describe: what glmdiff does with them."""
    base = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=32,
                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)
    big = dict(base, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, kv_lora_rank=256,
               q_lora_rank=256, qk_nope_head_dim=256, v_head_dim=256, qk_rope_head_dim=64)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 256}
    opts = dict(nextn=0, scoring_func=True, vocab_extra=0, init="random")
    return [
        {"arch": "deepseek_v3", "kw": dict(base, attention_bias=True), "opts": dict(opts, special="attention_bias")},
        {"arch": "deepseek_v3", "kw": dict(base, rope_parameters=dict(yarn, mscale_all_dim=1.0),
                                           max_position_embeddings=10240),
         "opts": dict(opts, special="yarn mscale absent, mscale_all_dim 1")},
        {"arch": "deepseek_v3", "kw": dict(base, rope_parameters=dict(yarn, mscale=0.5, mscale_all_dim=1.0),
                                           max_position_embeddings=10240),
         "opts": dict(opts, special="yarn mscale 0.5 != mscale_all_dim 1")},
        {"arch": "deepseek_v3", "kw": dict(base, rope_parameters=dict(yarn, attention_factor=1.3, mscale_all_dim=1.0),
                                           max_position_embeddings=10240),
         "opts": dict(opts, special="yarn attention_factor 1.3, mscale_all_dim 1")},
        {"arch": "deepseek_v3", "kw": dict(base, rope_interleave=False), "opts": dict(opts, special="rope_interleave False")},
        {"arch": "deepseek_v3", "kw": dict(base, hidden_act="gelu"), "opts": dict(opts, special="hidden_act gelu")},
        {"arch": "glm_moe_dsa", "kw": dict(base, index_n_heads=4, index_head_dim=32, index_topk=4),
         "opts": dict(opts, nextn=1, mtp_tensors=False, special="nextn 1 without MTP tensors")},
        {"arch": "glm_moe_dsa", "kw": dict(base, index_n_heads=4, index_head_dim=32, index_topk=4, num_hidden_layers=3,
                                           mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=2),
         "opts": dict(opts, special="mlp_layer_types disagree with first_k_dense_replace")},
        {"arch": "deepseek_v3", "kw": dict(base, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                  "factor": 4.0}),
         "opts": dict(opts, special="rope linear")},
        {"arch": "glm_moe_dsa", "kw": dict(big, index_n_heads=4, index_head_dim=256, index_topk=4),
         "opts": dict(opts, special="ternary", variants=["f32", "tq1_0", "tq2_0", "f32+split"])},
        {"arch": "deepseek_v3", "kw": dict(big, n_group=2, topk_group=1),
         "opts": dict(opts, special="ternary", variants=["f32", "tq1_0", "tq2_0", "f32+split"])},
    ]


def summary(c: dict) -> str:
    k, o = c["kw"], c["opts"]
    a = "glm" if c["arch"] == "glm_moe_dsa" else "ds"
    s = (f"{a} h{k['hidden_size']} L{k['num_hidden_layers']} d{k.get('first_k_dense_replace', 'def')} "
         f"H{k['num_attention_heads']} q{k.get('q_lora_rank')} kv{k['kv_lora_rank']} "
         f"n{k['qk_nope_head_dim']}r{k['qk_rope_head_dim']}v{k['v_head_dim']} "
         f"E{k['n_routed_experts']}k{k.get('num_experts_per_tok', 'def')}s{k.get('n_shared_experts', 'def')} "
         f"g{k.get('n_group', 'def')}/{k.get('topk_group', 'def')}")
    if "norm_topk_prob" in k:
        s += f" nrm{int(k['norm_topk_prob'])} sc{k['routed_scaling_factor']}"
    rp = k.get("rope_parameters")
    if rp and rp["rope_type"] == "yarn":
        s += (f" yarn(f{rp['factor']:g},o{rp['original_max_position_embeddings']},"
              f"m{rp.get('mscale')}/{rp.get('mscale_all_dim')})")
    if rp:
        s += f" th{rp['rope_theta']:g}"
    if "rms_norm_eps" in k:
        s += f" eps{k['rms_norm_eps']:g}"
    if k.get("tie_word_embeddings"):
        s += " tie"
    if c["arch"] == "glm_moe_dsa":
        s += f" ix{k['index_n_heads']}x{k['index_head_dim']}k{k.get('index_topk', 'def')}"
        if "indexer_types" in k:
            s += " types=" + "".join(t[0] for t in k["indexer_types"])
    s += f" mtp{o['nextn']} {'sf' if o['scoring_func'] else 'nosf'}"
    if o["init"] != "random":
        s += " HF-init"
    if o.get("special"):
        s += f" [{o['special']}]"
    return s


# ---------------------------------------------------------------------------------------------
# Model, weights, golden
# ---------------------------------------------------------------------------------------------

def build_model(c: dict, tok, seed: int):
    import numpy as np
    import torch
    import tiny_models as tm
    from transformers import AutoModelForCausalLM, DeepseekV3Config, GlmMoeDsaConfig

    kw = dict(c["kw"])
    kw["vocab_size"] = len(tok) + c["opts"]["vocab_extra"]
    kw.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    if c["arch"] == "glm_moe_dsa":
        cfg = GlmMoeDsaConfig(**kw)
    else:
        cfg = DeepseekV3Config(**kw, num_mtp_layers=c["opts"]["nextn"])
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    model.eval()
    spec = sweep_spec(c, kw, seed)
    rng = np.random.default_rng(seed)
    if c["opts"]["init"] == "random":
        tm.fill_random_weights(model, spec, rng)
    return model, spec, rng


def _random_tensor_for_empty_ok(name, shape, spec, rng):
    """tiny_models.random_tensor_for, but zero-element parameters (n_shared_experts = 0) stay empty."""
    import numpy as np

    if 0 in shape:
        return np.zeros(shape)
    if name.endswith(".bias") and ".self_attn." in name and "k_norm" not in name:  # attention_bias
        return 0.1 * rng.standard_normal(shape)
    return _RANDOM_TENSOR_FOR(name, shape, spec, rng)


def _install_empty_ok():
    global _RANDOM_TENSOR_FOR
    import tiny_models as tm

    if tm.random_tensor_for is not _random_tensor_for_empty_ok:
        _RANDOM_TENSOR_FOR = tm.random_tensor_for
        tm.random_tensor_for = _random_tensor_for_empty_ok


_RANDOM_TENSOR_FOR = None


def sweep_spec(c: dict, kw: dict, seed: int):
    """A tiny_models.ModelSpec carrying what its helpers read (weights, MTP tensors, save_hf)."""
    import tiny_models as tm

    base = tm.MODEL_SPECS[0] if c["arch"] == "glm_moe_dsa" else tm.MODEL_SPECS[1]
    return dataclasses.replace(base, name="sweep", seed=seed, hidden=kw["hidden_size"],
                               layers=kw["num_hidden_layers"], nextn=c["opts"]["nextn"], f16_exact=False)


def mtp_tensors(model, spec, rng) -> dict:
    """Random NextN block tensors for every MTP layer (tiny_models.mtp_extra_tensors, renumbered)."""
    import tiny_models as tm

    out = {}
    n = spec.layers
    for j in range(spec.nextn):
        one = tm.mtp_extra_tensors(model, spec, rng)
        for k, v in one.items():
            out[k.replace(f"model.layers.{n}.", f"model.layers.{n + j}.", 1)] = v
    return out


def add_placeholders(model) -> None:
    """Modules golden.py hooks on that a config without q_lora lacks (they never run)."""
    from torch import nn

    for layer in model.model.layers:
        a = layer.self_attn
        if getattr(a, "q_a_proj", 1) is None:
            a.q_a_proj, a.q_a_layernorm, a.q_b_proj = nn.Identity(), nn.Identity(), a.q_proj


def hf_view(model, name: str):
    """quant_oracle.hf_view plus the names it does not know (plain attn_q)."""
    import re

    import quant_oracle as qo

    m = re.fullmatch(r"blk\.(\d+)\.ffn_gate_up_exps\.weight", name)
    if m:  # --fuse-gate-up-exps: [E, 2I, H], gate rows first, as transformers' gate_up_proj
        return model.model.layers[int(m.group(1))].mlp.experts.gate_up_proj.data
    m = re.fullmatch(r"blk\.(\d+)\.attn_q\.weight", name)
    if m:
        return model.model.layers[int(m.group(1))].self_attn.q_proj.weight.data
    m = re.fullmatch(r"blk\.(\d+)\.(attn_q_a|attn_kv_a_mqa|attn_output)\.bias", name)
    if m:  # attention_bias = true
        mod = {"attn_q_a": "q_a_proj", "attn_kv_a_mqa": "kv_a_proj_with_mqa", "attn_output": "o_proj"}[m.group(2)]
        return getattr(model.model.layers[int(m.group(1))].self_attn, mod).bias.data
    return qo.hf_view(model, name)


def load_gguf_weights(model, tensors: dict, n_layers: int, check_equal: bool) -> list[str]:
    """Write every trunk GGUF tensor into `model`; returns names whose values changed (f32 check)."""
    import numpy as np
    import torch

    changed = []
    for name, vals in tensors.items():
        m = name.split(".")
        if m[0] == "blk" and int(m[1]) >= n_layers:
            continue  # MTP block: not part of the transformers model
        view = hf_view(model, name)
        if tuple(view.shape) != tuple(vals.shape):
            raise RuntimeError(f"{name}: transformers {tuple(view.shape)} vs gguf {vals.shape}")
        if check_equal and not np.array_equal(view.detach().cpu().double().numpy(), vals):
            changed.append(name)
        with torch.no_grad():
            view.copy_(torch.from_numpy(np.ascontiguousarray(vals)).to(view.dtype))
    return changed


def load_gguf_tensors(path: Path) -> dict:
    """spec_forward.load_gguf's float64 tensors; big-endian F32/F16 files (--bigendian) read natively
    (gguf-py's dequantize reinterprets their bytes as little-endian)."""
    import numpy as np
    import spec_forward as sf
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    if r.byte_order != "S":
        return sf.load_gguf(path)[1]
    out = {}
    for t in r.tensors:
        if t.tensor_type.name not in ("F32", "F16"):
            raise RuntimeError(f"{path.name}: big-endian {t.tensor_type.name} tensor {t.name}")
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = np.asarray(t.data).astype(np.float64).reshape(shape)
    return out


def golden_run(model, arch: str, ids: list[int]):
    import golden

    rec = golden.golden_trace(model, arch, ids)
    return rec


def routing_margin(rec) -> float:
    m = rec.margins
    vals = list(m["moe"]) + list(m["moe_group"])
    return min(vals) if vals else math.inf


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------

def hook_order(name: str) -> tuple:
    if name == "token_embd":
        return (-1, 0)
    if name in ("result_norm", "logits"):
        return (1 << 20, 0 if name == "result_norm" else 1)
    _, L, p = name.split(".", 2)
    return (int(L), POINTS.index(p) if p in POINTS else 99)


def rel_l2(mine, gold) -> float:
    import numpy as np

    g = gold.astype(np.float64)
    m = mine.astype(np.float64)
    fin = np.isfinite(g)
    if not np.array_equal(np.isfinite(m), fin) or not np.array_equal(m[~fin], g[~fin]):
        return math.inf
    d = np.linalg.norm(m[fin] - g[fin])
    n = np.linalg.norm(g[fin])
    return float(d / n) if n > 0 else float(d)


def row_sets(a) -> list:
    return [tuple(sorted(int(x) for x in r if x >= 0)) for r in a.reshape(a.shape[0], -1)]


def weights_by_id(ids, w):
    """moe_weights reordered by ascending expert id per row (selection order may tie)."""
    import numpy as np

    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(w, order, axis=1)


def indexer_tie(rec, layer: int, golden_sel, mine_sel) -> bool:
    """Whether the differing indexer rows of `layer` had a golden margin below TIE_INDEXER_REL."""
    margins = {(L, t): rel for (_, rel, L, t) in rec.margins["indexer"]}
    bad = [t for t, (a, b) in enumerate(zip(row_sets(golden_sel), row_sets(mine_sel))) if a != b]
    return all(margins.get((layer, t), math.inf) < TIE_INDEXER_REL for t in bad)


def moe_tie(gold: dict, bias, n_group: int, topk_group: int, layer: int, golden_ids, mine_ids) -> bool:
    """Whether every token whose expert set differs had a golden decision margin below TIE_MOE.

    Margins on the biased scores sigmoid(logit) + exp_probs_b: k-th vs (k+1)-th allowed expert, and
    the kept vs first dropped group (group score = sum of the group's two best).
    """
    import numpy as np

    sc = gold[f"blk.{layer}.moe_probs"] + (0.0 if bias is None else bias)
    k = golden_ids.shape[1]
    n_exp = sc.shape[1]
    per = n_exp // n_group
    for t, (a, b) in enumerate(zip(row_sets(golden_ids), row_sets(mine_ids))):
        if a == b:
            continue
        s = sc[t].copy()
        margins = []
        if topk_group < n_group:
            gs = np.sort(s.reshape(n_group, per), axis=1)[:, -min(2, per):].sum(1)
            order = np.argsort(-gs, kind="stable")
            margins.append(gs[order[topk_group - 1]] - gs[order[topk_group]])
            for g in order[topk_group:]:
                s[g * per:(g + 1) * per] = -np.inf
        srt = np.sort(s)[::-1]
        if k < n_exp and np.isfinite(srt[k]):
            margins.append(srt[k - 1] - srt[k])
        if not margins or min(margins) >= TIE_MOE:
            return False
    return True


def compare(gold: dict, mine: dict, rec, tensors: dict, n_group: int, topk_group: int) -> dict:
    import numpy as np

    missing = sorted(set(gold) - set(mine), key=hook_order)
    extra = sorted(set(mine) - set(gold), key=hook_order)
    conventions = []
    # No shared expert: transformers still has a zero-width shared MLP (output zeros); glmdiff has
    # no ffn_shexp step. Accepted when the golden hook is exactly zero.
    for name in [n for n in missing if n.endswith(".ffn_shexp")]:
        if not gold[name].any():
            missing.remove(name)
            conventions.append(f"{name} absent (golden: zeros, no shared expert)")
    # Shared DSA layers (indexer_types 'shared'): glmdiff names the reused selection
    # blk.L.indexer_topk; transformers has no indexer there. It must equal the source layer's.
    for name in [n for n in extra if n.endswith(".indexer_topk")]:
        L = int(name.split(".")[1])
        src = [f"blk.{j}.indexer_topk" for j in range(L - 1, -1, -1) if f"blk.{j}.indexer_topk" in gold]
        if src and tuple(mine[name].shape) == tuple(gold[src[0]].shape) and \
                row_sets(mine[name]) == row_sets(gold[src[0]]):
            extra.remove(name)
            conventions.append(f"{name} = {src[0]} (shared layer)")
    worst = ("", 0.0)
    first_bad = None
    tie_at = None
    for name in sorted(set(gold) & set(mine), key=hook_order):
        g, m = gold[name], mine[name]
        if tuple(g.shape) != tuple(m.shape):
            r = math.inf
            bad = True
        elif name.endswith(SELECTIONS):
            bad = row_sets(g) != row_sets(m)
            r = 0.0
            if bad and tie_at is None:
                L = int(name.split(".")[1])
                is_tie = (indexer_tie(rec, L, g, m) if name.endswith("indexer_topk")
                          else moe_tie(gold, tensors.get(f"blk.{L}.exp_probs_b.bias"), n_group, topk_group,
                                       L, g, m))
                if is_tie:
                    tie_at = name
        else:
            if name.endswith("moe_weights") and name.replace("moe_weights", "moe_topk_ids") in gold:
                gi = gold[name.replace("moe_weights", "moe_topk_ids")]
                mi = mine[name.replace("moe_weights", "moe_topk_ids")]
                g, m = weights_by_id(gi, g), weights_by_id(mi, m)
            r = rel_l2(m, g)
            bad = not r <= MAX_REL_L2
            if r > worst[1] or (math.isinf(r) and not math.isinf(worst[1])):
                if tie_at is None:
                    worst = (name, r)
        if bad and first_bad is None:
            first_bad = (name, r)
    top1 = None
    if "logits" in gold and "logits" in mine and gold["logits"].shape == mine["logits"].shape:
        ga, ma = gold["logits"].argmax(-1), mine["logits"].argmax(-1)
        top1 = int((ga != ma).sum())
        if top1:
            srt = np.sort(gold["logits"], axis=-1)
            gaps = srt[:, -1] - srt[:, -2]
            scale = np.abs(gold["logits"]).max()
            if all(gaps[i] < 1e-5 * scale for i in np.nonzero(ga != ma)[0]):
                top1 = 0 if tie_at is None else top1
                tie_at = tie_at or "logits top-1"
    if missing or extra:
        status = "FAIL"
    elif tie_at is not None and (first_bad is None or hook_order(first_bad[0]) >= hook_order(tie_at.split()[0])):
        status = "TIE"
    elif first_bad is not None or top1:
        status = "FAIL"
    else:
        status = "PASS"
    return {"status": status, "worst": worst, "first_bad": first_bad, "missing": missing, "extra": extra,
            "top1_mismatches": top1, "tie_at": tie_at, "conventions": conventions}


#: Naive-oracle logits differences above this are reported (what a checker without golden.py's
#: float64 patches would see).
NAIVE_NOTE = 1e-6


def naive_oracle_check(model, ids: list[int], trace: Path) -> list[str]:
    """glmdiff's logits vs transformers run in float64 without golden.py's patches: as built (q_a/kv_a
    norms with eps 1e-6, float32 RMSNorm / RoPE / router / indexer inside), and with only the eps
    fixed (golden.plain_transformers_logits)."""
    import golden
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    mine = load_file(str(trace))["logits"].astype(np.float64)
    naive = copy.deepcopy(model).double()
    with torch.no_grad():
        raw = naive(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    fixed = golden.plain_transformers_logits(copy.deepcopy(model), ids)
    r_raw, r_fixed = rel_l2(mine, raw), rel_l2(mine, fixed)
    if max(r_raw, r_fixed) <= NAIVE_NOTE:
        return []
    return [f"vs unpatched transformers f64: logits rel {r_raw:.1e} (as built), {r_fixed:.1e} (mla norm eps fixed)"]


PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. 12345"


def prompt_check(glmdiff: Path, gguf: Path, tok, out: Path) -> list[str]:
    """`glmdiff trace --prompt` ids vs the transformers tokenizer (default call and no specials)."""
    from safetensors import safe_open

    cmd = [str(glmdiff), "trace", str(gguf), "--prompt", PROMPT_TEXT, "--hook", "token_embd", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return [f"--prompt failed: {(res.stderr.strip() or '?').splitlines()[-1][:200]}"]
    with safe_open(str(out), "np") as f:
        ids = json.loads(f.metadata()["tokens"])
    hf_default = tok(PROMPT_TEXT)["input_ids"]
    hf_plain = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    if ids == hf_default:
        return []
    if ids[1:] == hf_default and ids[:1] == [tok.bos_token_id]:
        return [f"--prompt adds BOS {ids[0]} (GGUF add_bos_token), tokenizer(text) does not"]
    what = "= ids without specials" if ids == hf_plain else f"differ ({ids[:6]}.. vs {hf_default[:6]}..)"
    return [f"--prompt ids {what}"]


def run_glmdiff(glmdiff: Path, gguf: Path, ids: list[int], out: Path) -> tuple[dict | None, str]:
    from safetensors.numpy import load_file

    cmd = [str(glmdiff), "trace", str(gguf), "--tokens", ",".join(map(str, ids)), "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        msg = (res.stderr.strip() or res.stdout.strip())[-600:]
        if res.returncode == 2 and "panicked" not in res.stderr:
            return None, "REFUSED " + msg
        return None, f"exit {res.returncode} " + msg
    return load_file(str(out)), ""


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

#: Converter options of a variant `OUTTYPE+flag+...`.
VARIANT_FLAGS = {
    "split": ["--split-max-tensors", "16"],  # shards NAME-0000K-of-0000N.gguf
    "fused": ["--fuse-gate-up-exps"],  # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    "be": ["--bigendian"],
    "nomtp": ["--no-mtp"],  # GLM: drop the NextN block
    "mtp": ["--mtp"],  # GLM: the NextN block only (a draft-model file; not runnable as the trunk)
}


def variants_for(i: int, c: dict) -> list[str]:
    if c["opts"].get("variants"):
        return c["opts"]["variants"]
    # (--fuse-gate-up-exps is not offered: this converter has no FFN_GATE_UP_EXP for deepseek2 / glm-dsa)
    extra = [["f16"], ["bf16"], ["q8_0"], ["f32+be"], ["f16", "q8_0"], ["bf16+split"]][i % 6]
    if c["opts"]["init"] != "random":
        extra = ["q8_0"]
    if c["arch"] == "glm_moe_dsa" and c["opts"]["nextn"] and i % 2 == 0:
        extra = extra + ["f32+nomtp", "f32+mtp"]
    return ["f32"] + extra


def prompts_for(c: dict, vocab: int, rng: random.Random) -> dict[str, list[int]]:
    k = c["kw"].get("index_topk", 2048)
    short = rng.choice([1, 2, 3, 5])
    long_n = min(max(k + rng.randint(1, 8), 12), 28) if c["arch"] == "glm_moe_dsa" else rng.randint(9, 24)
    return {"short": [rng.randrange(vocab) for _ in range(short)],
            "long": [rng.randrange(vocab) for _ in range(long_n)]}


def run_config(ci: int, c: dict, tok, conv: Converter, glmdiff: Path, seed: int, keep: bool) -> list[dict]:
    import torch
    import tiny_models as tm

    arch = c["arch"]
    pre = {"glm_moe_dsa": "glm4", "deepseek_v3": "deepseek-v3"}[arch]
    name = f"c{ci:02d}-{'glm' if arch == 'glm_moe_dsa' else 'ds'}"
    d = WORK / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    rows = []
    prng = random.Random(seed * 7919 + ci)

    def row(variant, status, worst="", rel=None, note=""):
        return {"config": name, "summary": summary(c), "variant": variant, "status": status,
                "worst_hook": worst, "worst_rel": rel, "note": note}

    # 1. model, with redraws while a routing margin is below float32 resolution
    try:
        for attempt in range(MAX_REDRAWS):
            model, spec, nrng = build_model(c, tok, seed + 1000 * attempt)
            vocab = model.config.vocab_size
            prompts = prompts_for(c, vocab, prng)
            add_placeholders(model)
            probe = copy.deepcopy(model)
            margin = min(routing_margin(golden_run(probe, arch, ids)) for ids in prompts.values())
            if margin >= TIE_MOE:
                break
        c["margin"], c["redraws"] = margin, attempt
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)[-1]
        note = f"oracle: {type(e).__name__}: {e} at {Path(tb.filename).name}:{tb.lineno}"[:300]
        if "model" in locals():  # no golden, but what does glmdiff make of the converted file?
            note += "; " + glmdiff_without_oracle(c, model, tok, spec, nrng, d, conv, glmdiff, pre, name)
        return [row("-", "HF", note=note)]

    # 2. save and convert
    hf_dir = d / "hf"
    save_model = copy.deepcopy(model)
    for layer in save_model.model.layers:  # placeholders must not be saved
        a = layer.self_attn
        if isinstance(getattr(a, "q_a_proj", None), torch.nn.Identity):
            a.q_a_proj = a.q_a_layernorm = a.q_b_proj = None
    extra = mtp_tensors(save_model, spec, nrng) if c["opts"]["nextn"] and c["opts"].get("mtp_tensors", True) \
        else None
    tm.save_hf(save_model, tok, spec, hf_dir, extra)
    cfg_path = hf_dir / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    if not c["opts"]["scoring_func"]:
        cfg_json.pop("scoring_func", None)
        cfg_json.pop("topk_method", None)
    if c["opts"]["nextn"] == 0 and arch == "deepseek_v3":
        cfg_json.pop("num_nextn_predict_layers", None)
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True))
    n_layers = c["kw"]["num_hidden_layers"]
    for vi, variant in enumerate(variants_for(ci, c)):
        gguf = d / f"{name}-{variant}.gguf"
        outtype, *flags = variant.split("+")
        split = "split" in flags
        err = conv.convert(pre, hf_dir, outtype, gguf, [a for f in flags for a in VARIANT_FLAGS[f]])
        if err:
            rows.append(row(variant, "CONV", note=err.strip().splitlines()[-1][:300]))
            continue
        # 3. weights as stored
        if split:
            shards = sorted(d.glob(f"{name}-{variant}-*-of-*.gguf".replace("+", "?")))
            gguf = shards[0]
            tensors = {}
            for sh in shards:
                tensors.update(load_gguf_tensors(sh))
        else:
            tensors = load_gguf_tensors(gguf)
        m = copy.deepcopy(model)
        try:
            changed = load_gguf_weights(m, tensors, n_layers, check_equal=(variant == "f32"))
        except Exception as e:  # noqa: BLE001
            rows.append(row(variant, "ORACLE", note=f"gguf -> transformers: {e}"[:300]))
            continue
        if changed:
            rows.append(row(variant, "LAYOUT", note=f"f32 GGUF differs from transformers at {changed[:3]}"))
            continue
        # 4. golden vs glmdiff, per prompt
        worst_all, status_all, notes = ("", 0.0), "PASS", []
        if vi == 0 and attempt:
            notes.append(f"weights redrawn {attempt}x: routing margin below {TIE_MOE:g} (min now {margin:.1e})")
        ties = 0
        for pname, ids in prompts.items():
            rec = golden_run(m, arch, ids)
            ties += sum(1 for gap, *_ in rec.margins["indexer"] if gap == 0)
            out = d / f"{variant}.{pname}.trace.safetensors"
            mine, err = run_glmdiff(glmdiff, gguf, ids, out)
            if mine is None:
                status_all = "REFUSED" if err.startswith("REFUSED") else "ERR"
                notes.append(f"{pname}: {err.removeprefix('REFUSED ').splitlines()[-1] if err else '?'}")
                break
            res = compare(rec.t, mine, rec, tensors, m.config.n_group or 1, m.config.topk_group or 1)
            if res["worst"][1] >= worst_all[1]:
                worst_all = res["worst"]
            if RANK[res["status"]] > RANK[status_all]:
                status_all = res["status"]
            for cv in res["conventions"]:
                if cv.split()[0].split(".", 2)[-1] not in " ".join(notes):
                    notes.append("hook convention: " + cv)
            if res["status"] != "PASS":
                bits = [f"{pname}(T={len(ids)})"]
                if res["missing"]:
                    bits.append(f"missing {res['missing'][:4]}")
                if res["extra"]:
                    bits.append(f"extra {res['extra'][:4]}")
                if res["first_bad"]:
                    bits.append(f"first bad {res['first_bad'][0]} {res['first_bad'][1]:.2e}")
                if res["tie_at"]:
                    bits.append(f"tie at {res['tie_at']}")
                if res["top1_mismatches"]:
                    bits.append(f"top1 x{res['top1_mismatches']}")
                notes.append(" ".join(bits))
        if variant == "f32":
            notes += prompt_check(glmdiff, gguf, tok, d / "prompt.trace.safetensors")
            if mine is not None:
                notes += naive_oracle_check(model, prompts["long"], d / "f32.long.trace.safetensors")
            if ties:
                notes.append(f"indexer: {ties} selections decided by exactly equal scores (ReLU zeros; "
                             "lower position wins here and in glmdiff, torch.topk's order is arbitrary)")
        rows.append(row(variant, status_all, worst_all[0], worst_all[1], "; ".join(notes)))
        if not keep:
            for f in d.glob(f"{name}-{variant}*.gguf"):
                f.unlink()
    if not keep:
        shutil.rmtree(hf_dir, ignore_errors=True)
    return rows


def glmdiff_without_oracle(c, model, tok, spec, nrng, d, conv, glmdiff, pre, name) -> str:
    """Convert to f32 and run glmdiff once: a clear refusal is what an unsupported config should get."""
    import tiny_models as tm

    hf_dir = d / "hf"
    try:
        tm.save_hf(copy.deepcopy(model), tok, spec, hf_dir)
    except Exception as e:  # noqa: BLE001
        return f"save failed: {e}"[:200]
    gguf = d / f"{name}-f32.gguf"
    err = conv.convert(pre, hf_dir, "f32", gguf)
    if err:
        return "converter: " + err.strip().splitlines()[-1][:200]
    mine, err = run_glmdiff(glmdiff, gguf, [1, 2, 3], d / "noref.trace.safetensors")
    if mine is None:
        return "glmdiff " + err.replace(str(gguf), "FILE")[:300]
    return "glmdiff runs it without complaint"


def print_table(rows: list[dict]) -> None:
    print()
    print(f"{'cfg':7} {'variant':6} {'status':6} {'worst hook':24} {'rel L2':>9}  config / notes")
    for r in rows:
        rel = "" if r["worst_rel"] is None else f"{r['worst_rel']:.2e}"
        print(f"{r['config']:7} {r['variant']:6} {r['status']:6} {r['worst_hook'][:24]:24} {rel:>9}  {r['summary']}")
        if r["note"]:
            print(f"{'':22}-> {r['note']}")
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--converter-worker", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=6, help="random configs per architecture")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=["ds", "glm", "default", "special"], action="append")
    ap.add_argument("--configs", help="comma-separated config indices to run (after generation)")
    ap.add_argument("--glmdiff", default=str(REPO / "target" / "release" / "glmdiff"))
    ap.add_argument("--llama-cpp", help="llama.cpp source root (default: the one make_model_fixtures uses)")
    ap.add_argument("--keep", action="store_true", help="keep HF dirs and GGUFs under reference/work/sweep")
    args = ap.parse_args()
    if args.converter_worker:
        converter_worker(args.converter_worker)
        return

    sys.path[:0] = [str(HERE.parent / "fixtures"), str(HERE.parent / "oracles")]
    import make_model_fixtures as mmf
    import tiny_models as tm

    _install_empty_ok()
    llama = mmf.find_or_fetch_llama_cpp(args.llama_cpp)
    glmdiff = Path(args.glmdiff)
    if not glmdiff.exists():
        raise SystemExit(f"no glmdiff binary at {glmdiff} (cargo build --release)")
    WORK.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    configs = []
    for arch, tag in (("deepseek_v3", "ds"), ("glm_moe_dsa", "glm")):
        for i in range(args.n):
            c = random_config(arch, rng, i)
            if not args.only or tag in args.only:
                configs.append(c)
    if not args.only or "default" in args.only:
        configs += default_configs()
    if not args.only or "special" in args.only:
        configs += special_configs()
    toks = {arch: tm.build_tokenizer(spec) for arch, spec in
            (("glm_moe_dsa", tm.MODEL_SPECS[0]), ("deepseek_v3", tm.MODEL_SPECS[1]))}
    conv = Converter(llama, WORK / "converter.log")
    rows = []
    pick = None if not args.configs else {int(x) for x in args.configs.split(",")}
    t0 = time.time()
    try:
        for ci, c in enumerate(configs):
            if pick is not None and ci not in pick:
                continue
            print(f"[{time.time() - t0:6.1f}s] c{ci:02d} {summary(c)}", flush=True)
            r = run_config(ci, c, toks[c["arch"]], conv, glmdiff, args.seed * 100003 + ci, args.keep)
            for x in r:
                print(f"    {x['variant']:5} {x['status']:5} {x['worst_hook']} "
                      f"{'' if x['worst_rel'] is None else format(x['worst_rel'], '.2e')} {x['note']}", flush=True)
            rows += r
    finally:
        conv.close()
    (WORK / "results.json").write_text(json.dumps({"rows": rows, "configs": configs}, indent=1, default=str))
    print_table(rows)
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
