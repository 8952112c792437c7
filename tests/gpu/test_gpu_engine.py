"""GPU: parity with HF in bf16, async/graph on-off equality, seeded sampling = CPU, no syncs,
batch-1 decode through the fused kernels.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu`` (the variable turns the
Triton interpreter off).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.testing import (
    hf_greedy,
    make_tiny_checkpoint,
    prefill_logits,
    run_steps_without_sync,
)

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]
ARCH = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM", **ARCH)


def _greedy(ckpt: Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(ckpt), device="cuda", block_size=16, gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_greedy_matches_hf_with_async_and_graphs_on_and_off(ckpt: Path) -> None:
    expected = [hf_greedy(ckpt, p, 24) for p in PROMPTS]
    assert _greedy(ckpt, dtype="float32") == expected
    assert _greedy(ckpt, dtype="float32", async_scheduling=False) == expected
    assert _greedy(ckpt, dtype="float32", enforce_eager=True) == expected


def test_mixed_steps_in_graphs_match_hf_fp32(ckpt: Path) -> None:
    """Prompts arriving one a step, a 32-token budget: steps mixing prompt chunks and decodes
    replay the padded mixed graphs (attention's flat grid over padding requests) and give HF's
    greedy tokens."""
    llm = LLM(str(ckpt), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=32)
    engine = llm.engine
    replayed: list[int] = []
    build = engine.runner.builder.build

    def recorded(*args: Any) -> Any:
        plan = build(*args)
        replayed.append(plan.replay_tokens)
        return plan

    engine.runner.builder.build = recorded
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(i))
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    while engine.has_unfinished():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert sorted(engine.runner.graphs.mixed_graphs) == [8, 12, 16, 24, 32]
    assert sum(1 for t in replayed if t) >= 3
    assert [got[str(i)] for i in range(len(PROMPTS))] == [hf_greedy(ckpt, p, 24)
                                                           for p in PROMPTS]


def test_bf16_async_and_graphs_on_off_agree(ckpt: Path) -> None:
    default = _greedy(ckpt, dtype="bfloat16")
    assert _greedy(ckpt, dtype="bfloat16", async_scheduling=False) == default
    eager = _greedy(ckpt, dtype="bfloat16", enforce_eager=True)
    # Graph replay and eager decode may split the KV reduction differently; in bf16 that can
    # flip a near-tie late in a sequence, so compare prefixes of at least 8 tokens.
    for a, b in zip(default, eager, strict=True):
        assert a[:8] == b[:8]


def test_programmatic_dependent_launch_changes_no_token(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode kernels launched with PDL (the default on sm90) give the same tokens,
    bit for bit, as the ordinary launches: only launch timing changes, never the math."""
    from mrv2_kernels._backend import pdl_enabled

    assert pdl_enabled(torch.zeros(1, device="cuda"))
    with_pdl = _greedy(ckpt, dtype="bfloat16")
    # Weights requested before the wait: in every kernel that can (1), in none (0); the
    # default has them in the norm + GEMV kernel only.
    monkeypatch.setenv("MRV2_PDL_EARLY_WEIGHTS", "1")
    assert _greedy(ckpt, dtype="bfloat16") == with_pdl
    monkeypatch.setenv("MRV2_PDL_EARLY_WEIGHTS", "0")
    assert _greedy(ckpt, dtype="bfloat16") == with_pdl
    # Step metadata loaded before the wait (rotary, attention): off by default until measured.
    monkeypatch.setenv("MRV2_PDL_EARLY_WEIGHTS", "1")
    monkeypatch.setenv("MRV2_PDL_EARLY_META", "1")
    assert _greedy(ckpt, dtype="bfloat16") == with_pdl
    monkeypatch.delenv("MRV2_PDL_EARLY_META")
    monkeypatch.setenv("MRV2_PDL", "0")
    assert not pdl_enabled(torch.zeros(1, device="cuda"))
    assert _greedy(ckpt, dtype="bfloat16") == with_pdl


def test_bf16_logits_close_to_hf(ckpt: Path) -> None:
    import transformers

    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    got = prefill_logits(runner, PROMPTS)  # the prefill replays a mixed graph
    assert runner.graphs is not None and runner.graphs.mixed_graphs
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = hf(torch.tensor([prompt])).logits[0, -1]
            err = (got[i] - ref).norm() / ref.norm()
            assert err < 2e-2, f"prompt {i}: relative error {err:.4f}"


def test_seeded_sampling_matches_cpu_and_ignores_batch(ckpt: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=12,
                            ignore_eos=True)
    target = {"prompt_token_ids": [11, 22, 33, 44]}
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(ckpt), device=device, dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3)
        alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
        others = [{"prompt_token_ids": [7] * 9}, {"prompt_token_ids": [3, 1, 4, 1, 5]}]
        mixed = llm.generate([others[0], target, others[1]],
                             [SamplingParams(temperature=0.7, seed=1, max_tokens=5), params,
                              SamplingParams(temperature=0.9, max_tokens=30)],
                             use_tqdm=False)[1].outputs[0].token_ids
        assert mixed == alone
        runs[device] = alone
    assert runs["cuda"] == runs["cpu"]


