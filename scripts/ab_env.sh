#!/usr/bin/env bash
# A/B of one environment setting on the GPU machine (device tool), same wheels: `mrv2 bench
# BENCH` without and with VAR=VALUE, interleaved ROUNDS times (default 2) so drift hits both
# alike. Run scripts/gpu_session.sh first (it installs the wheels into /tmp/site).
# Usage: scripts/ab_env.sh VAR=VALUE latency|throughput [bench args...]; several settings
# together: "VAR1=V1 VAR2=V2" (one argument, space-separated)
# e.g.   scripts/ab_env.sh MRV2_PDL_EARLY_WEIGHTS=1 latency --model Qwen3-0.6B --batch-sizes 1 8
# JSON results go to $OUT; one line per run prints.
set -uo pipefail
OUT=${OUT:-/tmp/out}
setting=${1:?usage: ab_env.sh VAR=VALUE latency|throughput [args]}
bench=${2:?usage: ab_env.sh VAR=VALUE latency|throughput [args]}
shift 2
export PYTHONPATH=/tmp/site MRV2_TEST_GPU=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
model=""  # in the file names, so A/Bs of two models in one call keep both
prev=""
for arg in "$@"; do [ "$prev" = --model ] && model=$arg; prev=$arg; done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in off on; do
    json="$OUT/${bench}${model:+_$model}_${side}_$round.json"
    # a second A/B of the same bench and model in one call: numbered, not over the first
    n=1; while [ -e "$json" ]; do n=$((n + 1)); json="$OUT/${bench}${model:+_$model}_${side}_${round}_$n.json"; done
    setting_if_on=()
    [ "$side" = on ] && read -ra setting_if_on <<< "$setting"
    env "${setting_if_on[@]}" python3 -m mrv2.entrypoints.cli bench "$bench" --json "$json" "$@" \
      > "${json%.json}.log" 2>&1
    python3 "$(dirname "$0")/ab_summary.py" "$json" "$side" "$round"
  done
done
