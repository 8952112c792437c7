#!/usr/bin/env bash
# Sets everything up (if needed) and runs the whole CPU test suite; extra arguments go to pytest.
# Two worker processes (pytest-xdist, a module's tests on one worker): the suite is mostly
# single-threaded interpreted kernels and subprocess ranks, so the CI machine's two cores halve
# its time. MRV2_TEST_WORKERS sets the count (0: one process); GPU runs (`-m gpu`,
# MRV2_TEST_GPU=1) default to one process, their tests sharing one device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh 2> >(grep -v "^WARNING: Location" >&2)
export OMP_NUM_THREADS=1
workers=${MRV2_TEST_WORKERS:-2}
case " $* " in *" -m gpu "*|*" -mgpu "*) workers=${MRV2_TEST_WORKERS:-0} ;; esac
[ -n "${MRV2_TEST_GPU:-}" ] && workers=${MRV2_TEST_WORKERS:-0}
# (the 25 slowest tests listed last: where the suite's minutes go, as families join)
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadscope --durations=25 "$@"
