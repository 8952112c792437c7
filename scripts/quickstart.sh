#!/usr/bin/env bash
# Sets everything up, converts the bundled SmolLM2-135M-Instruct once, and asks it a question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh 2> >(grep -v "^WARNING: Location" >&2)
if [ ! -d "${MRV2_CACHE_DIR:-$HOME/.cache/mrv2}/models/SmolLM2-135M-Instruct" ]; then
  echo "[quickstart] converting SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) to safetensors," \
    "once, into ${MRV2_CACHE_DIR:-~/.cache/mrv2}/models/"
fi
.venv/bin/mrv2 prepare-default-model >/dev/null
echo "[quickstart] asking SmolLM2-135M-Instruct on the CPU (mrv2 generate):"
exec .venv/bin/mrv2 generate "${@:-What is the capital of France?}"
