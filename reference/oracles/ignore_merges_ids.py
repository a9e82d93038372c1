#!/usr/bin/env python3
"""Token ids for the `ignore_merges` test of tests/tokenizer.rs, from Hugging Face `tokenizers`.

  python3 reference/oracles/ignore_merges_ids.py     # needs only `pip install tokenizers` (0.23.3 used)

The vocabulary is the one `ignore_merges_vocab()` in tests/tokenizer.rs builds: the 256 GPT-2
byte characters in byte order (id = byte), then the merge results "bc" 256, "ab" 257, "Ġa" 258
(merges "b c", "a b", "Ġ a" in rank order), then "Ġabc" 259, a token that no merge sequence
reaches from the bytes of " abc". The text is tokenized with each pre-tokenizer glmdiff knows,
`ignore_merges` set as llama.cpp's `llama_vocab::impl::load` (ggml-org/llama.cpp
`src/llama-vocab.cpp`) sets it: true for the llama3 names, false for glm4, deepseek-v3, gpt-2 and
default. The regexes are llama.cpp's for each name (the same as src/tokenizer/pre.rs), each a
`Split(..., "isolated")`, followed by `ByteLevel(add_prefix_space=False, use_regex=False)`:
the settings of the GLM and DeepSeek `tokenizer.json` files.
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

TEXT = "abc abc ab"

LLAMA3 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n" + r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+["""
    + "\r\n" + r"""]*|\s*[""" + "\r\n" + r"""]+|\s+(?!\S)|\s+""",
]
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

#: name -> (regexes, ignore_merges as llama.cpp sets it for that tokenizer.ggml.pre)
PRE = {
    "glm4": ([LLAMA3], False),
    "deepseek-v3": (DEEPSEEK3, False),
    "llama3": ([LLAMA3], True),
    "gpt-2": ([GPT2], False),
    "default": (DEFAULT, False),
}


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> character table (openai/gpt-2 src/encoder.py), index = byte."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokens = bytes_to_unicode()
    merges = [("b", "c"), ("a", "b"), ("\u0120", "a")]
    tokens += [a + b for a, b in merges] + ["\u0120abc"]
    return {t: i for i, t in enumerate(tokens)}, merges


def encode(regexes: list[str], ignore_merges: bool) -> list[int]:
    vocab, merges = vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    return tok.encode(TEXT, add_special_tokens=False).ids


def main() -> None:
    out = {name: encode(regexes, ignore) for name, (regexes, ignore) in PRE.items()}
    # The same glm4 regex with the flag on: what a tokenizer.json with "ignore_merges": true gives.
    out["glm4, ignore_merges=True"] = encode([LLAMA3], True)
    print(f"text {json.dumps(TEXT)}")
    for name, ids in out.items():
        print(f"{name}: {ids}")


if __name__ == "__main__":
    main()
