#!/usr/bin/env bash
# Sets everything up (if needed) and runs the whole CPU test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh 2> >(grep -v "^WARNING: Location" >&2)
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q "$@"
