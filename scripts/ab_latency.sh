#!/usr/bin/env bash
# A/B on the GPU machine (device tool): the latency bench of the wheels in .whl-old (a baseline
# commit, built with `pip wheel --no-deps -w .whl-old . plugins/qwen contrib_models/llama` in a
# worktree of it) against .whl (this tree), interleaved ROUNDS times so drift hits both alike.
# Extra arguments go to `mrv2 bench latency`. JSON results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
for side in old new; do
  wheels=(.whl/*.whl)  # the baseline takes its own mrv2 wheels and the shared dependencies
  [ "$side" = old ] && wheels=(.whl-old/*.whl $(ls .whl/*.whl | grep -v "/mrv2"))
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "/tmp/site-$side" "${wheels[@]}" || exit 1
done
export MRV2_TEST_GPU=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    PYTHONPATH=/tmp/site-$side python3 -m mrv2.entrypoints.cli bench latency \
      --json "$OUT/latency_${side}_$round.json" "$@" > "$OUT/latency_${side}_$round.log" 2>&1
    python3 - "$OUT/latency_${side}_$round.json" "$side" "$round" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["default"]
print(sys.argv[2], sys.argv[3], "  ".join(
    f"b{r['batch']}: tpot {r['tpot_ms']} gpu {r.get('gpu_step_ms')} host {r.get('host_execute_ms')}"
    for r in rows))
PY
  done
done
