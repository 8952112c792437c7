#!/usr/bin/env bash
# A/B on the GPU machine (device tool): `mrv2 bench BENCH` (latency or throughput) of the wheels
# in .whl-old (a baseline commit, built with `pip wheel --no-deps -w .whl-old . plugins/qwen
# plugins/glm plugins/mtp plugins/eagle plugins/deepseek plugins/qwen_vl plugins/gemma plugins/phi plugins/olmo plugins/gpt_oss plugins/minimax plugins/exaone plugins/ernie plugins/mistral3 plugins/internvl plugins/llava plugins/idefics3 plugins/nemotron_h plugins/granite_hybrid plugins/falcon_h1 plugins/mamba plugins/llama4 plugins/hunyuan plugins/cohere plugins/lfm2 plugins/neox plugins/starcoder plugins/kimi plugins/step contrib_models/llama` in a worktree of it) against .whl (this tree), interleaved ROUNDS times so
# drift hits both alike. Usage: scripts/ab_bench.sh latency|throughput [bench args...].
# JSON results go to $OUT; one line per run prints.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bench=${1:?usage: ab_bench.sh latency|throughput [args]}
shift
for side in old new; do
  wheels=(.whl/*.whl)  # the baseline takes its own mrv2 wheels and the shared dependencies
  [ "$side" = old ] && wheels=(.whl-old/*.whl $(ls .whl/*.whl | grep -v "/mrv2"))
  [ -d "/tmp/site-$side" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "/tmp/site-$side" "${wheels[@]}" || exit 1
done
export MRV2_TEST_GPU=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
model=""  # in the file names, so A/Bs of two models in one call keep both
prev=""
for arg in "$@"; do [ "$prev" = --model ] && model=$arg; prev=$arg; done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    json="$OUT/${bench}${model:+_$model}_${side}_$round.json"
    PYTHONPATH=/tmp/site-$side python3 -m mrv2.entrypoints.cli bench "$bench" --json "$json" \
      "$@" > "${json%.json}.log" 2>&1
    python3 "$(dirname "$0")/ab_summary.py" "$json" "$side" "$round"
  done
done
