"""Run llama.cpp's own `convert_hf_to_gguf.py` with its tokenizer-hash check answered.

Usage: python convert_runner.py LLAMA_CPP_DIR TOKENIZER_PRE [converter arguments...]

The converter identifies the pre-tokenizer by hashing the ids of a fixed text and rejects hashes
it does not know (our tiny tokenizers are unknown). This wrapper replaces
`TextModel.get_vocab_base_pre` (llama.cpp `conversion/base.py`) so that it returns TOKENIZER_PRE
("glm4" or "deepseek-v3"); everything else is the unmodified converter, imported from
LLAMA_CPP_DIR with its own `gguf-py` first on the path (as the converter itself does).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    llama_dir = Path(sys.argv[1]).resolve()
    tokpre = sys.argv[2]
    sys.path.insert(0, str(llama_dir))
    sys.path.insert(1, str(llama_dir / "gguf-py"))
    import convert_hf_to_gguf  # noqa: E402  (llama.cpp's script, imported as a module)

    try:
        from conversion.base import TextModel  # split-package converter
    except ImportError:  # single-file converter of older llama.cpp
        TextModel = convert_hf_to_gguf.TextModel

    def get_vocab_base_pre(self, tokenizer) -> str:  # noqa: ARG001
        return tokpre

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
