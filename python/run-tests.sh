#!/usr/bin/env bash
# The pytest suite of the glmdiff_hooks package: its pure parts (hook names, shape checks, RoPE order,
# metadata, the model digest, the safetensors writer, the committed writer and digest fixtures). Needs numpy,
# safetensors, gguf and pytest (`pip install pytest numpy safetensors gguf`), not torch. The torch hooks are exercised on the GPU machine by
# reference/checks/hook_traces.py (transformers on every fixture model, each trace through `glmdiff run`).
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON:-python3}" -m pytest -q tests "$@"
