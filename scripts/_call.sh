#!/usr/bin/env bash
# one-off device call (not committed)
bash scripts/gpu_session.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site MRV2_TEST_GPU=1 OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}
for step in "$@"; do
  case "$step" in
    final) timeout -s ABRT 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pdl_gemm.py tests/kernels/test_skinny_gemm.py tests/kernels/test_norm_gemv.py 2>&1 | tee "$OUT/gemm_ktests.log" | tail -2
           timeout 60 python3 scripts/proto_streamk.py --check --flat > "$OUT/streamk_flat_check.log" 2>&1; tail -2 "$OUT/streamk_flat_check.log"
           timeout 100 python3 scripts/proto_streamk.py --flat > "$OUT/streamk_flat_8b.log" 2>&1; tail -13 "$OUT/streamk_flat_8b.log"
           timeout 80 python3 scripts/proto_streamk.py --model 0.6B --rows 64 128 256 > "$OUT/streamk_06b.log" 2>&1; tail -13 "$OUT/streamk_06b.log"
           timeout 80 python3 scripts/proto_streamk.py --model 0.6B --rows 64 128 256 --flat > "$OUT/streamk_flat_06b.log" 2>&1; tail -13 "$OUT/streamk_flat_06b.log" ;;
    normeng) MRV2_PDL_GEMM_NORM=1 timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_engine.py 2>&1 | tee "$OUT/engine_tests_norm.log" | tail -2 ;;
    gputests_rest) left=$((575 - SECONDS)); echo "tests budget $left s"; timeout -s ABRT $left python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 ;;
    normchain) timeout 300 python3 scripts/proto_pdl_chain.py --models 0.6B --rows 32 64 96 128 > "$OUT/pdl_chain_norm.log" 2>&1; tail -14 "$OUT/pdl_chain_norm.log" ;;
    streamk) timeout 120 python3 scripts/proto_streamk.py --check > "$OUT/streamk_check.log" 2>&1; tail -2 "$OUT/streamk_check.log"
             timeout $((570 - SECONDS)) python3 scripts/proto_streamk.py > "$OUT/streamk.log" 2>&1; tail -14 "$OUT/streamk.log" ;;
    normlat) bash scripts/ab_env.sh MRV2_PDL_GEMM_NORM=1 latency --model Qwen3-0.6B --batch-sizes 4 8 16 32 64 --new-tokens 256
             ROUNDS=1 bash scripts/ab_env.sh "MRV2_PDL_GEMM_NORM=1 MRV2_PDL_GEMM_MAX_M=128" latency --model Qwen3-0.6B --batch-sizes 96 128 --new-tokens 256 ;;
    every) timeout -s ABRT 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_sampler.py -k every_stage 2>&1 | tee "$OUT/every_stage.log" | tail -2 ;;
    kgemm) timeout -s ABRT 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pdl_gemm.py tests/kernels/test_skinny_gemm.py 2>&1 | tee "$OUT/gemm_ktests.log" | tail -2 ;;
    gputests) timeout -s ABRT 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 ;;
    samp1) timeout 150 python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B --batch-sizes 1 --new-tokens 256 --sampling-params '{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 0}' > "$OUT/samp1.log" 2>&1; tail -4 "$OUT/samp1.log" ;;
    eagle) timeout -s ABRT 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_eagle.py 2>&1 | tee "$OUT/eagle.log" | tail -4 ;;
    gt06) timeout 200 python3 scripts/decode_graph_times.py --model Qwen3-0.6B > "$OUT/graph_times_06b.log" 2>&1; tail -40 "$OUT/graph_times_06b.log" ;;
    gt8) timeout 300 python3 scripts/decode_graph_times.py --model Qwen3-8B > "$OUT/graph_times_8b.log" 2>&1; tail -40 "$OUT/graph_times_8b.log" ;;
    gtv) G="timeout 200 python3 scripts/decode_graph_times.py --max-size 64 --passes 7"
         $G --model Qwen3-0.6B --profile 4 8 16 24 > "$OUT/gtv_06b_default.log" 2>&1
         $G --model Qwen3-0.6B --skinny-max-m 0 --profile 8 16 > "$OUT/gtv_06b_noskinny.log" 2>&1
         $G --model Qwen3-8B --profile 4 8 16 24 > "$OUT/gtv_8b_default.log" 2>&1
         $G --model Qwen3-8B --skinny-max-m 0 --profile 8 16 > "$OUT/gtv_8b_noskinny.log" 2>&1
         $G --model Qwen3-8B --skinny-max-m 0 --pdl-gemm-max-weight 1073741824 --profile 8 16 > "$OUT/gtv_8b_pdlgemm.log" 2>&1
         for f in "$OUT"/gtv_*.log; do echo "== $f"; grep -A12 "^ size" "$f" | head -12; done ;;
    lat) start=$SECONDS
         for round in 1 2; do
           for model in Qwen3-0.6B Qwen3-8B; do
             for arm in A B C; do
               [ $((SECONDS - start)) -gt ${LAT_BUDGET:-380} ] && break 3
               case $arm in A) envs=();; B) envs=(MRV2_SKINNY_MAX_M=2);; C) envs=(MRV2_SKINNY_MAX_M=2 MRV2_DECODE_GRAPHS_MEASURED=1);; esac
               json="$OUT/latency_${model}_${arm}_$round.json"
               env "${envs[@]}" timeout 150 python3 -m mrv2.entrypoints.cli bench latency --model $model --batch-sizes 1 4 8 16 24 40 --new-tokens 256 --json "$json" > "${json%.json}.log" 2>&1
               python3 scripts/ab_summary.py "$json" "$arm" "$round"
             done
           done
         done ;;
    longctx) for arm in B C; do
               case $arm in B) envs=();; C) envs=(MRV2_DECODE_GRAPHS_MEASURED=1);; esac
               json="$OUT/longctx_06b_${arm}.json"
               env "${envs[@]}" timeout 150 python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B --batch-sizes 16 40 --prompt-len 3072 --new-tokens 128 --json "$json" > "${json%.json}.log" 2>&1
               python3 scripts/ab_summary.py "$json" "$arm" 1
             done ;;
  esac
done
