#!/usr/bin/env bash
# Runs on the GPU machine (device tool): installs the carried wheels, then the steps named as
# arguments: tests (tests/gpu), newtests (this session's GPU test files), kerneltests (tests/kernels on CUDA), moe (the fused-MoE kernel bench), tma_prefill (MRV2_TMA_PREFILL's tests and A/B),
# gemm_proto (scripts/proto_gemm.py: Triton TMA GEMMs against cuBLAS at 8B decode shapes),
# pdlchain (scripts/proto_pdl_chain.py: Triton GEMMs with PDL in the decode layer's chain),
# firststeps (scripts/probe_first_steps.py: TTFT step by step and host part, MRV2_PDL_GEMM off and on),
# coldstart (scripts/probe_cold_start.py: the first request of each kind on an empty Triton cache, warm-up off and on),
# gcgen0 (MRV2_GC_GEN0_THRESHOLD=20000 against Python's own, 256 streams through mrv2 serve),
# longdecode (scripts/sweep_long_decode.py: decode attention's launch options at long contexts),
# verify51 (the LayerNorm kernel's tests, the session's new families' GPU tests, 0.6B batch-1 TPOT),
# verify53 (what the fifty-third session's calls left: each "file:k1,k2" of VERIFY53, -k "k1 or k2"),
# verify54 (the DSA top-k's kernel tests and bench, DSA's GPU tests, the new families, then verify53's list),
# verify52 (the new kernels' tests, then the new families' GPU test files),
# verify51b (the kernel tests of the LayerNorm and padded heads on CUDA, then what verify51 left),
# quick49 (the default prefill grid on 8B heads, packed integer reloads; ~2 min), targets49 (issue 16's targets, cheapest first, within VERIFY_S), verify49 (packed integer weights reloaded under graphs, gpt-oss's MXFP4 test, then scripts/kernel_audit.py:
# every Triton variant a workload compiled, flagged for spills and register cliffs),
# verify48b (the eight-warp prefill register cap), verify48 (the flat grid's per-step order and max_model_len auto on CUDA),
# ttfttiles (one long prompt's TTFT, MRV2_ATTN_TILES_LAST=0 against the default),
# verify46b (the forty-sixth session's fixes: integer layers, MLA, Qwen3-Next, Mistral 3, GEMM operands, Qwen-VL;
# VERIFY_TESTS names the GPU test files' stems, VERIFY_CAP a file's seconds),
# verify46 (the forty-fifth session's leftovers: structured outputs' GPU tests, a yarn-scaled 48k-token prompt),
# verify45b (the forty-fifth session's fixes: sampler, speculative decoding, structured outputs, LoRA, weight updates, MoE on CUDA),
# verify45 (what the forty-fourth session's calls left: hybrid GPU tests, sanitizer, Qwen-VL videos, engine tests),
# verify26 (the twenty-sixth session's CPU-only work on the GPU: cold start, engine/sampler/VL tests, start-up log),
# startup (scripts/probe_startup.py: where start-up goes, cold and warm Triton cache),
# structured (scripts/probe_structured.py: JSON-schema batches, late masks against waiting, and free),
# verify28 (the twenty-eighth session's structured-outputs work on CUDA, then that probe),
# verify29 (the twenty-ninth's: structured outputs and every request kind verifying drafts on
# CUDA, no syncs, the output kinds, mrv2 bench outputs), structuredspec (the structured-outputs
# probe with n-gram drafts), servelong (256 streams of 2,048 tokens through mrv2 serve;
# .whl-old: A/B),
# lora (the thirtieth's LoRA adapters, embeddings and weight updates: their GPU and kernel tests on CUDA, then mrv2 bench
# latency's lora_* variants at batch 1 / 8 / 64 on Qwen3-0.6B and Qwen3-8B; lorabench: the kernel tests and
# the bench only), pooling (mrv2 bench pooling: embedding and classification throughput),
# sleep (mrv2 bench sleep: sleep mode's seconds and memory),
# intquant (the thirty-third's GPTQ / AWQ / compressed-tensors layers and sliding-window
# attention with Gemma 3: their GPU and kernel tests on CUDA, then mrv2 bench latency's
# gptq_w4 / awq_w4 / fp8_w8 variants at batch 1 / 8 / 64 on Qwen3-8B and Qwen3-0.6B;
# intbench: the bench only), intsweep (the W4A16 GEMM's and the integer / MXFP4 MoE's tile sweeps,
# their kernel tests, a batch-1 profile of gpt-oss-20b), magic (int_bits against the
# conversions: kernel tests, bench_int --magic), magicab (the engine's TPOT with
# MRV2_INT_MAGIC=0 then 1: Qwen3-8B GPTQ, gpt-oss-20b), ernie (ERNIE-4.5-21B-A3B's TPOT), gptoss (gpt-oss-20b's MXFP4 experts: tests, then bench latency;
# GPTOSS_THROUGHPUT=1: the throughput workload too; GPTOSS_MODEL=gpt-oss-120b: the big one),
# gemma3vl (Gemma 3 with images: GPU tests, mrv2 bench multimodal on gemma-3-4b-it),
# mmnew (the forty-first session's Llama 4 images and Gemma 4 audio: their GPU tests),
# gluonprefill (a Gluon causal prefill attention: FlashAttention-3's schedule),
# qwen3next (the linear-attention kernels on CUDA, Qwen3-Next's GPU tests, its TPOT cut to 8 layers), gluonrs (a Gluon MXFP4 GEMM with the weights decoded into wgmma's register operand),
# intdense (integer experts dequantized first, opt-in: timed beside MXFP4's),
# deltacheck (the chunked delta rule: error by precision, tests, times, compute-sanitizer, the
# hybrid GPU tests), deltasweep (its launch options, a process each), qwen3nextttft (Qwen3-Next's
# TTFT, 8 layers, token-serial against chunked),
# mxfp4dense (MXFP4 experts dequantized for large steps: tests, bench_int, gpt-oss-20b
# throughput against MRV2_MXFP4_DENSE=0), slidingkv (sliding-window block tables: GPU tests, gpt-oss-20b throughput at equal KV memory),
# graphtimes (scripts/decode_graph_times.py: each decode graph's replay time by size),
# streamk (scripts/proto_streamk.py: a stream-K GEMM against cuBLAS at 8B decode shapes), attn,
# splits, skinny, normgemv, sampler, throughput, prefix, preempt, latency, multimodal, profile, mixed,
# flatgrid (MRV2_ATTN_FLAT_GRID: the kernel case, then the throughput A/B whose "on" side is the old grid),
# mixedgraphs (steps with prompt tokens in CUDA graphs: small steps and the throughput workload),
# servestreams (mrv2 serve, 256 streams of Qwen3-0.6B at 64/s and at once), serveprof (the same at
# once under the server's stack sampler), serveclients (read by 1 and by 4 client processes),
# streaminterval (--stream-interval 1 / 4 / 16 on that load), serveprocess (the engine process
# against the engine thread), gcfreeze (MRV2_GC_FREEZE: the startup heap frozen or not),
# servegraphs (the same through mrv2 serve: scripts/serve_sweep.py, eager against graphs), servespec
# (the same with n-gram speculation), padding (what padding rows cost: MoE and mixed graphs),
# measuredcut (MRV2_MIXED_GRAPHS_MEASURED: mixed graphs only where they beat eager),
# fp8kv / fp8kv8b (kv_cache_dtype=fp8: tests and the 0.6B / 8B throughput A/B), fp8warps (an fp8
# cache's 2-warp decode against 4), fp8proto (the prototype's next tiles), readbw
# (scripts/read_bandwidth.py: what a read-only kernel reaches in decode attention's patterns), fp8attn (decode attention over
# fp8 caches per tile), attnncu (Nsight Compute on a decode attention step), blas (scripts/blas_options.py: torch's cuBLAS switches on decode GEMMs),
# onetoken (MRV2_ATTN_ONE_TOKEN_APART: a prefill plan's one-token requests in their own launch),
# serve8b (mrv2 serve on Qwen3-8B with long prompts: the default against either switch),
# mlaflat (MRV2_MLA_FLAT_GRID: MLA's flat grid, its tests and the DeepSeek-V2-Lite A/B),
# tp_tests / tp_latency / tp_profile / tp_throughput (two GPUs: the nvidia-h200-x2 kind), glm47 (issue 19's
# sweep: TP=4 on nvidia-h200-x4; on x2: TP=2 GLM47_ARGS="--hf-overrides '{\"num_hidden_layers\": N}'"),
# soak (SOAK_S seconds of load, default 450: a device call is capped at 600 s; for the full 10
# minutes start scripts/soak.py under setsid and collect its --out folder in a second call). Logs go to $OUT;
# a short summary prints last.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site MRV2_TEST_GPU=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv
for step in "$@"; do
  case "$step" in
    tests) # -v: a call's time limit that cuts the run still leaves each finished test's line
           python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" \
             | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | tail -25 ;;
    newtests) # the thirty-first and thirty-second sessions' GPU tests: adapters, embeddings,
              # weight updates, shutdown's memory, classifiers, sleep mode (-s: its sleep and
              # wake_up seconds) (~3 min)
              python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/gpu/test_gpu_sleep.py \
                tests/gpu/test_gpu_lora.py \
                tests/gpu/test_gpu_embeddings.py tests/gpu/test_gpu_update_weights.py \
                tests/gpu/test_gpu_shutdown.py tests/gpu/test_gpu_classification.py 2>&1 \
                | tee "$OUT/gpu_newtests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|level [12]:" \
                | tail -17 ;;
    kerneltests) # every kernel test compiled for CUDA (~5 min: a call of its own)
           python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.log" | tail -4 ;;
    fp8kv|fp8kv8b) # kv_cache_dtype=fp8: (fp8kv) its GPU and kernel tests on CUDA and the
           # Qwen3-0.6B throughput workload, (fp8kv8b) Qwen3-8B's, each with the default (bf16)
           # cache and the fp8 one in one process (a call can't hold both models' runs)
           if [ "$step" = fp8kv ]; then
             timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_fp8_kv.py \
               2>&1 | tee "$OUT/fp8kv_gpu_tests.log" | tail -3
             timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv_cache.py \
               tests/kernels/test_kv_cache_write.py 2>&1 | tee "$OUT/fp8kv_kernel_tests.log" | tail -3
             run="Qwen3-0.6B:280"
           else
             run="Qwen3-8B:360"
           fi
           m=${run%%:*}; json="$OUT/fp8kv_throughput_$m.json"
           timeout "${run#*:}" python3 -m mrv2.entrypoints.cli bench throughput --model "$m" \
             --variants default kv_fp8 --json "$json" > "${json%.json}.log" 2>&1
           python3 -c "import json, sys; [print(sys.argv[1], k, v['output_tok_s'], \
             v.get('floor_fraction'), v.get('roofline_fraction')) for k, v in \
             json.load(open(sys.argv[2])).items() if isinstance(v, dict) and 'output_tok_s' in v]" \
             "$m" "$json" ;;
    fp8warps) # an fp8 cache's decode plan (decode_warps' rule) against 4 warps everywhere:
              # the decode grid (batch 1-256 x context 256-4,096, Qwen3-8B heads)
              for w in 4 0; do
                timeout 150 python3 -m mrv2_kernels.bench_attention --layouts 8B --kv-dtype fp8 \
                  $([ $w = 0 ] || echo --decode-warps $w) > "$OUT/fp8warps_grid_w$w.log" 2>&1
              done
              paste <(grep -E "^ +[0-9]+ +[0-9]+ " "$OUT/fp8warps_grid_w4.log" | awk '{print $1, $2, $5}') \
                    <(grep -E "^ +[0-9]+ +[0-9]+ " "$OUT/fp8warps_grid_w0.log" | awk '{print $5}') \
                | awk 'BEGIN {print "batch ctx us_4warps us_default"} {print}' ;;
    fp8attn) # decode attention over an fp8 cache against a bf16 one: the kernel tests on CUDA,
             # then the throughput workload's decode steps (bench_attention --workload) per tile
             timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv_cache.py \
               2>&1 | tee "$OUT/fp8attn_kernel_tests.log" | grep -E "^E .*differ|passed|failed"
             for run in "0.6B:auto:64:2:4" "0.6B:fp8:64:2:4 128:2:4 128:3:4 128:2:8 32:2:4" \
                        "8B:auto:64:2:4" "8B:fp8:64:2:4 128:2:4 128:3:4"; do
               lay=${run%%:*}; rest=${run#*:}; kv=${rest%%:*}
               timeout 150 python3 -m mrv2_kernels.bench_attention --workload --layouts "$lay" \
                 --kv-dtype "$kv" --workload-tiles ${rest#*:} 2>&1 \
                 | tee "$OUT/fp8attn_${lay}_$kv.log" | sed -n '/^summary/,$p'
             done ;;
    fp8proto) # scripts/proto_fp8_decode.py's leads for the fp8 decode kernel's residency: 32-key
              # tiles on 4 warps (104 registers in the sm_90 compile) against the kept 64:2:2
              timeout 200 python3 scripts/proto_fp8_decode.py --modes f16 \
                --tiles 64:2:2 64:2:4 32:2:4 32:3:4 32:4:4 32:2:4:96 32:2:2 2>&1 \
                | tee "$OUT/fp8proto.log" | grep -v Warn ;;
    readbw) # scripts/read_bandwidth.py: the read bandwidth a kernel reaches in decode
            # attention's access patterns (contiguous, per kv head through a block table, per
            # block), against the copy bandwidth the byte floors use
            timeout 150 python3 scripts/read_bandwidth.py 2>&1 | tee "$OUT/read_bandwidth.log" \
              | grep -v Warn ;;
    attnncu) # Nsight Compute on one workload-shaped decode attention step, bf16 and fp8 caches
             # (scripts/ncu_decode_attention.py): where its time per key goes
             for kv in auto fp8; do
               timeout 200 ncu --clock-control none -k regex:_paged_attn_kernel -s 2 -c 1 \
                 --section SpeedOfLight --section WarpStateStats --section InstructionStats \
                 --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
                 python3 scripts/ncu_decode_attention.py --kv-dtype $kv \
                 > "$OUT/ncu_decode_$kv.log" 2>&1
               python3 scripts/ncu_decode_attention.py --kv-dtype $kv | tail -1
               grep -E "Duration|Memory Throughput|DRAM Throughput|Executed Ipc|Issue Slots|\
Achieved Occupancy|Registers Per|Stall|No Eligible" "$OUT/ncu_decode_$kv.log" | head -20
             done ;;
    blas) # torch's cuBLAS switches (fp32 split-K reduce, no split-K, cuBLASLt) on decode GEMMs
          timeout 200 python3 scripts/blas_options.py 2>&1 | tee "$OUT/blas_options.log" | tail -26 ;;
    sampler) python3 -m mrv2.entrypoints.cli bench sampler --json "$OUT/sampler.json" 2>&1 \
               | tee "$OUT/sampler.log" | tail -20 ;;
    prefix) python3 -m mrv2.entrypoints.cli bench throughput --json "$OUT/prefix.json" \
              --full-warmup --shared-prefix 1000 --variants default prefix_off 2>&1 \
              | tee "$OUT/prefix.log" | tail -30 ;;
    preempt) python3 -m mrv2.entrypoints.cli bench throughput --json "$OUT/preempt.json" \
               --full-warmup --kv-fraction 0.33 2>&1 | tee "$OUT/preempt.log" | tail -30 ;;
    verify28) # the twenty-eighth session's CPU-only work on the GPU: the mask kernel and the
              # structured-outputs / sampler tests on CUDA, then the load probe (needs
              # .whl/qwen3s and .whl/smollm2: benchmarks/2026-12-04-h200-issue16-session28/)
              timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_bitmask.py \
                2>&1 | tee "$OUT/bitmask_kernel.log" | tail -2
              timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_gpu_structured_outputs.py tests/gpu/test_gpu_sampler.py \
                2>&1 | tee "$OUT/verify28_tests.log" | tail -2
              timeout 300 python3 scripts/probe_structured.py --tokenizer .whl/smollm2 \
                --model .whl/qwen3s --requests 1 8 64 256 --json "$OUT/structured.json" 2>&1 \
                | tee "$OUT/structured.log" | tail -10 ;;
    verify29) # the twenty-ninth session's CPU-only work on the GPU: structured outputs with
              # speculation (graphs and tails on CUDA), the output kinds through the engine and
              # the server, then the outputs' host cost on this host (mrv2 bench outputs)
              timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_gpu_structured_outputs.py tests/gpu/test_gpu_sampler.py \
                2>&1 | tee "$OUT/verify29_gpu.log" | tail -2
              timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_gpu_engine.py -k "verifies_drafts or never_synchronize" \
                2>&1 | tee "$OUT/verify29_spec.log" | tail -2
              timeout 200 python3 -m pytest -q -p no:cacheprovider \
                tests/engine/test_stop_conditions.py tests/engine/test_structured_outputs.py \
                tests/server/test_echo_and_prompt_logprobs.py 2>&1 | tee "$OUT/verify29_cpu.log" | tail -2
              OMP_NUM_THREADS=1 timeout 200 python3 -m mrv2.entrypoints.cli bench outputs \
                --requests 64 --tokens 2048 --json "$OUT/outputs.json" 2>&1 \
                | tee "$OUT/outputs.log" | tail -12
              [ -d .whl/smollm2 ] && timeout 60 python3 scripts/probe_draft_masks.py \
                --tokenizer .whl/smollm2 2>&1 | tee "$OUT/draft_masks.log" | tail -8 ;;
    lora) # LoRA adapters: the GPU tests (fp32 parity with HF's merged weights, bf16 graphs
          # against eager), the kernel on CUDA, then what adapters cost a decode step
          timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_lora.py \
            tests/gpu/test_gpu_embeddings.py tests/gpu/test_gpu_update_weights.py 2>&1 \
            | tee "$OUT/lora_tests.log" | tail -2
          timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_kernel.py \
            2>&1 | tee "$OUT/lora_kernel_tests.log" | tail -2
          for m in Qwen3-0.6B Qwen3-8B; do
            timeout 240 python3 -m mrv2.entrypoints.cli bench latency --model $m \
              --new-tokens 256 --variants lora_idle lora_1 lora_4 --json "$OUT/lora_$m.json" \
              2>&1 | tee "$OUT/lora_$m.log" | tail -14
          done ;;
    lorabench) # the LoRA kernel on CUDA and mrv2 bench latency's lora_* variants only
          timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_kernel.py \
            2>&1 | tee "$OUT/lora_kernel_tests.log" | tail -2
          for m in Qwen3-0.6B Qwen3-8B; do
            timeout 150 python3 -m mrv2.entrypoints.cli bench latency --model $m \
              --new-tokens 256 --variants lora_idle lora_1 lora_4 --json "$OUT/lora_$m.json" \
              > "$OUT/lora_$m.log" 2>&1
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(sys.argv[2], \
              k, *(f\"b{r['batch']} {r['tpot_ms']}\" for r in d[k])) for k in \
              ('default', 'lora_idle', 'lora_1', 'lora_4') if k in d]" "$OUT/lora_$m.json" $m
          done ;;
    pooling) # mrv2 bench pooling: embeddings and a one-label classifier's scores, 1,024
             # prompts of 64-512 tokens, on Qwen3-0.6B and Qwen3-8B (dummy weights)
             for m in Qwen3-0.6B Qwen3-8B; do
               timeout 200 python3 -m mrv2.entrypoints.cli bench pooling --model $m \
                 --json "$OUT/pooling_$m.json" > "$OUT/pooling_$m.log" 2>&1
               python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(sys.argv[2], \
                 t, d[t]) for t in ('embed', 'classify') if t in d]" "$OUT/pooling_$m.json" $m
             done ;;
    intquant|intbench) # W4A16: correctness on CUDA first (intquant), then batch-1/8/64 TPOT
           # of random 4-bit GPTQ (symmetric) and AWQ (zero points) weights against bf16 and
           # block-FP8 ones, Qwen3-8B then Qwen3-0.6B (~4 min)
           if [ "$step" = intquant ]; then
             timeout 360 python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/gpu/test_gpu_int_quant.py tests/gpu/test_gpu_gemma.py 2>&1 \
               | tee "$OUT/int_gpu_tests.log" | tail -3
             timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_wna16_gemm.py \
               tests/kernels/test_sliding_window.py tests/kernels/test_fused_moe_int.py 2>&1 \
               | tee "$OUT/int_kernel_tests.log" | tail -3
           fi
           for m in ${INT_MODELS:-Qwen3-8B Qwen3-0.6B Qwen3-30B-A3B}; do
             timeout 200 python3 -m mrv2.entrypoints.cli bench latency --model $m \
               --variants gptq_w4 awq_w4 fp8_w8 --new-tokens 256 --json "$OUT/int_$m.json" \
               > "$OUT/int_$m.log" 2>&1
             python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(sys.argv[2], \
               k, [(r['batch'], r['tpot_ms']) for r in v]) for k, v in d.items() \
               if isinstance(v, list)]" "$OUT/int_$m.json" $m
           done ;;
    intsweep) # the thirty-fifth session: the MXFP4 MoE's and the W4A16 GEMM's tile sweeps
              # against their byte floors (bench_int), the GPTQ MoE's, their kernel tests on
              # CUDA, then where a batch-1 step of gpt-oss-20b goes (~8 min; most useful first)
              timeout 150 python3 -m mrv2_kernels.bench_int --sweep --moe-only --moe-layers \
                gpt-oss-20b 2>&1 | tee "$OUT/bench_int_moe.log" | grep -v "^  " | tail -5
              timeout 170 python3 -m mrv2_kernels.bench_int --sweep --gemm-only 2>&1 \
                | tee "$OUT/bench_int_gemm.log" | grep -v "^  " | tail -14
              timeout 90 python3 -m mrv2_kernels.bench_int --sweep --moe-only --moe-layers \
                Qwen3-30B-A3B-GPTQ 2>&1 | tee "$OUT/bench_int_moe_gptq.log" | grep -v "^  " | tail -5
              timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_wna16_gemm.py \
                tests/kernels/test_fused_moe_gpt_oss.py tests/kernels/test_fused_moe_int.py 2>&1 \
                | tee "$OUT/int_kernel_tests.log" | tail -3
              timeout 70 python3 scripts/profile_decode.py --batch 1 --steps 32 --model \
                ${PROFILE_MODEL:-gpt-oss-20b} > "$OUT/profile_int.log" 2>&1
              grep -E "wall per step|GPU over" "$OUT/profile_int.log"
              grep -A16 "Self CUDA %" "$OUT/profile_int.log" \
                | awk '{print substr($0,1,50) "|" substr($0,length($0)-75)}' ;;
    magic) # the thirty-sixth session: integer / MXFP4 weights made floats from their bits
           # (mrv2_kernels.int_bits) against the conversions: the kernel tests on CUDA, then
           # bench_int --magic (the default tiles with and without, wider one-row tiles)
           timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_wna16_gemm.py \
             tests/kernels/test_fused_moe_gpt_oss.py tests/kernels/test_fused_moe_int.py 2>&1 \
             | tee "$OUT/magic_kernel_tests.log" | tail -3
           [ -z "${MAGIC_MOE_ONLY:-}" ] && timeout 200 python3 -m mrv2_kernels.bench_int \
             --magic --gemm-only --rows ${MAGIC_ROWS:-1 8 64} 2>&1 \
             | tee "$OUT/magic_gemm.log" | grep -v "^  " | tail -14
           timeout 240 python3 -m mrv2_kernels.bench_int --magic --moe-only --moe-layers \
             ${MAGIC_MOE:-gpt-oss-20b Qwen3-30B-A3B-GPTQ} --rows ${MAGIC_MOE_ROWS:-1 8 64} \
             2>&1 | tee "$OUT/magic_moe.log" | grep -v "^  " | tail -12 ;;
    magicab) # the engine with the bit-built weights' defaults (MRV2_INT_MAGIC=1) against the
             # conversions' (0): the int GPU tests, then batch-1/8/64 TPOT of Qwen3-8B as
             # 4-bit GPTQ and of gpt-oss-20b (MXFP4), each A then B on one warm machine (the
             # gpt-oss engine test compiles for ~2 min on a cold machine: MAGIC_TEST_S 300)
             timeout ${MAGIC_TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/gpu/test_gpu_int_quant.py ${MAGIC_TESTS_K:-} 2>&1 | tee "$OUT/magic_gpu_tests.log" | tail -2
             for flag in 0 1; do
               for m in ${MAGIC_MODELS:-Qwen3-8B gpt-oss-20b}; do
                 variants=$(case $m in Qwen3*) echo "--variants gptq_w4";; esac)
                 MRV2_INT_MAGIC=$flag timeout 150 python3 -m mrv2.entrypoints.cli bench latency \
                   --model $m $variants --new-tokens 128 --json "$OUT/magic${flag}_$m.json" \
                   ${MAGIC_BATCHES:+--batch-sizes $MAGIC_BATCHES} > "$OUT/magic${flag}_$m.log" 2>&1
                 python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print( \
                   'MRV2_INT_MAGIC=' + sys.argv[3], sys.argv[2], k, [(r['batch'], r['tpot_ms']) \
                   for r in v]) for k, v in d.items() if isinstance(v, list)]" \
                   "$OUT/magic${flag}_$m.json" $m $flag
               done
             done ;;
    slidingkv) # the thirty-seventh session: sliding-window layers' own block tables
               # (mrv2.runner.kv_tables): the Gemma 3 and engine GPU tests, then gpt-oss-20b's
               # throughput workload at equal KV memory: one table (MRV2_SLIDING_KV_TABLES=0,
               # a block id of 24 layers) at --kv-fraction SLIDING_FRACTION (default 0.5)
               # against the tables (12 layers a block id) at twice it
               timeout ${SLIDING_TEST_S:-300} python3 -m pytest -v -p no:cacheprovider -m gpu \
                 tests/gpu/test_gpu_gemma.py tests/gpu/test_gpu_engine.py ${SLIDING_TESTS:-} 2>&1 \
                 | tee "$OUT/sliding_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -25
               frac=${SLIDING_FRACTION:-0.5}
               warm=--full-warmup  # (the first side compiles the model's kernels untimed)
               for side in "0 $frac" "1 $(python3 -c "print(2 * $frac)")"; do
                 read -r flag f <<< "$side"
                 MRV2_SLIDING_KV_TABLES=$flag timeout ${SLIDING_BENCH_S:-200} python3 -m \
                   mrv2.entrypoints.cli bench throughput --model ${SLIDING_MODEL:-gpt-oss-20b} \
                   --load-format dummy --kv-fraction $f --json "$OUT/sliding${flag}.json" \
                   $warm > "$OUT/sliding${flag}.log" 2>&1
                 warm=
                 grep -E "KV cache:" "$OUT/sliding${flag}.log" | tail -1
                 python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
                   [print('tables' if sys.argv[2] == '1' else 'one table', 'kv-fraction', \
                   sys.argv[3], k, {x: r.get(x) for x in ('output_tok_s', 'seconds', \
                   'preemptions')}) for k, r in d.items() \
                   if isinstance(r, dict)]" "$OUT/sliding${flag}.json" $flag $f
               done ;;
    mxfp4dense) # the thirty-seventh session: MXFP4 experts dequantized for large steps
                # (mrv2_kernels.mxfp4_dense) and two-group K steps from 64-row tiles: the
                # kernel tests on CUDA, the gpt-oss engine GPU test, bench_int's default at
                # 256 / 1,024 / 8,192 tokens, then gpt-oss-20b's throughput workload with
                # MRV2_MXFP4_DENSE=0 (the GEMMs decode at every size) and without
                timeout 150 python3 -m pytest -q -p no:cacheprovider \
                  tests/kernels/test_fused_moe_gpt_oss.py 2>&1 | tee "$OUT/dense_kernel_tests.log" | tail -2
                timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
                  tests/gpu/test_gpu_int_quant.py -k gpt_oss 2>&1 | tee "$OUT/dense_gpu_tests.log" | tail -2
                timeout 120 python3 -m mrv2_kernels.bench_int --moe-only --moe-layers gpt-oss-20b \
                  --rows 256 1024 8192 2>&1 | tee "$OUT/dense_moe.log" | grep -E "^ +[0-9]+ " | cut -c1-60
                for flag in ${DENSE_FLAGS:-0 1}; do
                  env $( [ $flag = 0 ] && echo MRV2_MXFP4_DENSE=0 ) timeout ${DENSE_BENCH_S:-150} \
                    python3 -m mrv2.entrypoints.cli bench throughput --model gpt-oss-20b \
                    --load-format dummy --json "$OUT/dense${flag}.json" > "$OUT/dense${flag}.log" 2>&1
                  python3 -c "import json, sys; d = json.load(open(sys.argv[1]))['default']; \
                    print('MXFP4 dense' if sys.argv[2] == '1' else 'MXFP4_DENSE=0', \
                    {x: d.get(x) for x in ('output_tok_s', 'seconds', 'preemptions')}, \
                    {k: (v['steps'], v['device_s']) for k, v in d['by_step_kind'].items()})" \
                    "$OUT/dense${flag}.json" $flag
                done ;;
    qwen3next) # Qwen3-Next and Nemotron-H: the state kernels compiled for CUDA, the GPU tests
               # (HF parity with graphs, chunks, preemption; no syncs), then batch-1/8/64 TPOT of
               # Qwen3-Next-80B-A3B cut to 8 layers (2 full attention, 6 Gated DeltaNet; random
               # weights) beside the token-serial prefill's TTFT
               timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_attention.py \
                 2>&1 | tee "$OUT/qwen3next_kernel_tests.log" | tail -2
               timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen3_next.py tests/gpu/test_gpu_nemotron_h.py tests/gpu/test_gpu_granite_hybrid.py tests/gpu/test_gpu_falcon_h1.py tests/gpu/test_gpu_mamba2.py \
                 2>&1 | tee "$OUT/qwen3next_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -4
               timeout 200 python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-Next-80B-A3B \
                 --hf-overrides '{"num_hidden_layers": 8}' --new-tokens 128 \
                 --json "$OUT/qwen3next_latency.json" > "$OUT/qwen3next_latency.log" 2>&1
               python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print('qwen3-next-8L', \
                 k, [(r['batch'], r['tpot_ms'], r.get('ttft_ms')) for r in v]) \
                 for k, v in d.items() if isinstance(v, list)]" "$OUT/qwen3next_latency.json" \
                 || tail -5 "$OUT/qwen3next_latency.log" ;;
    hybridverify) # the fortieth session's hybrid work on CUDA: the state kernels with snapshot
                  # tables, raw gates, D skip and the gated norm; the hybrid families' GPU tests
                  # (prefix caching through state snapshots now on); then Qwen3-Next's batch-1
                  # profile with the fused glue
                  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_attention.py \
                    tests/kernels/test_state_snapshots.py tests/kernels/test_state_row_slots.py tests/kernels/test_gated_rms_norm.py tests/kernels/test_moe_router.py 2>&1 \
                    | tee "$OUT/hybrid_kernel_tests.log" | tail -2
                  timeout 330 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen3_next.py \
                    tests/gpu/test_gpu_nemotron_h.py tests/gpu/test_gpu_granite_hybrid.py tests/gpu/test_gpu_falcon_h1.py tests/gpu/test_gpu_mamba2.py \
                    2>&1 | tee "$OUT/hybrid_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -18
                  timeout 150 python3 scripts/profile_decode.py --model Qwen3-Next-80B-A3B --batch 1 \
                    --steps 32 --hf-overrides '{"num_hidden_layers": 8}' --trace "" 2>&1 \
                    | tee "$OUT/qwen3next_prof_b1.log" | grep -E "wall per step|GPU over" ;;
    llama4) # Llama 4's text model on CUDA: HF parity with graphs, chunks, preemption; no syncs
            timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_llama4.py 2>&1 \
              | tee "$OUT/llama4_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -5 ;;
    hybridmin) # the least of hybridquick: the kernel tests on CUDA, then Qwen3-Next's profile
               timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_attention.py \
                 tests/kernels/test_state_snapshots.py tests/kernels/test_state_row_slots.py tests/kernels/test_gated_rms_norm.py tests/kernels/test_moe_router.py 2>&1 \
                 | tee "$OUT/hybrid_kernel_tests.log" | tail -2
               timeout 130 python3 scripts/profile_decode.py --model Qwen3-Next-80B-A3B --batch 1 \
                 --steps 32 --hf-overrides '{"num_hidden_layers": 8}' --trace "" 2>&1 \
                 | tee "$OUT/qwen3next_prof_b1.log" | grep -E "wall per step|GPU over" ;;
    hybridquick) # hybridverify cut down for a short budget: the kernel tests on CUDA, the
                 # Qwen3-Next and Nemotron-H GPU tests, Qwen3-Next's batch-1 profile and TPOT
                 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_attention.py \
                   tests/kernels/test_state_snapshots.py tests/kernels/test_state_row_slots.py tests/kernels/test_gated_rms_norm.py tests/kernels/test_moe_router.py 2>&1 \
                   | tee "$OUT/hybrid_kernel_tests.log" | tail -2
                 timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen3_next.py \
                   tests/gpu/test_gpu_nemotron_h.py 2>&1 | tee "$OUT/hybrid_gpu_tests.log" \
                   | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -8
                 timeout 120 python3 scripts/profile_decode.py --model Qwen3-Next-80B-A3B --batch 1 \
                   --steps 32 --hf-overrides '{"num_hidden_layers": 8}' --trace "" 2>&1 \
                   | tee "$OUT/qwen3next_prof_b1.log" | grep -E "wall per step|GPU over" ;;
    deltacheck) # the chunked delta rule's error by products' precision, its tests on CUDA,
                # its time and kernels, its default launch under compute-sanitizer, then the
                # hybrid families' GPU tests (Qwen3-Next's prompts now take it)
                timeout 60 python3 scripts/probe_delta_precision.py 2>&1 | tee "$OUT/delta_precision.log" | tail -18
                timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_delta_rule.py \
                  tests/kernels/test_state_row_slots.py 2>&1 | tee "$OUT/chunk_tests.log" | grep -E "^FAILED|passed|failed"
                timeout 100 python3 scripts/bench_delta_rule.py --profile 2>&1 \
                  | tee "$OUT/deltabench.log" | grep -vE "Warn|warn_once" | tail -30
                # the short sequences' token-serial routing against none (every sequence chunked)
                timeout 60 python3 scripts/bench_delta_rule.py --case decodes --serial-below 0 2>&1 \
                  | tee "$OUT/deltabench_unrouted.log" | grep decodes | sed "s/^/unrouted: /"
                CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
                [ -n "$CS" ] && timeout 120 "$CS" --print-limit 5 python3 scripts/bench_delta_rule.py \
                  --case "8 x 512" 2>&1 | tee "$OUT/sanitizer.log" | grep -E "ERROR SUMMARY|Invalid|qwen" | head -8
                timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen3_next.py \
                  tests/gpu/test_gpu_nemotron_h.py tests/gpu/test_gpu_mamba2.py 2>&1 \
                  | tee "$OUT/hybrid_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -14 ;;
    deltasweep) # the forty-third session's chunked delta rule (the state in registers, the
                # outputs a parallel kernel): its tests on CUDA, then the bench (each form in
                # a CUDA graph, an eager call's host time) and the launch options' sweep (DELTA_PRECS: the
                # products' precisions swept, default tf32 and tf32x3)
                timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_delta_rule.py \
                  tests/kernels/test_state_row_slots.py 2>&1 | tee "$OUT/chunk_tests.log" | tail -2
                timeout 120 python3 scripts/bench_delta_rule.py --graph 2>&1 \
                  | tee "$OUT/deltasweep.log" | grep -v Warn | tail -24
                for prec in ${DELTA_PRECS:-tf32 tf32x3}; do for w in 4 8; do for bv in 16 32; do for st in 1 2; do
                  timeout 60 python3 scripts/bench_delta_rule.py --variant $prec,$w,$bv,$st 2>&1 \
                    | tee -a "$OUT/deltasweep_variants.log" | grep -E "variant|Error" | sort -u
                done; done; done; done ;;
    verify44) # the forty-fourth session on CUDA, most needed first, within VERIFY_S seconds
              # (default 540): the chunk kernels' tests (the small-V default launch fixed),
              # bench_delta_rule --graph (each form in a CUDA graph), Qwen3-Next's TTFT at
              # 4,096 tokens token-serial against chunked, the scan's launch sweep (TF32),
              # then the Qwen-VL video GPU tests (the video processor settings)
              end=$(( $(date +%s) + ${VERIFY_S:-540} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_delta_rule.py \
                tests/kernels/test_state_row_slots.py 2>&1 | tee "$OUT/chunk_tests.log" | grep -E "^FAILED|passed|failed"
              timeout "$(left 120)" python3 scripts/bench_delta_rule.py --graph 2>&1 \
                | tee "$OUT/deltagraph.log" | grep -vE "Warn|warn_once" | tail -40
              for env in 0 1; do
                MRV2_CHUNKED_DELTA_RULE=$env timeout "$(left 140)" python3 -m mrv2.entrypoints.cli bench latency \
                  --model Qwen3-Next-80B-A3B --hf-overrides '{"num_hidden_layers": 8}' \
                  --prompt-len 4096 --new-tokens 8 --batch-sizes 1 --max-model-len 8192 \
                  --json "$OUT/qn_ttft_4096_$env.json" > "$OUT/qn_ttft_4096_$env.log" 2>&1
                python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
                  print('chunked=' + sys.argv[2], [(r['batch'], r['ttft_ms'], r['tpot_ms']) \
                  for r in d['default'] if 'batch' in r])" "$OUT/qn_ttft_4096_$env.json" "$env" 2>&1 | tail -1
              done
              for w in 4 8; do for bv in 16 32; do for st in 1 2; do
                [ "$(left 30)" -lt 10 ] && break 3
                timeout "$(left 30)" python3 scripts/bench_delta_rule.py --variant tf32,$w,$bv,$st 2>&1 \
                  | tee -a "$OUT/deltasweep_variants.log" | grep -E "variant|Error" | sort -u
              done; done; done
              timeout "$(left 240)" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen_vl_video.py \
                2>&1 | tee "$OUT/qwen_vl_videos.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -8 ;;
    verify45) # what the forty-fourth session's calls left, most needed first, within VERIFY_S
              # seconds (default 540): the hybrid families' GPU tests on the final code (the
              # snapshot-slot fix, the chunked threshold 64, the scan's 4-warp default), the
              # scan's default launch under compute-sanitizer, the Qwen-VL video GPU tests, then
              # the engine's GPU tests (the forward context per thread)
              end=$(( $(date +%s) + ${VERIFY_S:-540} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 240)" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen3_next.py \
                tests/gpu/test_gpu_nemotron_h.py tests/gpu/test_gpu_mamba2.py 2>&1 \
                | tee "$OUT/hybrid_gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -8
              CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
              [ -n "$CS" ] && timeout "$(left 100)" "$CS" --print-limit 5 python3 scripts/bench_delta_rule.py \
                --case "8 x 512" 2>&1 | tee "$OUT/sanitizer.log" | grep -E "ERROR SUMMARY|Invalid" | head -6
              timeout "$(left 200)" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen_vl_video.py \
                2>&1 | tee "$OUT/qwen_vl_videos.log" | grep -E "FAILED|ERROR|passed|failed" | tail -6
              timeout "$(left 200)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_engine.py \
                2>&1 | tee "$OUT/engine_gpu_tests.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -6 ;;
    verify45b) # the forty-fifth session's fixes on CUDA, within VERIFY_S seconds (default 540):
               # the sampler (masks before penalties, clamped top-k), speculative decoding
               # (probabilistic rejection's temperature), structured outputs, LoRA (rows), weight
               # updates (checked on meta first), then the MoE and engine-thread tests
               end=$(( $(date +%s) + ${VERIFY_S:-540} ))
               left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
               for t in sampler eagle mtp structured_outputs lora update_weights moe; do
                 [ "$(left 20)" -lt 15 ] && break
                 timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_$t.py 2>&1 \
                   | tee "$OUT/gpu_$t.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/$t: /"
               done ;;
    verify46) # what the forty-fifth session's calls left, within VERIFY_S seconds (default 540):
              # the structured-outputs GPU tests (the module engine at 0.15 of the device), then a
              # yarn-scaled Qwen3-0.6B past max_position_embeddings (40,960) on CUDA: a 48,000-token
              # prompt, max_model_len 65,536 (RoPE scaling's limit), batch-1 TTFT and TPOT
              end=$(( $(date +%s) + ${VERIFY_S:-540} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 200)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_structured_outputs.py \
                2>&1 | tee "$OUT/gpu_structured_outputs.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -4
              timeout "$(left 240)" python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B \
                --batch-sizes 1 --prompt-len 48000 --new-tokens 128 --max-model-len 65536 \
                --hf-overrides '{"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}}' \
                --json "$OUT/rope_long.json" 2>&1 | tee "$OUT/rope_long.log" | grep -E "ttft|tpot|rror" | tail -6 ;;
    verify46b) # the forty-sixth session's fixes on CUDA, within VERIFY_S seconds (default 540):
               # integer layers kept packed (order_inputs once, rows reordered: GPTQ GPU tests),
               # DeepSeek's MLA (fp8), Qwen3-Next, Ministral 3 / Mistral 3, the fp8 / W4A16
               # GEMMs' strided operands (kernel tests), Qwen-VL (check_request), InternVL
               end=$(( $(date +%s) + ${VERIFY_S:-540} ))
               left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
               for t in ${VERIFY_TESTS:-int_quant fp8_mla qwen3_next mistral3 kernels qwen_vl internvl}; do
                 [ "$(left 20)" -lt 15 ] && break
                 if [ "$t" = kernels ]; then
                   timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py \
                     tests/kernels/test_wna16_gemm.py 2>&1 | tee "$OUT/kernel_gemms.log" \
                     | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/$t: /"
                   continue
                 fi
                 timeout "$(left "${VERIFY_CAP:-150}")" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_$t.py 2>&1 \
                   | tee "$OUT/gpu_$t.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/$t: /"
               done ;;
    deltabench) # scripts/bench_delta_rule.py: the token-serial delta rule against the chunked
                # one on prefill-shaped steps (checked against each other first), then the
                # chunked kernel's tests compiled for CUDA
                timeout 200 python3 scripts/bench_delta_rule.py 2>&1 | tee "$OUT/deltabench.log" | tail -7
                timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_delta_rule.py \
                  2>&1 | tee "$OUT/chunk_tests.log" | tail -2 ;;
    qwen3nextttft) # the forty-third session's chunked delta rule end to end: Qwen3-Next cut to 8
                   # layers (random weights), TTFT of one prompt of each of QN_LENS tokens (default
                   # 1,024 and 4,096: each run starts an engine, ~1-2 min) with every step
                   # token-serial (MRV2_CHUNKED_DELTA_RULE=0) and by default, interleaved
                   for len in ${QN_LENS:-1024 4096}; do for env in 0 1; do
                     MRV2_CHUNKED_DELTA_RULE=$env timeout 140 python3 -m mrv2.entrypoints.cli bench latency \
                       --model Qwen3-Next-80B-A3B --hf-overrides '{"num_hidden_layers": 8}' \
                       --prompt-len $len --new-tokens 8 --batch-sizes 1 --max-model-len 8192 \
                       --json "$OUT/qn_ttft_${len}_$env.json" > "$OUT/qn_ttft_${len}_$env.log" 2>&1
                     python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
                       print(sys.argv[2], sys.argv[3], [(r['batch'], r['ttft_ms'], r['tpot_ms']) \
                       for r in d['default'] if 'batch' in r])" "$OUT/qn_ttft_${len}_$env.json" \
                       "prompt=$len" "chunked=$env" 2>&1 | tail -1
                   done; done ;;
    qwen3nextprof) # Qwen3-Next-80B-A3B cut to 8 layers (random weights): batch-1/8 TPOT, then
                   # profile_decode at batch 1 and 8 (GPU time by kernel: where ~0.5 ms a layer goes)
                   timeout 200 python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-Next-80B-A3B \
                     --hf-overrides '{"num_hidden_layers": 8}' --new-tokens 64 --batch-sizes 1 8 \
                     --json "$OUT/qwen3next_latency.json" > "$OUT/qwen3next_latency.log" 2>&1
                   tail -4 "$OUT/qwen3next_latency.log"
                   for b in 1 8; do
                     timeout 150 python3 scripts/profile_decode.py --model Qwen3-Next-80B-A3B --batch $b \
                       --steps 32 --hf-overrides '{"num_hidden_layers": 8}' --trace "" 2>&1 \
                       | tee "$OUT/qwen3next_prof_b$b.log" | grep -E "wall per step|GPU over|gap " | head -12
                   done ;;
    gluonrs) # scripts/proto_gluon_mxfp4.py --run: MXFP4 weights decoded into wgmma's register
             # A operand (Gluon), checked against the dequantized weights and timed at 16-64 rows
             python3 scripts/proto_gluon_mxfp4.py --check-repack 2>&1 | tail -1
             timeout 200 python3 scripts/proto_gluon_mxfp4.py --run 2>&1 | tee "$OUT/gluonrs.log" | tail -6 ;;
    gemma3vl) # Gemma 3, Gemma 4, Mistral 3, InternVL with images, Gemma 4's text decoder: GPU
              # tests (HF parity with graphs, bidirectional image spans; Gemma 4's MoE on the
              # GeGLU kernels), then
              # mrv2 bench multimodal on gemma-3-4b-it (random weights, 896 x 896 images,
              # batch 1 / 16 / 64) beside its text-only TPOT
              timeout 320 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_gpu_gemma3_images.py tests/gpu/test_gpu_gemma.py \
                tests/gpu/test_gpu_gemma4.py tests/gpu/test_gpu_mistral3.py \
                tests/gpu/test_gpu_internvl.py tests/gpu/test_gpu_llava.py tests/gpu/test_gpu_idefics3.py 2>&1 \
                | tee "$OUT/gemma3vl_tests.log" | tail -3
              timeout 200 python3 -m mrv2.entrypoints.cli bench multimodal --model gemma-3-4b-it \
                --image-size 896 --json "$OUT/gemma3vl_bench.json" > "$OUT/gemma3vl_bench.log" 2>&1
              python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
                print('encoder ms/image', d['encoder_ms_per_image']); \
                [print('image', r) for r in d['with_image']]; \
                [print('text', r) for r in d['text_only']]" "$OUT/gemma3vl_bench.json" ;;
    mmnew) # the forty-first session's multimodal families on CUDA: Llama 4 images, Gemma 4 audio
           timeout 280 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_llama4_images.py \
             tests/gpu/test_gpu_gemma4_audio.py 2>&1 | tee "$OUT/mmnew.log" \
             | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -6 ;;
    gluonprefill) # scripts/proto_gluon_prefill.py --run: FlashAttention-3's schedule in Gluon
                  # (async QK^T, P from registers, softmax overlapping PV), 4 x 1,024 causal,
                  # Qwen3-8B then Qwen3-0.6B heads, beside the Triton TMA kernel
                  for h in "32 8" "16 8"; do
                    timeout 150 python3 scripts/proto_gluon_prefill.py --run --heads $h \
                      ${GLUONPREFILL_ARGS:-} 2>&1 | tee -a "$OUT/gluonprefill.log" | tail -5
                  done ;;
    intdense) # the integer experts' dequantize-first path (mrv2_kernels.int_dense, opt-in:
              # MRV2_INT_DENSE=1) timed beside MXFP4's: scripts/proto_mxfp4_dense.py on
              # Qwen3-30B-A3B-GPTQ's layer then gpt-oss-20b's, with the dense-path kernel tests
              timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe_int.py \
                tests/kernels/test_fused_moe_gpt_oss.py 2>&1 | tee "$OUT/intdense_tests.log" | tail -2
              for layer in Qwen3-30B-A3B-GPTQ gpt-oss-20b; do
                timeout 200 python3 scripts/proto_mxfp4_dense.py --layer $layer --check \
                  --tokens ${INTDENSE_TOKENS:-64 256 1024 2048 4096 8192} 2>&1 \
                  | tee "$OUT/intdense_$layer.log" | grep -v "max |"
              done ;;
    ernie) # ERNIE-4.5-21B-A3B (random bf16 weights): batch-1/8/64 TPOT (mrv2 bench latency)
           timeout 200 python3 -m mrv2.entrypoints.cli bench latency --model ERNIE-4.5-21B-A3B \
             --new-tokens 256 --json "$OUT/ernie_latency.json" > "$OUT/ernie_latency.log" 2>&1
           python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print('ERNIE-4.5-21B-A3B', \
             k, [(r['batch'], r['tpot_ms'], r.get('floor_fraction')) for r in v]) \
             for k, v in d.items() if isinstance(v, list)]" "$OUT/ernie_latency.json" ;;
    gptoss) # gpt-oss-20b (MXFP4 experts, random weights): its GPU and kernel tests on CUDA,
            # then batch-1/8/64 TPOT (mrv2 bench latency) and the throughput workload
            timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
              tests/gpu/test_gpu_int_quant.py -k gpt_oss 2>&1 | tee "$OUT/gptoss_gpu_tests.log" | tail -2
            timeout 150 python3 -m pytest -q -p no:cacheprovider \
              tests/kernels/test_fused_moe_gpt_oss.py 2>&1 | tee "$OUT/gptoss_kernel_tests.log" | tail -2
            timeout 200 python3 -m mrv2.entrypoints.cli bench latency --model ${GPTOSS_MODEL:-gpt-oss-20b} \
              --new-tokens 256 --json "$OUT/gptoss_latency.json" > "$OUT/gptoss_latency.log" 2>&1
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print('gpt-oss-20b', \
              k, [(r['batch'], r['tpot_ms'], r.get('floor_fraction')) for r in v]) \
              for k, v in d.items() if isinstance(v, list)]" "$OUT/gptoss_latency.json"
            [ -n "${GPTOSS_THROUGHPUT:-}" ] && timeout 240 python3 -m mrv2.entrypoints.cli bench \
              throughput --model ${GPTOSS_MODEL:-gpt-oss-20b} --json "$OUT/gptoss_throughput.json" \
              > "$OUT/gptoss_throughput.log" 2>&1; tail -5 "$OUT/gptoss_throughput.log" 2>/dev/null ;;
    sleep) # mrv2 bench sleep: sleep / wake_up seconds and the memory given back, Qwen3-0.6B
           # and Qwen3-8B (dummy weights; two level-1 rounds, then one at level 2)
           for m in Qwen3-0.6B Qwen3-8B; do
             timeout 240 python3 -m mrv2.entrypoints.cli bench sleep --model $m \
               --json "$OUT/sleep_$m.json" > "$OUT/sleep_$m.log" 2>&1
             python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print(sys.argv[2], \
               r) for r in d['rounds']]" "$OUT/sleep_$m.json" $m
           done ;;
    servelong) # long answers through mrv2 serve (the twenty-ninth session's delta outputs):
               # 256 streams at once of 2,048 tokens, Qwen3-0.6B; with .whl-old (a baseline's
               # wheels, built as scripts/ab_bench.sh says) the baseline first, then this tree
               for side in old new; do
                 site=/tmp/site
                 if [ "$side" = old ]; then
                   [ -d .whl-old ] || continue
                   site=/tmp/site-old
                   [ -d $site ] || python3 -m pip install -q --no-index --no-deps --no-compile \
                     --no-cache-dir --target $site .whl-old/*.whl $(ls .whl/*.whl | grep -v "/mrv2")
                 fi
                 PYTHONPATH=$site timeout 280 python3 scripts/serve_sweep.py --model Qwen3-0.6B \
                   --out "$OUT/long_$side" --variants plain --rates inf --num-requests 256 \
                   --prompt-tokens 300 --max-tokens 2048 --warmup-requests 16 \
                   > "$OUT/long_$side.log" 2>&1; echo "== $side"; tail -3 "$OUT/long_$side.log"
               done ;;
    structuredspec) # the same with n-gram speculation (constrained requests verify drafts,
                    # a mask a logits row), the plain schema at 8 and 64 requests
                    timeout 400 python3 scripts/probe_structured.py --tokenizer .whl/smollm2 \
                      --model .whl/qwen3s --requests 8 64 --schemas plain \
                      --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' \
                      --json "$OUT/structured_spec.json" 2>&1 | tee "$OUT/structured_spec.log" \
                      | tail -8 ;;
    structured) # structured outputs under load (scripts/probe_structured.py): masks filled
                # during the forward against each request waiting for its token, and free;
                # the tokenizer: .whl/smollm2 (SmolLM2's, copied from the converted default model)
                timeout 400 python3 scripts/probe_structured.py --tokenizer .whl/smollm2 \
                  ${STRUCTURED_ARGS:-} --json "$OUT/structured.json" 2>&1 \
                  | tee "$OUT/structured.log" | tail -8 ;;
    profile) python3 scripts/profile_decode.py --batch 1 ${PROFILE_ARGS:-} 2>&1 \
               | tee "$OUT/profile_b1.log" | tail -60 ;;
    videos) # the forty-second session's Qwen-VL videos on CUDA (written, not yet run then):
            # fp32 tokens with graphs and eager equal the CPU engine's, bf16 graphs on/off,
            # a video split across steps never synchronizes; then Gemma 4 with shared pages
            timeout 400 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen_vl_video.py \
              tests/gpu/test_gpu_gemma4_video.py \
              2>&1 | tee "$OUT/videos.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -8
            timeout 180 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_gemma4.py \
              2>&1 | tee "$OUT/gemma4_pages.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -8 ;;
    verify42) # the forty-second session's changes on CUDA: the sampling kernel's tables and
              # the sampler's GPU tests, Llama 4 (chunked tables), its images and Gemma 4
              # audio (the shared no-sync drill), Qwen-VL's drill
              timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gumbel.py 2>&1 \
                | tee "$OUT/v42_gumbel.log" | tail -1
              timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_sampler.py \
                2>&1 | tee "$OUT/v42_sampler.log" | tail -2
              timeout 170 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_llama4.py \
                tests/gpu/test_gpu_llama4_images.py tests/gpu/test_gpu_gemma4_audio.py \
                tests/gpu/test_gpu_qwen_vl.py -k "llama4 or gemma4_audio or never_synchronize" 2>&1 \
                | tee "$OUT/v42_gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -14 ;;
    verify42b) # what verify42's call left: the sampling kernel's test on CUDA, Gemma 4 audio
               # (TF32 convolutions off for fp32 parity; the shared drill), Qwen-VL's drill
               timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gumbel.py 2>&1 \
                 | tee "$OUT/v42b_gumbel.log" | tail -1
               timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_gemma4_audio.py \
                 tests/gpu/test_gpu_qwen_vl.py -k "gemma4_audio or never_synchronize" 2>&1 \
                 | tee "$OUT/v42b_gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -6 ;;
    earlyab) # the forty-second session: the state kernels' metadata and state before the PDL
             # wait, on CUDA (their kernel tests, the hybrid families' GPU tests), then
             # Qwen3-Next cut to 8 layers at batch 1, MRV2_PDL_EARLY_META=0 / default, twice
             timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_attention.py \
               tests/kernels/test_state_snapshots.py tests/kernels/test_state_row_slots.py 2>&1 \
               | tee "$OUT/early_kernel_tests.log" | tail -2
             timeout 230 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_qwen3_next.py \
               tests/gpu/test_gpu_nemotron_h.py tests/gpu/test_gpu_mamba2.py 2>&1 \
               | tee "$OUT/early_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -14
             for r in 1 2; do for e in 0 1; do
               MRV2_PDL_EARLY_META=$e timeout 90 python3 scripts/profile_decode.py --model Qwen3-Next-80B-A3B \
                 --batch 1 --steps 64 --hf-overrides '{"num_hidden_layers": 8}' --trace "" 2>&1 \
                 | tee "$OUT/early_prof_${e}_$r.log" | grep -E "wall per step" | sed "s/^/early=$e: /"
             done; done ;;
    b1where) # the forty-second session: where a batch-1 Qwen3-0.6B step goes beyond its decode
             # graph (the graph's replay against the step's wall time): TPOT, the graph's
             # replay and kernels, the host's parts and Python profile, a kernel trace
             python3 -m mrv2.entrypoints.cli bench latency --batch-sizes 1 --json "$OUT/b1_latency.json" \
               2>&1 | tee "$OUT/b1_latency.log" | tail -4
             timeout 200 python3 scripts/decode_graph_times.py --max-size 8 --passes 3 --profile 1 \
               2>&1 | tee "$OUT/b1_graph_times.log" | tail -30
             timeout 200 python3 scripts/profile_decode.py --batch 1 --steps 64 --host-breakdown \
               --cprofile --trace "$OUT" 2>&1 | tee "$OUT/b1_profile.log" \
               | grep -E "wall per step|host |GPU over|gap " ;;
    flatgrid) # MRV2_ATTN_FLAT_GRID (paged attention's flat grid for prefill plans): the
              # workload-like mixed step through both grids, then the throughput A/B
              python3 -m mrv2_kernels.bench_attention --no-decode 2>&1 \
                | tee "$OUT/attn_mixed.log" | grep -E "^mixed step"
              ROUNDS=${ROUNDS:-2} bash scripts/ab_env.sh MRV2_ATTN_FLAT_GRID=0 throughput \
                --model Qwen3-0.6B
              ROUNDS=1 bash scripts/ab_env.sh MRV2_ATTN_FLAT_GRID=0 throughput --model Qwen3-8B ;;
    mixedgraphs) # steps with prompt tokens in CUDA graphs (max_mixed_graph_tokens): small
                 # mixed steps (a 512-token budget, 64 decoding) eager and in graphs, then the
                 # throughput workload with them up to its budget (the default) / eager / up to 512 tokens
                 for cap in 0 512; do timeout 150 python3 scripts/profile_mixed.py \
                   --max-num-batched-tokens 512 --prompt-lens 100 400 --decoding 64 \
                   --steps 8 --max-mixed-graph-tokens $cap 2>&1 | tee "$OUT/mixed512_cap$cap.log" \
                   | grep -E "host phases|^[a-zA-Z0-9.-]+, " ; done
                 for run in "Qwen3-0.6B:240:--full-warmup --variants default mixed_graphs_off mixed_graphs_512" \
                            "Qwen3-8B:300:--variants default mixed_graphs_512"; do
                   m=${run%%:*}; rest=${run#*:}; limit=${rest%%:*}; json="$OUT/mg_throughput_$m.json"
                   timeout "$limit" python3 -m mrv2.entrypoints.cli bench throughput --model "$m" \
                     ${rest#*:} --json "$json" > "${json%.json}.log" 2>&1
                   grep -E "^(default|mixed_graphs)" "${json%.json}.log"
                   python3 -c "import json, sys; [print(sys.argv[1], k, v['output_tok_s'], \
                     v.get('roofline_fraction')) for k, v in json.load(open(sys.argv[2])).items() \
                     if isinstance(v, dict) and 'output_tok_s' in v]" "$m" "$json"
                 done ;;
    mlaflat) # MRV2_MLA_FLAT_GRID (the MLA kernel over the step's query tiles, the default;
             # DeepSeek's prompt steps replay the mixed graphs): its CUDA tests with the old
             # (query tile, request) grid, then the throughput A/B whose "on" is the old grid
             MRV2_MLA_FLAT_GRID=0 timeout 150 python3 -m pytest -q -p no:cacheprovider \
               tests/kernels/test_mla_attention.py 2>&1 | tee "$OUT/mla_grid_tests.log" | tail -2
             MRV2_MLA_FLAT_GRID=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
               tests/gpu/test_gpu_fp8_mla.py tests/gpu/test_gpu_mtp.py 2>&1 \
               | tee "$OUT/mla_grid_gpu_tests.log" | tail -2
             ROUNDS=${ROUNDS:-1} timeout 400 bash scripts/ab_env.sh MRV2_MLA_FLAT_GRID=0 \
               throughput --model DeepSeek-V2-Lite ;;
    servestreams) # mrv2 serve's streams: 256 requests of ~300 prompt tokens, 128 output tokens,
                 # at 64/s and at once, Qwen3-0.6B (23rd session: 9.4-14.3k tok/s at once, the
                 # server's own TPOT 13-19 ms; the sweeps before it measured the old httpx client)
                 timeout 300 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/streams" \
                   --variants plain --rates 64 inf --num-requests 256 \
                   --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                   > "$OUT/streams.log" 2>&1; tail -4 "$OUT/streams.log" ;;
    serveprof) # where mrv2 serve's threads spend 256 streams at once (Qwen3-0.6B): the
               # stack sampler (MRV2_SERVE_PROFILE) of the server's process and of the engine's (.engine)
               timeout 300 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/prof" \
                 --variants "plain+MRV2_SERVE_PROFILE=$OUT/serveprof_plain.txt" --rates inf \
                 --num-requests 256 --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                 > "$OUT/serveprof.log" 2>&1; tail -3 "$OUT/serveprof.log"
               for f in "$OUT/serveprof_plain.txt" "$OUT/serveprof_plain.txt.engine"; do
                 echo "== $f"; grep -B1 -A14 "== thread" "$f" | grep -v " 100.0%" | head -50
               done ;;
    serveclients) # 256 Qwen3-0.6B streams at once read by 1 client process, then by 4; the
                  # server's own TPOT / TTFT beside
                  for c in 1 4; do
                    timeout 250 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/clients$c" \
                      --variants plain --rates inf --num-requests 256 --prompt-tokens 300 \
                      --max-tokens 128 --warmup-requests 32 --clients $c \
                      > "$OUT/serveclients$c.log" 2>&1; tail -5 "$OUT/serveclients$c.log"
                  done ;;
    streaminterval) # --stream-interval 1 / 4 / 16 on the servestreams load at once (Qwen3-0.6B)
                    timeout 280 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/interval" \
                      --variants plain stream_interval_4 stream_interval_16 --rates inf inf \
                      --num-requests 256 --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                      > "$OUT/interval.log" 2>&1; tail -7 "$OUT/interval.log" ;;
    gcgen0)   # MRV2_GC_GEN0_THRESHOLD=20000 (young collections 10-30x rarer) against Python's
              # own, both processes frozen: 256 Qwen3-0.6B streams at once, three rounds per
              # server, the collector's pauses (GC ms) beside
              timeout 300 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/gen0" \
                --variants plain plain+MRV2_GC_GEN0_THRESHOLD=20000 --rates inf inf inf \
                --num-requests 256 --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                > "$OUT/gen0.log" 2>&1; tail -8 "$OUT/gen0.log" ;;
    gcfreeze) # the startup heap frozen (the default) or not (MRV2_GC_FREEZE=0), the engine in a
              # process of its own (the default) and on a thread: 256 Qwen3-0.6B streams at
              # once, three rounds per server, the collector's pauses (GC ms) beside; then the
              # offline throughput workload's pauses (an LLM does not freeze)
              timeout 420 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/gc" \
                --variants plain plain+MRV2_GC_FREEZE=0 engine_thread \
                engine_thread+MRV2_GC_FREEZE=0 --rates inf inf inf --num-requests 256 \
                --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                > "$OUT/gc.log" 2>&1; tail -14 "$OUT/gc.log"
              timeout 150 python3 -m mrv2.entrypoints.cli bench throughput --model Qwen3-0.6B \
                --json "$OUT/gc_throughput.json" > "$OUT/gc_throughput.log" 2>&1
              grep -E "garbage|^default " "$OUT/gc_throughput.log"
              grep -o '"output_tok_s": [0-9.]*' "$OUT/gc_throughput.json" ;;
    serveprocess) # --engine-process (the engine in a child process) against the engine thread,
                  # each also at --stream-interval 4: 256 Qwen3-0.6B streams at once, three
                  # rounds per server (one serve run decides nothing)
                  timeout 540 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/process" \
                    --variants engine_thread engine_process engine_thread_stream_interval_4 \
                    engine_process_stream_interval_4 --rates inf inf inf --num-requests 256 \
                    --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                    > "$OUT/process.log" 2>&1; tail -14 "$OUT/process.log" ;;
    servegraphs) # mrv2 serve with steps with prompt tokens eager / in graphs (the default):
                 # 256 requests of ~300 prompt tokens, 128 output tokens, at 64/s and at once
                 timeout 280 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/sweep" \
                   --variants mixed_graphs_0 plain --rates 64 inf --num-requests 256 \
                   --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                   > "$OUT/sweep.log" 2>&1; tail -6 "$OUT/sweep.log" ;;
    padding) # what padding rows cost: the routed experts with / without valid_tokens
             # (scripts/moe_padding.py), a large model's mixed steps eager against their graphs
             # at the padded counts (scripts/mixed_padding.py), the MoE kernel tests on CUDA
             timeout 120 python3 scripts/moe_padding.py 2>&1 | tee "$OUT/moe_padding.log" | tail -7
             timeout 200 python3 scripts/mixed_padding.py --model Qwen3-8B 2>&1 \
               | tee "$OUT/mixed_padding.log" | grep -v Warning | tail -12
             timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
               2>&1 | tee "$OUT/moe_kernel_tests.log" | tail -2 ;;
    onetoken) # MRV2_ATTN_ONE_TOKEN_APART (a prefill plan's one-token requests in a launch of
              # their own, the decode plan's tiles; by default for 128-row prefill tiles): the
              # mixed step both ways, the paged-attention and engine tests on CUDA with it
              # forced on (=1: the tests' small models have 64-row tiles), then the throughput
              # A/B whose "on" is the single launch (=0)
              timeout 200 python3 -m mrv2_kernels.bench_attention --no-decode \
                > "$OUT/attn_one_token.log" 2>&1; grep -E "^(prefill|mixed)" "$OUT/attn_one_token.log"
              MRV2_ATTN_ONE_TOKEN_APART=1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
                tests/kernels/test_paged_attention.py 2>&1 | tee "$OUT/pa_tests.log" | tail -2
              for m in ${ONE_TOKEN_MODELS:-Qwen3-8B}; do ROUNDS=${ROUNDS:-1} timeout 300 bash \
                scripts/ab_env.sh MRV2_ATTN_ONE_TOKEN_APART=0 throughput --model $m; done
              MRV2_ATTN_ONE_TOKEN_APART=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/gpu/test_gpu_engine.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2 ;;
    serve8b) # mrv2 serve, Qwen3-8B, ~1,500-token prompts and 128 output tokens (steps with
             # prompt tokens of 1,500-8,192 tokens beside the decoding requests): the default,
             # one-token requests in query tiles, and the measured cut
             timeout 560 python3 scripts/serve_sweep.py --model Qwen3-8B --out "$OUT/serve8b" \
               --variants plain plain+MRV2_ATTN_ONE_TOKEN_APART=0 \
               plain+MRV2_MIXED_GRAPHS_MEASURED=1 --rates 8 16 inf --num-requests 128 \
               --prompt-tokens 1500 --max-tokens 128 --warmup-requests 16 \
               > "$OUT/serve8b.log" 2>&1; tail -10 "$OUT/serve8b.log" ;;
    measuredcut) # MRV2_MIXED_GRAPHS_MEASURED=1 (keep the mixed graphs whose replay beats an
                 # eager step's host time): the graphs each size keeps, then the 8B throughput A/B
                 for m in Qwen3-0.6B Qwen3-8B; do MRV2_MIXED_GRAPHS_MEASURED=1 timeout 150 python3 \
                   scripts/graph_startup.py --model $m --caps default 2>&1 \
                   | tee -a "$OUT/measured_startup.log" | grep -E "graphs|eager"; done
                 ROUNDS=${ROUNDS:-1} timeout 300 bash scripts/ab_env.sh MRV2_MIXED_GRAPHS_MEASURED=1 \
                   throughput --model Qwen3-8B ;;
    servespec) # the same sweep with n-gram speculation (3 drafts, synthetic acceptance 0.9):
               # steps with prompt tokens eager against graphs (up to 512 tokens with a speculator)
               timeout 280 python3 scripts/serve_sweep.py --model Qwen3-0.6B --out "$OUT/sweep_spec" \
                 --variants ngram_on_mixed_graphs_0 ngram_on --rates 64 inf --num-requests 256 \
                 --prompt-tokens 300 --max-tokens 128 --warmup-requests 32 \
                 > "$OUT/sweep_spec.log" 2>&1; tail -6 "$OUT/sweep_spec.log" ;;
    mixed) # the throughput workload's mixed steps: host phases and host time by module, then
           # GPU time by kernel (scripts/profile_mixed.py), on both bundled Qwen3 sizes
           for m in Qwen3-0.6B Qwen3-8B; do python3 scripts/profile_mixed.py --model $m \
             --decoding 16 --steps 3 --host-modules 2>&1 | tee "$OUT/mixed_$m.log" \
             | grep -E "host phases|^[a-zA-Z0-9.-]+, " ; done ;;
    normgemv) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_norm_gemv.py 2>&1 \
                | tail -3
              python3 -m mrv2_kernels.bench_norm_gemv ${NORMGEMV_ARGS:-} 2>&1 \
                | tee "$OUT/norm_gemv.log" | tail -24 ;;
    skinny) python3 -m mrv2_kernels.bench_skinny ${SKINNY_ARGS:-} 2>&1 | tee "$OUT/skinny.log" \
              | tail -40 ;;
    longdecode) python3 scripts/sweep_long_decode.py ${LONGDECODE_ARGS:-} 2>&1 \
                  | tee "$OUT/long_decode.log" | tail -60 ;;
    splits) python3 scripts/sweep_decode_splits.py 2>&1 | tee "$OUT/splits.log" | tail -8 ;;
    moe) python3 -m mrv2_kernels.bench_moe --json "$OUT/moe_kernel.json" 2>&1 \
           | tee "$OUT/moe_kernel.log" | tail -24 ;;
    attn) python3 -m mrv2_kernels.bench_attention ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attn.log" \
            | sed -n '/^summary:/,$p' ;;
    throughput) python3 -m mrv2.entrypoints.cli bench throughput --json "$OUT/throughput.json" \
                  ${THROUGHPUT_ARGS:-} 2>&1 | tee "$OUT/throughput.log" | tail -40 ;;
    soak) python3 scripts/soak.py --model Qwen3-0.6B --duration "${SOAK_S:-450}" \
            --max-concurrency 128 --out "$OUT/soak" 2>&1 | tee "$OUT/soak.log" | tail -20 ;;
    multimodal) python3 -m mrv2.entrypoints.cli bench multimodal --json "$OUT/multimodal.json" \
                  ${MULTIMODAL_ARGS:-} 2>&1 | tee "$OUT/multimodal.log" | tail -40 ;;
    tp_tests) python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_tensor_parallel.py \
                2>&1 | tee "$OUT/tp_tests.log" | tail -15
              python3 -m mrv2.entrypoints.cli bench tp-channel --json "$OUT/tp_channel.json" 2>&1 \
                | tee "$OUT/tp_channel.log" | tail -10 ;;
    tp_latency) for run in ${TP_RUNS:-Qwen3-8B:1 Qwen3-8B:2 Qwen3-32B:2}; do  # model:tp
                  m=${run%%:*}; tp=${run##*:}
                  python3 -m mrv2.entrypoints.cli bench latency --model "$m" --tensor-parallel-size "$tp" \
                    --json "$OUT/tp_latency_${m}_tp$tp.json" ${TP_LATENCY_ARGS:-} 2>&1 \
                    | tee "$OUT/tp_latency_${m}_tp$tp.log" | tail -12
                done ;;
    tp_profile) for b in ${TP_PROFILE_BATCHES:-1 64}; do  # rank 0's kernels, the NCCL share
                  python3 scripts/profile_decode.py --model "${TP_MODEL:-Qwen3-8B}" --batch "$b" \
                    --tensor-parallel-size "${TP:-2}" --trace "" 2>&1 \
                    | tee "$OUT/tp_profile_b$b.log" | sed -n '1,/^---/p' | head -24
                done ;;
    tp_throughput) python3 -m mrv2.entrypoints.cli bench throughput --model "${TP_MODEL:-Qwen3-32B}" \
                     --tensor-parallel-size 2 --json "$OUT/tp_throughput.json" 2>&1 \
                     | tee "$OUT/tp_throughput.log" | tail -30 ;;
    glm47) python3 scripts/serve_sweep.py --model GLM-4.7-FP8 --out "$OUT/glm47" \
             --server-args "--tensor-parallel-size ${TP:-4} --max-model-len 4096 ${GLM47_ARGS:-}" \
             --variants ${GLM47_VARIANTS:-mtp_off mtp_on async_off mtp_on_async_off} 2>&1 \
             | tee "$OUT/glm47.log" | tail -24 ;;
    verify54) # the fifty-fourth session's work within VERIFY_S seconds (default 560): the DSA
              # kernels' tests on CUDA (the indexer's top-k), their bench against torch.topk over
              # max_model_len, DeepSeek-V3.2 / GLM-5's GPU tests, the session's new families
              # (VERIFY54_NEW), then verify53's list (VERIFY53) in what is left
              end=$(( $(date +%s) + ${VERIFY_S:-560} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 60)" python3 -m pytest -v -p no:cacheprovider tests/kernels/test_sparse_mla.py \
                2>&1 | tee "$OUT/kernels54.log" | grep -E "^FAILED|^ERROR| passed| failed" | tail -4 \
                | sed "s/^/kernels54: /"
              timeout "$(left 90)" python3 -m mrv2_kernels.bench_dsa_indexer 2>&1 \
                | tee "$OUT/bench_dsa_indexer.log" | tail -12
              for item in dsa: ${VERIFY54_NEW:-engine_process_zygote: cohere2_moe: cohere2_vision: step3: qwen3_next:quantized,lora} \
                  ${VERIFY53:-aya_vision:bf16 mamba1:Jamba kimi: qwen_vl:qwen3.5 mamba2:zamba2 llama_variants: moe:Glm4Moe,GraniteMoeSWA,Longcat,Phimoe,Qwen3Moe,SolarOpen fp8_mla:youtu}; do
                t=${item%%:*}; k=${item#*:}; k=${k//,/ or }
                [ -f "tests/gpu/test_gpu_$t.py" ] || { echo "$t: no tests/gpu/test_gpu_$t.py"; continue; }
                [ "$(left 20)" -lt 15 ] && { echo "$t: no time left"; continue; }
                timeout "$(left "${VERIFY_CAP:-150}")" python3 -m pytest -v -p no:cacheprovider -m gpu \
                  "tests/gpu/test_gpu_$t.py" ${k:+-k "$k"} 2>&1 | tee "$OUT/gpu54_$t.log" \
                  | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/$t: /"
              done ;;
    verify53) # what the fifty-third session's two calls left, within VERIFY_S seconds (default
              # 560): the cases its per-file caps cut (Jamba, Kimi-Linear: a larger cap; Qwen3.5
              # images, Zamba2, the Llama variants, the rest of the MoE file, Youtu's FP8 MLA),
              # and its two test fixes (Aya bf16, the DSA FP8 case); VERIFY53 overrides the list
              end=$(( $(date +%s) + ${VERIFY_S:-560} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              for item in ${VERIFY53:-dsa:fp8 aya_vision:bf16 mamba1:Jamba kimi: qwen_vl:qwen3.5 mamba2:zamba2 llama_variants: moe:Glm4Moe,GraniteMoeSWA,Longcat,Phimoe,Qwen3Moe,SolarOpen fp8_mla:youtu}; do
                t=${item%%:*}; k=${item#*:}; k=${k//,/ or }  # (commas: -k alternatives)
                [ "$(left 20)" -lt 15 ] && { echo "$t: no time left"; continue; }
                timeout "$(left "${VERIFY_CAP:-240}")" python3 -m pytest -v -p no:cacheprovider -m gpu \
                  "tests/gpu/test_gpu_$t.py" ${k:+-k "$k"} 2>&1 | tee "$OUT/gpu53_$t.log" \
                  | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/$t: /"
              done ;;
    verify52) # the fifty-second session's work on CUDA within VERIFY_S seconds (default 560), most
              # wanted first: the new kernels' tests (selective scan, sparse MLA), then the GPU
              # test files VERIFY_TESTS names (each capped at VERIFY_CAP seconds, -v so a failure
              # has its name): Mamba-1 / FalconMamba / Jamba, DeepSeek-V3.2 / GLM-5, Kimi-Linear, the Qwen-VL
              # file with Qwen3.5's images, the MoE file with K-EXAONE / AFMoE / Solar Open
              end=$(( $(date +%s) + ${VERIFY_S:-560} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 90)" python3 -m pytest -v -p no:cacheprovider tests/kernels/test_selective_scan.py \
                tests/kernels/test_sparse_mla.py 2>&1 | tee "$OUT/kernels52.log" \
                | grep -E "^FAILED|^ERROR| passed| failed" | tail -4 | sed "s/^/kernels52: /"
              for t in ${VERIFY_TESTS:-mamba1 dsa kimi qwen_vl moe gemma3n lfm2_vl olmo_hybrid mamba2 minimax aya_vision mtp llama_variants}; do
                [ -f "tests/gpu/test_gpu_$t.py" ] || { echo "$t: no tests/gpu/test_gpu_$t.py"; continue; }
                [ "$(left 20)" -lt 15 ] && { echo "$t: no time left"; continue; }
                timeout "$(left "${VERIFY_CAP:-120}")" python3 -m pytest -v -p no:cacheprovider -m gpu \
                  "tests/gpu/test_gpu_$t.py" ${VERIFY_K:+-k "$VERIFY_K"} 2>&1 | tee "$OUT/gpu_$t.log" \
                  | grep -E "^FAILED|^ERROR|FAILED|passed|failed" | tail -4 | sed "s/^/$t: /"
              done ;;
    verify51) # the fifty-first session's work on CUDA within VERIFY_S seconds (default 560): the
              # LayerNorm kernel's tests, then the GPU test files VERIFY_TESTS names (default: the
              # session's new families and the tests its changes touch; each capped at VERIFY_CAP
              # seconds, -v so a failure has its name), then Qwen3-0.6B's batch-1 TPOT
              end=$(( $(date +%s) + ${VERIFY_S:-560} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_layer_norm.py \
                2>&1 | tee "$OUT/layer_norm.log" | tail -1 | sed "s/^/layer_norm kernel: /"
              for t in ${VERIFY_TESTS:-neox starcoder llama_variants glm4v lfm2 cohere moe idefics3}; do
                [ -f "tests/gpu/test_gpu_$t.py" ] || { echo "$t: no tests/gpu/test_gpu_$t.py"; continue; }
                [ "$(left 20)" -lt 15 ] && { echo "$t: no time left"; continue; }
                timeout "$(left "${VERIFY_CAP:-120}")" python3 -m pytest -v -p no:cacheprovider -m gpu \
                  "tests/gpu/test_gpu_$t.py" 2>&1 | tee "$OUT/gpu_$t.log" \
                  | grep -E "^FAILED|^ERROR|FAILED|passed|failed" | tail -4 | sed "s/^/$t: /"
              done
              [ "$(left 60)" -ge 50 ] && { timeout "$(left 60)" python3 -m mrv2.entrypoints.cli bench latency \
                --model Qwen3-0.6B --batch-sizes 1 --new-tokens 128 --json "$OUT/latency_06b.json" \
                > "$OUT/latency_06b.log" 2>&1; grep -E "tpot_ms" "$OUT/latency_06b.log" | head -1; } ;;
    verify51b) # after verify51, within VERIFY_S seconds (default 330), most wanted first: the
               # LayerNorm and padded-head attention kernel tests on CUDA, the padded-head GPT-NeoX /
               # StableLM GPU cases, GLM-4.1V / 4.5V's GPU tests, the paged-attention kernel tests,
               # LFM2-MoE's no-sync test, SmolVLM's bf16 test
               end=$(( $(date +%s) + ${VERIFY_S:-330} ))
               left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
               run() { local name=$1 cap=$2; shift 2; [ "$(left 20)" -lt 15 ] && { echo "$name: no time left"; return; }
                 timeout "$(left "$cap")" python3 -m pytest -v -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$name.log" \
                   | grep -E "^FAILED|^ERROR| passed| failed" | tail -4 | sed "s/^/$name: /"; }
               run kernels_ln_heads 90 tests/kernels/test_layer_norm.py tests/kernels/test_paged_attention_head_dims.py
               run gpu_neox_new 100 -m gpu tests/gpu/test_gpu_neox.py -k "2.8b or 160 or gptj or phi"
               run gpu_glm4v 100 -m gpu tests/gpu/test_gpu_glm4v.py
               run kernels_paged 60 tests/kernels/test_paged_attention.py
               run gpu_lfm2_moe_sync 40 -m gpu tests/gpu/test_gpu_lfm2.py -k "synchronize and moe"
               run gpu_smolvlm 60 -m gpu tests/gpu/test_gpu_idefics3.py -k "bf16 and smolvlm" ;;
    quick49) # what ~2 minutes of a fresh machine can show: the default prefill grid on 8B heads
             # (4 x 1,024 causal: now the (tile, request) grid), then packed integer reloads
             timeout 75 python3 -m mrv2_kernels.bench_attention --no-decode --layouts 8B \
               > "$OUT/attn.log" 2>&1; grep -E "causal" "$OUT/attn.log" | head -3
             timeout "${QUICK_S:-60}" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_int_quant.py \
               -k "update_and_reload" 2>&1 | tee "$OUT/gpu_int_reload.log" \
               | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -4 ;;
    targets49) # issue 16's targets within VERIFY_S seconds (default 460), the cheapest first: batch-1
               # TPOT of Qwen3-0.6B, prefill attention on 8B heads (4 x 1,024 causal), then the
               # throughput workload on Qwen3-0.6B and Qwen3-8B (each bench's own table)
               end=$(( $(date +%s) + ${VERIFY_S:-460} ))
               left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
               timeout "$(left 80)" python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B \
                 --batch-sizes 1 --new-tokens 128 --json "$OUT/latency_06b.json" > "$OUT/latency_06b.log" 2>&1
               grep -E "tpot_ms" "$OUT/latency_06b.log" | head -2
               timeout "$(left 70)" python3 -m mrv2_kernels.bench_attention --no-decode --layouts 8B \
                 > "$OUT/attn.log" 2>&1; grep -E "causal" "$OUT/attn.log" | head -3
               for m in Qwen3-0.6B Qwen3-8B; do
                 [ "$(left 60)" -lt 55 ] && break
                 timeout "$(left 170)" python3 -m mrv2.entrypoints.cli bench throughput --model "$m" \
                   --json "$OUT/throughput_$m.json" > "$OUT/throughput_$m.log" 2>&1
                 grep -E "\"output_tok_s\"|floor_fraction" "$OUT/throughput_$m.log" | head -2 | sed "s/^/$m: /"
               done ;;
    verify49) # the forty-ninth session's GPU work, within VERIFY_S seconds (default 560): packed
              # integer weights updated and reloaded under CUDA graphs, gpt-oss's MXFP4 engine
              # test (cut by call 2's cap), then scripts/kernel_audit.py over AUDIT_MODELS
              end=$(( $(date +%s) + ${VERIFY_S:-560} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 170)" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_int_quant.py \
                -k "update_and_reload or gpt_oss" 2>&1 | tee "$OUT/gpu_int_reload.log" \
                | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -6 | sed "s/^/int reload: /"
              timeout "$(left 380)" python3 scripts/kernel_audit.py --models \
                ${AUDIT_MODELS:-Qwen3-8B Qwen3-0.6B Qwen3-30B-A3B:4 gpt-oss-20b:4} > "$OUT/kernel_audit.log" 2>&1
              grep -vE "^-" "$OUT/kernel_audit.log" | cut -c1-150 | tail -30 ;;
    verify48b) # the eight-warp prefill register cap (maxnreg 128: two programs an SM) with the flat
               # grid's per-step order: the prefill bench in both orders, the engine's GPU tests, the
               # structured-outputs and sampler GPU tests (VERIFY_S seconds in all, default 560)
               end=$(( $(date +%s) + ${VERIFY_S:-560} ))
               left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
               timeout "$(left 130)" python3 -m mrv2_kernels.bench_attention --no-decode --layouts 8B 0.6B \
                 --tiles-last > "$OUT/attn.log" 2>&1; grep -E "^order|causal:|^mixed step" "$OUT/attn.log" | head -16
               timeout "$(left 170)" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_engine.py \
                 2>&1 | tee "$OUT/gpu_engine.log" | grep -cE "PASSED" | sed "s/^/engine passed: /"
               grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_engine.log" | tail -4
               # then the session's sampler change (structured outputs' masks before the logprobs)
               for t in structured_outputs sampler; do
                 [ "$(left 30)" -lt 25 ] && break
                 timeout "$(left 120)" python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_gpu_$t.py 2>&1 \
                   | tee "$OUT/gpu_$t.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -4 | sed "s/^/$t: /"
               done ;;
    verify48) # the forty-eighth session's work on CUDA, within VERIFY_S seconds (default 560):
              # the flat grid's order picked per step on the device (the engine's GPU tests, the
              # paged-attention kernel tests compiled, one long prompt's TTFT at 32,000 and 4,000
              # tokens against MRV2_ATTN_TILES_LAST=0, the prefill bench in both orders), then
              # max_model_len auto (-1) through mrv2 bench latency (its start-up line)
              end=$(( $(date +%s) + ${VERIFY_S:-560} ))
              left() { local l=$(( end - $(date +%s) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
              timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_engine.py \
                2>&1 | tee "$OUT/gpu_engine.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/engine: /"
              timeout "$(left 120)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
                2>&1 | tee "$OUT/kernel_paged_attention.log" | grep -E "^FAILED|^ERROR|passed|failed" | tail -4 | sed "s/^/paged kernels: /"
              for L in 32000 4000; do
                [ "$(left 60)" -lt 55 ] && break
                mkdir -p "$OUT/ttft$L"
                OUT="$OUT/ttft$L" TTFT_LEN=$L TTFT_ROUNDS=1 timeout "$(left 130)" bash "$0" ttfttiles 2>&1 \
                  | grep tiles_last | sed "s/^/len $L: /"
              done
              timeout "$(left 100)" python3 -m mrv2_kernels.bench_attention --no-decode --layouts 8B 0.6B \
                --tiles-last > "$OUT/attn.log" 2>&1; grep -E "^order|causal:" "$OUT/attn.log" | head -12
              timeout "$(left 80)" python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B \
                --max-model-len -1 --batch-sizes 1 --new-tokens 16 > "$OUT/auto_len.log" 2>&1
              grep -E "max_model_len auto|tpot|rror" "$OUT/auto_len.log" | head -4 ;;
    ttfttiles) # TTFT of one long prompt (Qwen3-0.6B, TTFT_LEN tokens, default 32,000: attention is
               # most of its prefill) with MRV2_ATTN_TILES_LAST=0 (the old grid order) and unset (the
               # default: the paged flat grid heaviest-first), interleaved TTFT_ROUNDS times (default 2)
               for r in $(seq "${TTFT_ROUNDS:-2}"); do for env in 0 default; do
                 ( [ "$env" = 0 ] && export MRV2_ATTN_TILES_LAST=0
                   timeout 150 python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B \
                     --batch-sizes 1 --prompt-len "${TTFT_LEN:-32000}" --new-tokens 4 --max-model-len 32768 \
                     --json "$OUT/ttft_${env}_$r.json" > "$OUT/ttft_${env}_$r.log" 2>&1 )
                 python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
                   print('tiles_last', sys.argv[2], 'round', sys.argv[3], [(r['batch'], r['ttft_ms']) \
                   for r in d['default'] if 'batch' in r])" "$OUT/ttft_${env}_$r.json" "$env" "$r" 2>&1 | tail -1
               done; done ;;
    latency) python3 -m mrv2.entrypoints.cli bench latency --json "$OUT/latency.json" \
               ${LATENCY_ARGS:-} 2>&1 | tee "$OUT/latency.log" | tail -40 ;;
    tma_prefill) # the TMA prefill kernel (MRV2_TMA_PREFILL=1, off by default): its CUDA tests,
                 # its rate, then the throughput A/B that keeps it off (BENCHMARKS 2026-12-02)
                 MRV2_TMA_PREFILL=1 python3 -m pytest -q -p no:cacheprovider -m gpu \
                   tests/gpu/test_gpu_engine.py 2>&1 | tee "$OUT/tma_engine_tests.log" | tail -3
                 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_attention.py \
                   2>&1 | tee "$OUT/tma_kernel_tests.log" | tail -3
                 python3 -m mrv2_kernels.bench_attention --no-decode --layouts 8B \
                   > "$OUT/tma_attn.log" 2>&1; tail -5 "$OUT/tma_attn.log"
                 ROUNDS=${ROUNDS:-1} bash scripts/ab_env.sh MRV2_TMA_PREFILL=1 throughput \
                   --model "${TMA_MODEL:-Qwen3-8B}" ;;
    coldstart)  # the first requests after start-up on an empty Triton cache, each kind alone:
                # wall ms and what compiled (scripts/probe_cold_start.py), the engine's start-up
                # warm-up off, then on (each run with a fresh cache)
                for w in no-warmup warmup; do timeout 280 python3 scripts/probe_cold_start.py \
                  --$w > "$OUT/cold_start_$w.log" 2>&1; tail -18 "$OUT/cold_start_$w.log"; done ;;
    verify26)   # the twenty-sixth session's CPU-only work, checked in one call (~6 min): the
                # cold start with the warm-up (penalties warmed too), the engine, sampler and
                # Qwen-VL GPU tests (the encoder in the memory profile), and a latency run
                # whose log shows the start-up report (graph counts and memory on the H200)
                timeout 200 python3 scripts/probe_cold_start.py --warmup \
                  > "$OUT/cold_start_warmup.log" 2>&1; tail -18 "$OUT/cold_start_warmup.log"
                timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu \
                  tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_sampler.py \
                  tests/gpu/test_gpu_qwen_vl.py 2>&1 | tee "$OUT/verify26_tests.log" | tail -4
                timeout 120 python3 -m mrv2.entrypoints.cli bench latency --model Qwen3-0.6B \
                  --batch-sizes 1 8 > "$OUT/verify26_latency.log" 2>&1
                grep -E "mrv2.runner|engine ready|warm-up" "$OUT/verify26_latency.log" | cut -c1-220
                tail -6 "$OUT/verify26_latency.log" ;;
    startup)    # where an engine's start-up goes (scripts/probe_startup.py under cProfile), on
                # an empty Triton cache, then a warm one: the report's parts and what is between
                # (a third run creates the CUDA context first, timed apart from the profile)
                for i in 1 2 3; do timeout 200 python3 scripts/probe_startup.py --top 40 \
                  $([ $i = 3 ] && echo --cuda-first) > "$OUT/startup_$i.log" 2>&1
                  grep -E "^imports|^CUDA|LLMEngine|INFO" "$OUT/startup_$i.log" | cut -c1-200; done ;;
    firststeps) # where TTFT goes, step by step and by host part (scripts/probe_first_steps.py),
                # with MRV2_PDL_GEMM off and on (the nineteenth session's TTFT rise with it on
                # did not recur in the twentieth)
                for v in 0 1; do MRV2_PDL_GEMM=$v timeout 150 python3 scripts/probe_first_steps.py \
                  > "$OUT/first_steps_pdl_gemm$v.log" 2>&1; grep -E "round 1" "$OUT/first_steps_pdl_gemm$v.log"; done ;;
    streamk)    # a persistent stream-K GEMM against cuBLAS on Qwen3-8B's decode products
                # (scripts/proto_streamk.py): its check on CUDA, then the sweep
                timeout 150 python3 scripts/proto_streamk.py --check > "$OUT/streamk_check.log" 2>&1
                tail -2 "$OUT/streamk_check.log"
                timeout 420 python3 scripts/proto_streamk.py > "$OUT/streamk.log" 2>&1
                tail -14 "$OUT/streamk.log" ;;
    graphtimes) # every decode graph's replay time by batch size, Qwen3-0.6B and Qwen3-8B
                # (scripts/decode_graph_times.py: a size slower than a larger one)
                for m in Qwen3-0.6B Qwen3-8B; do timeout 250 python3 scripts/decode_graph_times.py \
                  --model $m --profile 8 16 > "$OUT/graph_times_$m.log" 2>&1
                  grep -A40 "^ size" "$OUT/graph_times_$m.log"
                  # 2 rows without the fused norm + GEMV (+23% / +10% over 1 row with it)
                  timeout 150 python3 scripts/decode_graph_times.py --model $m --max-size 8 \
                    --norm-gemv-max-m 1 > "$OUT/graph_times_${m}_gemv1.log" 2>&1
                  grep -A5 "^ size" "$OUT/graph_times_${m}_gemv1.log"
                  timeout 150 python3 scripts/decode_graph_times.py --model $m --max-size 8 \
                    --norm-gemv-max-m 1 --pdl-gemm-min-m 2 > "$OUT/graph_times_${m}_pdl2.log" 2>&1
                  grep -A5 "^ size" "$OUT/graph_times_${m}_pdl2.log"; done ;;
    pdlchain)   # Triton GEMMs with PDL (early weight loads, the SwiGLU fused) against cuBLAS in
                # the decode layer's chain at 32-256 rows (scripts/proto_pdl_chain.py)
                timeout 120 python3 scripts/proto_pdl_chain.py --check > "$OUT/pdl_chain_check.log" 2>&1
                tail -1 "$OUT/pdl_chain_check.log"
                timeout 420 python3 scripts/proto_pdl_chain.py ${CHAIN_ARGS:-} > "$OUT/pdl_chain.log" 2>&1
                tail -10 "$OUT/pdl_chain.log" ;;
    gemm_proto) # a Triton TMA GEMM (and gate/up with the SwiGLU fused) against cuBLAS at 64-256
                # rows, Qwen3-8B shapes (scripts/proto_gemm.py): correctness, then the sweep
                python3 scripts/proto_gemm.py --check > "$OUT/proto_gemm_check.log" 2>&1
                tail -2 "$OUT/proto_gemm_check.log"
                timeout 480 python3 scripts/proto_gemm.py ${GEMM_ARGS:-} \
                  > "$OUT/proto_gemm.log" 2>&1; tail -17 "$OUT/proto_gemm.log" ;;
  esac
done