def _count_tail_replays(graphs: Any) -> list[tuple[int, int]]:
    """Record ``(size, variant)`` of every sampling-tail replay of ``graphs`` (a StepGraphs)."""
    replays: list[tuple[int, int]] = []
    replay = graphs.replay_tail

    def counted(query_len: int, size: int, variant: int = 0) -> Any:
        replays.append((size, variant))
        return replay(query_len, size, variant)

    graphs.replay_tail = counted
    return replays


@pytest.mark.parametrize(("filters", "third", "variant"), [
    ({}, {}, 0),  # greedy and temperature-only batches: the first tail
    ({"top_k": 20, "top_p": 0.9}, {"top_p": 0.5}, 1),  # top-k / top-p rows: the second
])
def test_seeded_sampling_in_the_graph_tail_matches_cpu(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, filters: dict[str, Any],
        third: dict[str, Any], variant: int) -> None:
    """Decode batches sample inside the decode graphs' tail of their plan (variant 1, the
    default, for batches with top-k / top-p rows): a seeded request's tokens equal the CPU
    engine's and do not depend on the batch around it."""
    monkeypatch.delenv("MRV2_TOP_K_TAIL_GRAPHS", raising=False)
    params = SamplingParams(temperature=0.8, seed=99, max_tokens=12, ignore_eos=True,
                            **filters)
    target = {"prompt_token_ids": [11, 22, 33, 44]}
    others = [{"prompt_token_ids": [7] * 9}, {"prompt_token_ids": [3, 1, 4, 1, 5]}]
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(ckpt), device=device, dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3)
        graphs = llm.engine.runner.graphs
        tails = _count_tail_replays(graphs) if graphs is not None else []
        assert (graphs is not None and bool(graphs.tail_graphs)) == (device == "cuda")
        if graphs is not None:
            assert {key[2] for key in graphs.tail_graphs} == {0, 1}
        alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
        mixed = llm.generate([others[0], target, others[1]],
                             [SamplingParams(temperature=0.0, max_tokens=5), params,
                              SamplingParams(temperature=1.1, seed=7, max_tokens=30, **third)],
                             use_tqdm=False)[1].outputs[0].token_ids
        assert mixed == alone
        assert (len(tails) > 20) == (device == "cuda")  # every decode step: 11 + 29
        assert {v for _, v in tails} <= {variant}  # (CPU: none)
        runs[device] = alone
    assert runs["cuda"] == runs["cpu"]


def test_steps_never_synchronize(ckpt: Path) -> None:
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.graphs
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert set(tokens[-1]) == {"0", "1", "2", "3"}
    assert all(0 <= t < 256 for step in tokens for ts in step.values() for t in ts)


