"""Tiny random GLM-5 (`glm_moe_dsa`) and DeepSeek-V3 (`deepseek_v3`) models for fixtures.

Everything here is deterministic given the seeds in `MODEL_SPECS`: the byte-level BPE tokenizers,
the transformers configs and the random weights.

Sources followed (read, not copied):
- transformers `models/glm_moe_dsa/{configuration,modeling}_glm_moe_dsa.py` and
  `models/deepseek_v3/{configuration,modeling}_deepseek_v3.py` (parameter names and shapes).
- llama.cpp `src/llama-vocab.cpp` (pre-tokenizer regexes of `LLAMA_VOCAB_PRE_TYPE_CHATGLM4`, used for
  `glm4`, and `LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM`, used for `deepseek-v3`; `llama_vocab::impl::load`
  sets `ignore_merges` for neither, only for the llama3 names).
- llama.cpp `conversion/base.py` `_set_vocab_glm` (the GLM converter looks up the added tokens
  `[gMASK]`, `<|user|>`, `<|endoftext|>`, `<|observation|>`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, exactly as in llama.cpp src/llama-vocab.cpp (C string escapes resolved).
# ---------------------------------------------------------------------------------------------

#: LLAMA_VOCAB_PRE_TYPE_CHATGLM4 (tokenizer.ggml.pre "glm4"): one regex.
GLM4_PRE_REGEXES = [
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]

#: LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM (tokenizer.ggml.pre "deepseek-v3"): three regexes applied in turn.
DEEPSEEK3_PRE_REGEXES = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n" + r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[""" + "\r\n" + r"""]*|\s*[""" + "\r\n" + r"""]+|\s+(?!\S)|\s+""",
]

#: Added tokens. GLM: names the llama.cpp GLM vocab code requires (ids after the BPE vocab, as in
#: the real GLM tokenizer). DeepSeek-V3: its BOS/EOS names (fullwidth bars, U+2581).
GLM_SPECIAL_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
]
DEEPSEEK_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
DEEPSEEK_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
DEEPSEEK_SPECIAL_TOKENS = [DEEPSEEK_BOS, DEEPSEEK_EOS]

#: Training text for the tiny BPE (built in, so the tokenizer is reproducible offline).
TRAIN_TEXT = """
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
A mixture of experts routes every token to a few experts, and the shared expert sees them all.
Attention compresses keys and values into a latent vector, then the indexer keeps the top tokens.
In 2025 the model read 12345 tokens, 678 lines and 90 pages: it's there, they're here, we'll see.
Numbers like 3.14159, 2.71828 and 1e-5 appear in configs; so do tabs\tand new
lines.
def main():
    return sum(x * x for x in range(10))
Caf\u00e9 na\u00efve \u00fcber stra\u00dfe \u2014 \u00bfqu\u00e9 tal? \u4f60\u597d\u4e16\u754c \u3053\u3093\u306b\u3061\u306f \U0001f642
the the the of of and and to to in in is is it it that that with with for for on on
"""


@dataclass
class ModelSpec:
    """One tiny model: architecture, dimensions, seeds, prompt texts and GGUF variants."""

    name: str
    arch: str  # "glm_moe_dsa" or "deepseek_v3"
    seed: int
    hidden: int
    layers: int
    dense_layers: int
    nextn: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    experts: int
    experts_per_tok: int
    shared: int
    moe_inter: int
    dense_inter: int
    n_group: int
    topk_group: int
    rms_eps: float
    tok_vocab: int  # BPE vocab size (bytes + merges), before added tokens
    vocab: int  # model vocab_size (>= tokenizer size; the rest are [PADn] in the GGUF)
    index_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 8
    rope_theta: float = 10000.0
    yarn: dict | None = None
    f16_exact: bool = True  # round every weight to f16 so F32 and F16 GGUFs hold one function
    quantized: bool = False  # build the mixed-quant GGUF instead of F32/F16
    prompts: dict = field(default_factory=dict)  # name -> text


