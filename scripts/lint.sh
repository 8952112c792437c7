#!/usr/bin/env bash
# ruff and mypy over the core, the kernels and the bundled plugins (what CI checks after the
# tests). Run scripts/setup.sh first (scripts/test.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[lint] ruff"
.venv/bin/ruff check framework kernels plugins contrib_models tests examples scripts
echo "[lint] mypy (files: see [tool.mypy] in pyproject.toml)"
.venv/bin/mypy