def test_ngram_speculation_fp32_equals_plain_with_graphs_at_1_plus_k(ckpt: Path) -> None:
    """Greedy tokens with n-gram drafts equal the plain path's (fp32, graphs and async on),
    decode steps of 1 + k tokens replay their own graphs, and drafts are accepted."""
    prompts = PROMPTS + [[7, 8, 9] * 6]
    spec = {"method": "ngram", "num_speculative_tokens": 3}

    def run(**kwargs: object) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(ckpt), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    plain = run()[0]
    got, llm = run(speculative_config=spec)
    assert got == plain
    graphs = llm.engine.runner.graphs
    assert graphs is not None and any(q == 4 for q, _ in graphs.graphs)
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    del llm, graphs  # one engine at a time: each takes 0.3 of the card
    assert run(speculative_config=spec, async_scheduling=False)[0] == plain


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_self_draft_model_with_graphs(ckpt: Path, dtype: str) -> None:
    """The target as its own draft model, graphs and async on, five requests (decode steps pad
    to eight: the drafting graph's padding rows name live rows): greedy tokens equal the plain
    path's (bf16: the first 8, as graphs of 1 + k tokens may split the KV reduction differently
    and flip a late near-tie), decode steps replay drafting graphs, and almost every draft is
    accepted (the drafter's one-token passes against the target's 1 + k: near-ties again)."""
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]

    def run(**kwargs: object) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(ckpt), device="cuda", dtype=dtype, block_size=16,
                  gpu_memory_utilization=0.3, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    plain = run()[0]
    got, llm = run(speculative_config={"method": "draft_model", "model": str(ckpt),
                                       "num_speculative_tokens": 3})
    if dtype == "float32":
        assert got == plain
    else:
        assert [g[:8] for g in got] == [p[:8] for p in plain]
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (4, 8) in graphs.draft_graphs
    assert llm.engine.stats()["spec_acceptance_rate"] > 0.9


@pytest.mark.parametrize("method", ["ngram", "ngram-probabilistic", "draft_model",
                                    "ngram-synthetic", "draft_model-tail", "ngram-rare",
                                    "ngram-probabilistic-rare"])
def test_speculative_steps_never_synchronize(ckpt: Path, method: str) -> None:
    """Prefill, then decode steps verifying drafts (eager and graph replay), with the drafts
    proposed on the device (n-gram; the target as its own draft model) and verified strictly,
    probabilistically or synthetically, inside the sampling tail (variant 1 for top-k / top-p
    rows, 0 for temperature rows: ``-tail`` and synthetic) or eagerly (a step of mixed draft
    counts; ``-rare``: penalties, min_tokens and logprobs at every draft row): no host sync."""
    spec: dict[str, object] = {"method": method.split("-")[0], "num_speculative_tokens": 2}
    if "probabilistic" in method:  # (-rare: the kept tokens' logprobs computed again)
        spec["rejection_sample_method"] = "probabilistic"
    if method == "ngram-synthetic":
        spec.update(rejection_sample_method="synthetic", synthetic_acceptance_rate=0.7)
    if method.startswith("draft_model"):
        spec["model"] = str(ckpt)
    config = EngineConfig.from_kwargs(
        model=str(ckpt), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
        speculative_config=spec)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and runner.graphs.padded_size(3, 4) is not None
    temperature_only = method.endswith(("-tail", "-synthetic"))
    rare = method.endswith("-rare")
    tails = _count_tail_replays(runner.graphs)
    params = (SamplingParams(temperature=0.8) if temperature_only
              else SamplingParams(temperature=0.8, top_k=20, top_p=0.9))
    if rare:
        params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2,
                                frequency_penalty=0.3, presence_penalty=0.2, min_tokens=4,
                                stop_token_ids=[3], logprobs=1)
    new = [NewRequest(str(i), p, params, seed=i, block_ids=[i * 8 + j for j in range(8)])
           for i, p in enumerate(PROMPTS)]
    outputs = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs.append(runner.execute(SchedulerOutput(
            {str(i): len(p) for i, p in enumerate(PROMPTS)}, new_requests=new)))
        drafts = {str(i): 2 for i in range(4)}
        outputs.append(runner.execute(SchedulerOutput({k: 3 for k in drafts},
                                                      num_draft_tokens=drafts)))
        # a step whose requests verify different numbers of drafts runs eager
        outputs.append(runner.execute(SchedulerOutput(
            {"0": 3, "1": 2, "2": 3, "3": 1}, num_draft_tokens={"0": 2, "1": 1, "2": 2})))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first = outputs[-1].result()
    for out in outputs[:-1]:
        out.result()
    assert set(first) == {"0", "1", "2", "3"} and len(first["3"]) == 1
    assert all(1 <= len(ts) <= 3 for ts in first.values())
    # the uniform step's, at its padded size (rare stages: sampled eagerly)
    assert tails == ([] if rare else [(4, 0 if temperature_only else 1)])