GLM_PROMPTS = {
    "short": "the fox and the dog",
    "long": "The quick brown fox jumps over the lazy dog. 12345",
}
DS_PROMPTS = dict(GLM_PROMPTS)
QUANT_LONG_PROMPT = "The shared expert sees every token."

MODEL_SPECS = [
    ModelSpec(
        name="glm5-tiny", arch="glm_moe_dsa", seed=5110, hidden=64, layers=3, dense_layers=1, nextn=1,
        heads=4, q_lora=24, kv_lora=40, qk_nope=32, qk_rope=16, v_head=24, experts=8, experts_per_tok=2,
        shared=1, moe_inter=16, dense_inter=96, n_group=1, topk_group=1, rms_eps=1e-5,
        tok_vocab=448, vocab=464, rope_theta=1.0e6, prompts=GLM_PROMPTS,
    ),
    ModelSpec(
        name="dsv3-tiny", arch="deepseek_v3", seed=3106, hidden=64, layers=3, dense_layers=1, nextn=0,
        heads=4, q_lora=24, kv_lora=40, qk_nope=32, qk_rope=16, v_head=24, experts=8, experts_per_tok=2,
        shared=1, moe_inter=16, dense_inter=96, n_group=4, topk_group=2, rms_eps=1e-6,
        tok_vocab=448, vocab=450, rope_theta=10000.0,
        yarn={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        prompts=DS_PROMPTS,
    ),
    ModelSpec(
        name="glm5-tiny-q", arch="glm_moe_dsa", seed=5224, hidden=256, layers=2, dense_layers=1, nextn=0,
        heads=4, q_lora=32, kv_lora=96, qk_nope=32, qk_rope=16, v_head=64, experts=8, experts_per_tok=2,
        shared=1, moe_inter=32, dense_inter=256, n_group=1, topk_group=1, rms_eps=1e-5,
        tok_vocab=448, vocab=464, rope_theta=1.0e6, f16_exact=False, quantized=True,
        prompts={"short": GLM_PROMPTS["short"], "long": QUANT_LONG_PROMPT},
    ),
    ModelSpec(
        name="dsv3-tiny-q", arch="deepseek_v3", seed=3211, hidden=256, layers=2, dense_layers=1, nextn=0,
        heads=4, q_lora=32, kv_lora=96, qk_nope=32, qk_rope=16, v_head=64, experts=8, experts_per_tok=2,
        shared=1, moe_inter=32, dense_inter=256, n_group=4, topk_group=2, rms_eps=1e-6,
        tok_vocab=448, vocab=450, rope_theta=10000.0, f16_exact=False, quantized=True,
        yarn={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        prompts={"short": DS_PROMPTS["short"], "long": QUANT_LONG_PROMPT},
    ),
]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def build_tokenizer(spec: ModelSpec):
    """Train a byte-level BPE whose pre-tokenizer matches llama.cpp's for this architecture.

    Returns a transformers `PreTrainedTokenizerFast`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    is_glm = spec.arch == "glm_moe_dsa"
    regexes = GLM4_PRE_REGEXES if is_glm else DEEPSEEK3_PRE_REGEXES
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.tok_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[], show_progress=False,
    )
    tok.train_from_iterator([TRAIN_TEXT] * 3, trainer=trainer)
    # ignore_merges (a whole pre-token found in the vocab is used as is) as llama.cpp sets it for
    # these pre-tokenizers: off for both "glm4" and "deepseek-v3" (llama_vocab::impl::load sets it
    # only for the llama3 names), so the HF tokenizer and llama.cpp give the same ids by
    # construction. GLM's own tokenizer.json is said to turn it on (ggml-org/llama.cpp#27754, open,
    # would follow); with this trained vocab it makes no difference, since every token is the
    # result of merging its own bytes.
    js = json.loads(tok.to_str())
    js["model"]["ignore_merges"] = False
    tok = Tokenizer.from_str(json.dumps(js))
    specials = GLM_SPECIAL_TOKENS if is_glm else DEEPSEEK_SPECIAL_TOKENS
    tok.add_special_tokens(specials)
    if is_glm:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
            unk_token=None, clean_up_tokenization_spaces=False,
        )
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=DEEPSEEK_BOS, eos_token=DEEPSEEK_EOS, pad_token=DEEPSEEK_EOS,
            clean_up_tokenization_spaces=False,
        )
    assert len(fast) <= spec.vocab, (len(fast), spec.vocab)
    return fast


TOKENIZER_TEST_TEXTS = [
    "Hello, world!",
    "the quick brown fox",
    "  two leading spaces and trailing   ",
    "numbers: 1 12 123 1234 12345 3.14159 1e-5",
    "punctuation!?... (a) [b] {c} <d> 'e' \"f\" a-b_c/d\\e",
    "it's they're we'll I'M YOU'RE",
    "line one\nline two\n\nline four\r\nwindows\ttab",
    "def main():\n    return sum(x * x for x in range(10))",
    "caf\u00e9 na\u00efve \u00fcber stra\u00dfe \u2014 \u00bfqu\u00e9 tal?",
    "\u4f60\u597d\u4e16\u754c \u3053\u3093\u306b\u3061\u306f \u30ab\u30bf\u30ab\u30ca",
    "emoji \U0001f642\U0001f680 and \u00e9\u0301 combining",
    "MixedCASE wordsWithCaps ALLCAPS",
    "",
]


def tokenizer_pairs(tok) -> list[dict]:
    """(text, ids) pairs from the HF tokenizer, without added BOS/EOS."""
    out = []
    for text in TOKENIZER_TEST_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, (text, tok.decode(ids))
        out.append({"text": text, "ids": ids})
    return out


# ---------------------------------------------------------------------------------------------
# Config and weights
# ---------------------------------------------------------------------------------------------

def make_config(spec: ModelSpec, tok):
    """A transformers config for the spec (eager attention and eager experts)."""
    common = dict(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.dense_inter,
        moe_intermediate_size=spec.moe_inter, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        n_shared_experts=spec.shared, n_routed_experts=spec.experts, num_experts_per_tok=spec.experts_per_tok,
        routed_scaling_factor=2.5, kv_lora_rank=spec.kv_lora, q_lora_rank=spec.q_lora,
        qk_rope_head_dim=spec.qk_rope, v_head_dim=spec.v_head, qk_nope_head_dim=spec.qk_nope,
        n_group=spec.n_group, topk_group=spec.topk_group, norm_topk_prob=True,
        first_k_dense_replace=spec.dense_layers, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=4096 if spec.yarn is None else 10240, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
        attention_bias=False,
    )
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.yarn is not None:
        rope = dict(spec.yarn, rope_theta=spec.rope_theta)
    if spec.arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig

        cfg = GlmMoeDsaConfig(
            **common, rope_parameters=rope, index_topk=spec.index_topk, index_head_dim=spec.index_head_dim,
            index_n_heads=spec.index_heads,
        )
    else:
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(**common, rope_parameters=rope, rope_interleave=True, num_mtp_layers=spec.nextn)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def make_model(spec: ModelSpec, cfg):
    """Instantiate the model (f32) and fill it with seeded random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    model.eval()
    rng = np.random.default_rng(spec.seed)
    fill_random_weights(model, spec, rng)
    return model


def _std(fan_in: int, gain: float) -> float:
    return gain / math.sqrt(fan_in)


def random_tensor_for(name: str, shape: tuple, spec: ModelSpec, rng: np.random.Generator) -> np.ndarray:
    """Seeded random values for one parameter, chosen so activations and decisions are well spread.

    Norm weights are 1 + noise, the indexer k_norm bias and the router correction bias are non-zero,
    projections are N(0, gain / sqrt(fan_in)).
    """
    n = rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * n
    if name.endswith("k_norm.bias"):
        return 0.2 * n
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.1 * n
    if name.endswith("embed_tokens.weight"):
        return 1.0 * n
    if name.endswith("lm_head.weight"):
        return n * _std(spec.hidden, 2.0)
    if name.endswith("gate.weight"):  # router
        return n * _std(spec.hidden, 1.5)
    if name.endswith("experts.gate_up_proj"):
        return n * _std(shape[-1], 1.0)
    if name.endswith("experts.down_proj"):
        return n * _std(shape[-1], 1.0)
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
        return n * _std(shape[-1], 1.0)
    if name.endswith("weights_proj.weight"):
        return n * _std(shape[-1], 1.0)
    if name.endswith(".weight") and len(shape) == 2:
        return n * _std(shape[-1], 0.8)
    raise ValueError(f"no init rule for {name} {shape}")


def fill_random_weights(model, spec: ModelSpec, rng: np.random.Generator) -> None:
    """Overwrite every parameter and persistent buffer in a fixed (sorted-name) order."""
    sd = model.state_dict()
    with torch.no_grad():
        for name in sorted(sd.keys()):
            t = sd[name]
            if not t.is_floating_point():
                continue
            vals = random_tensor_for(name, tuple(t.shape), spec, rng)
            if spec.f16_exact:
                vals = vals.astype(np.float16)
            t.copy_(torch.from_numpy(np.ascontiguousarray(vals.astype(np.float32))))


def mtp_extra_tensors(model, spec: ModelSpec, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Random HF tensors of the NextN/MTP block `model.layers.{L}` (L = num_hidden_layers).

    transformers builds no module for it, so these go straight into model.safetensors. The block is
    a full MoE decoder layer (copying the names of the last trunk layer) plus eh_proj, enorm, hnorm
    and shared_head.norm, as in the GLM checkpoints. (embed_tokens / shared_head.head are optional in
    llama.cpp and left out to keep the file small.)
    """
    last = spec.layers - 1
    mtp = spec.layers
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(sd.keys()):
        prefix = f"model.layers.{last}."
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        vals = random_tensor_for(name, tuple(sd[name].shape), spec, rng).astype(np.float16).astype(np.float32)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H], gate rows first -> per-expert files
            inter = vals.shape[1] // 2
            for e in range(vals.shape[0]):
                out[f"model.layers.{mtp}.mlp.experts.{e}.gate_proj.weight"] = torch.from_numpy(vals[e, :inter].copy())
                out[f"model.layers.{mtp}.mlp.experts.{e}.up_proj.weight"] = torch.from_numpy(vals[e, inter:].copy())
        elif rest == "mlp.experts.down_proj":  # [E, H, I]
            for e in range(vals.shape[0]):
                out[f"model.layers.{mtp}.mlp.experts.{e}.down_proj.weight"] = torch.from_numpy(vals[e].copy())
        else:
            out[f"model.layers.{mtp}.{rest}"] = torch.from_numpy(vals)
    h = spec.hidden
    extra = {
        "eh_proj.weight": rng.standard_normal((h, 2 * h)) * _std(2 * h, 0.8),
        "enorm.weight": 1.0 + 0.1 * rng.standard_normal(h),
        "hnorm.weight": 1.0 + 0.1 * rng.standard_normal(h),
        "shared_head.norm.weight": 1.0 + 0.1 * rng.standard_normal(h),
    }
    for k, v in extra.items():
        out[f"model.layers.{mtp}.{k}"] = torch.from_numpy(v.astype(np.float16).astype(np.float32))
    return out


def save_hf(model, tok, spec: ModelSpec, out_dir: Path, extra_tensors: dict | None = None) -> None:
    """save_pretrained + tokenizer, then add what the real checkpoints carry and transformers drops.

    config.json gets `scoring_func`/`topk_method` (transformers 5 does not write them and the
    llama.cpp converter writes the gating function only when present) and
    `num_nextn_predict_layers`; the MTP tensors are appended to model.safetensors.
    """
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["scoring_func"] = "sigmoid"
    cfg["topk_method"] = "noaux_tc"
    cfg["num_nextn_predict_layers"] = spec.nextn
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if extra_tensors:
        st = out_dir / "model.safetensors"
        tensors = load_file(st)
        tensors.update(extra_tensors)
        save_file(tensors, st, metadata={"format": "pt"})
    if spec.arch == "deepseek_v3":
        # DeepSeek-V3's tokenizer_config adds BOS; converters read it from there.
        tc_path = out_dir / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["add_bos_token"] = True
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True))
