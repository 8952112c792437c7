#!/usr/bin/env bash
# Sets everything up, converts the bundled SmolLM2-135M-Instruct once, and asks it a question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh 2> >(grep -v "^WARNING: Location" >&2)
exec .venv/bin/mrv2 generate "${@:-What is the capital of France?}"