def test_every_request_kind_verifies_drafts_fp32(ckpt: Path) -> None:
    """Penalties, min_tokens with a stop token, logprobs and prompt logprobs verify n-gram
    drafts on the GPU (graphs and async on, fp32): the same tokens and logprobs as without
    speculation, and drafts kept."""
    prompts = [[7, 8, 9] * 6, [5, 6, 5, 6, 5, 6, 5, 6], [1 + i % 20 for i in range(40)]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=12,
                             stop_token_ids=[5, 6]),
              SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True,
                             logprobs=2, prompt_logprobs=1)]

    def run(**kwargs: object) -> tuple[list[Any], LLM]:
        llm = LLM(str(ckpt), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm

    plain = run()[0]
    got, llm = run(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert [t for t, _ in got] == [t for t, _ in plain]
    for mine, theirs in zip(got[2][1] or [], plain[2][1] or [], strict=True):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def _greedy_alone(ckpt: Path, prompt: list[int]) -> list[int]:
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", block_size=16,
              gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_batch1_decode_fusions_match_hf_and_the_unfused_layers(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-request decode step runs the fused kernels (RMSNorm + GEMV + SwiGLU, the plain
    GEMV, the KV write inside RoPE) in the CUDA graph: its logits stay close to HF's, it never
    synchronizes, and greedy tokens agree with the unfused layers."""
    import transformers

    import mrv2_kernels.norm_gemv as norm_gemv_module
    from mrv2.attention.triton_backend import TritonAttentionBackend

    prompt = PROMPTS[0]
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None and (1, 1) in runner.graphs.graphs
    new = [NewRequest("0", prompt, SamplingParams(temperature=0), seed=0, block_ids=[0, 1])]
    first = runner.execute(SchedulerOutput({"0": len(prompt)},
                                           new_requests=new)).result()["0"][0]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = runner.execute(SchedulerOutput({"0": 1}))  # replays the batch-1 graph
    finally:
        torch.cuda.set_sync_debug_mode("default")
    second = step.result()["0"][0]
    decode_logits = runner.graphs.outputs[(1, 1)][1][0].float().cpu()  # the replay's logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [first]])).logits[0, -1]
    err = (decode_logits - ref).norm() / ref.norm()
    assert err < 2e-2, f"decode step: relative error {err:.4f}"
    top2 = decode_logits.topk(2).values
    assert second == int(decode_logits.argmax()) or float(top2[0] - top2[1]) < 1e-2
    del runner, step  # its KV cache (0.3 of the card) would leave the LLMs below no room

    fused = _greedy_alone(ckpt, prompt)
    monkeypatch.setattr(norm_gemv_module, "FUSED_NORM_MAX_ELEMS", 0)
    monkeypatch.setattr(norm_gemv_module, "PLAIN_GEMV_MAX_K", 0)
    monkeypatch.setattr(TritonAttentionBackend, "kv_write_in_rope", False)
    unfused = _greedy_alone(ckpt, prompt)
    # bf16: another accumulation order may flip a near-tie late in the sequence
    assert fused[:8] == unfused[:8]
