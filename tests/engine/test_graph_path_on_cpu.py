"""The CUDA-graph decode path on the CPU (:func:`mrv2.testing.emulate_cuda_graphs`): steps
padded to the captured sizes and replayed over the persistent buffers, drafting included, give
the eager path's tokens; the padding requests (stale rows, possibly free or live) draft nothing
and write nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint, record_row_order

# five requests: decode steps pad to eight; the last one finishes early, so later steps pad
# over its freed row
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
NEW = [10, 10, 10, 10, 4]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "Qwen3ForCausalLM")


def _generate(path: Path, graphs: bool, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
              max_model_len=64, **kwargs)
    if graphs:
        emulate_cuda_graphs(llm.engine.runner)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _run(path: Path, params: list[SamplingParams], graphs: bool, **kwargs: Any
         ) -> tuple[list[list[int]], LLM]:
    """Each of ``PROMPTS`` under its ``params``, eager or through the emulated graphs."""
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
              max_model_len=64, **kwargs)
    if graphs:
        emulate_cuda_graphs(llm.engine.runner)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


SPECS: dict[str, dict[str, Any]] = {
    "ngram_synthetic": {"method": "ngram", "num_speculative_tokens": 2,
                        "rejection_sample_method": "synthetic",
                        "synthetic_acceptance_rate": 0.5},
    "ngram_probabilistic": {"method": "ngram", "num_speculative_tokens": 2,
                            "rejection_sample_method": "probabilistic"},
}


@pytest.mark.parametrize("spec", [None, "draft_model", "ngram_synthetic", "ngram_probabilistic"])
def test_padded_graph_replay_equals_eager(target: Path, spec: str | None) -> None:
    """Padded replays (forward, sampling tail, drafting) give the eager path's tokens; with
    drafts the tail graph verifies them (strict for the draft model, the probabilistic kernel
    on greedy rows, synthetic acceptance) and the drafting graph reads its samples in place."""
    kwargs: dict[str, Any] = {}
    if spec == "draft_model":  # the target drafting for itself: every draft accepted
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(target),
                                        "num_speculative_tokens": 2}
    elif spec is not None:
        kwargs["speculative_config"] = SPECS[spec]
    eager, eager_llm = _generate(target, graphs=False, **kwargs)
    got, llm = _generate(target, graphs=True, **kwargs)
    assert got == eager
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    query_len = 3 if spec else 1
    for size in (8, 4):
        replays = graphs.graphs[(query_len, size)].replays  # type: ignore[attr-defined]
        assert replays > 0
        # every decode step of these greedy requests samples (and verifies) in its tail graph
        assert graphs.tail_graphs[(query_len, size, 0)].replays == replays  # type: ignore[attr-defined]
    if spec:
        assert graphs.draft_graphs[(3, 8)].replays > 0  # type: ignore[attr-defined]
        stats, eager_stats = llm.engine.stats(), eager_llm.engine.stats()
        assert stats["spec_acceptance_rate"] == eager_stats["spec_acceptance_rate"]
        rate = stats["spec_acceptance_rate"]
        if spec == "draft_model":
            assert rate == 1.0
        elif spec == "ngram_synthetic":
            assert 0.2 < rate < 0.8


def test_sampling_tail_graph_equals_eager(target: Path) -> None:
    """Without a speculator, decode steps sample and post-update inside a tail graph when every
    request's sampling is capturable (greedy or temperature): seeded and greedy tokens equal the
    eager path's. Steps with a top-k or a logprobs request sample eagerly after the forward
    graph, and the tail takes over again once those requests finish."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=3, ignore_eos=True)]

    def run(graphs: bool) -> tuple[list[Any], LLM]:
        llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
                  max_model_len=64)
        if graphs:
            emulate_cuda_graphs(llm.engine.runner)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm

    eager = run(False)[0]
    got, llm = run(True)
    assert got == eager
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    replays = {size: (graphs.graphs[(1, size)].replays,  # type: ignore[attr-defined]
                      graphs.tail_graphs[(1, size, 0)].replays)  # type: ignore[attr-defined]
               for size in (4, 8)}
    # Five requests pad to 8 while the top-k and logprobs ones run: eager sampling. Four or
    # fewer pad to 4: eager while the top-k one runs (one step), then in the tail graph.
    assert replays[8][0] > 0 and replays[8][1] == 0
    assert replays[4][1] == replays[4][0] - 1 > 0


def test_verification_moves_between_eager_and_the_tail_graph(target: Path) -> None:
    """With the target drafting for itself, steps whose top-k request the tail cannot sample
    verify eagerly after the forward graph (the drafting graph then copies their samples in);
    once it has finished, the tail graph verifies in place. Tokens and drafts (the acceptance)
    equal the eager path's throughout."""
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=4, ignore_eos=True)]
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 2}
    eager, eager_llm = _run(target, params, False, speculative_config=spec)
    got, llm = _run(target, params, True, speculative_config=spec)
    assert got == eager
    stats, eager_stats = llm.engine.stats(), eager_llm.engine.stats()
    for key in ("spec_num_draft_tokens", "spec_acceptance_rate"):  # the same drafts
        assert stats[key] == eager_stats[key]
    assert stats["spec_acceptance_rate"] > 0
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    tails = {(q, size): graph for (q, size, variant), graph in graphs.tail_graphs.items()
             if variant == 0}
    count = {name: {size: table[(3, size)].replays for size in (4, 8)}  # type: ignore[attr-defined]
             for name, table in (("forward", graphs.graphs), ("tail", tails),
                                 ("drafts", graphs.draft_graphs))}
    # five requests (the top-k one among them) pad to 8: verified eagerly; four pad to 4
    assert count["forward"][8] > 0 and count["tail"][8] == 0
    assert count["drafts"][8] == count["forward"][8]
    assert count["tail"][4] == count["forward"][4] == count["drafts"][4] > 0


def test_one_token_prompt_chunks_never_replay_a_decode_graph(target: Path) -> None:
    """With a budget of one token per request, every prompt advances one token a step: those
    steps look uniform but compute prompt tokens, whose inputs (an image's embeddings, for a
    multimodal ModelState) only the eager path builds. Only the decode steps replay."""
    from mrv2 import EngineConfig, Runner
    from mrv2.contract.requests import NewRequest, SchedulerOutput

    config = EngineConfig.from_kwargs(model=str(target), device="cpu", dtype="float32",
                                      block_size=4, max_num_seqs=2, max_model_len=64)
    runner = Runner.from_config(config)
    emulate_cuda_graphs(runner)
    assert runner.graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runner.execute(SchedulerOutput(
        {"a": 1, "b": 1}, new_requests=[NewRequest("a", [5, 6, 7], params, seed=0, block_ids=[0]),
                                        NewRequest("b", [8, 9, 10], params, seed=1,
                                                    block_ids=[1])])).result()
    for _ in range(2):  # the rest of the prompts, one token each
        runner.execute(SchedulerOutput({"a": 1, "b": 1})).result()
    assert runner.graphs.graphs[(1, 2)].replays == 0  # type: ignore[attr-defined]
    runner.execute(SchedulerOutput({"a": 1, "b": 1})).result()  # decode
    assert runner.graphs.graphs[(1, 2)].replays == 1  # type: ignore[attr-defined]


def test_decode_steps_with_the_previous_layout_send_only_new_blocks(target: Path) -> None:
    """A run of decode steps over the same requests reuses the previous step's layout: it
    uploads only what is staged (a new block), and gives the same tokens as a runner that
    uploads every step; a change of requests uploads the layout again."""
    from mrv2 import EngineConfig, Runner
    from mrv2.contract.requests import NewRequest, SchedulerOutput

    def run(reuse: bool) -> tuple[list[list[int]], list[list[str]]]:
        config = EngineConfig.from_kwargs(model=str(target), device="cpu", dtype="float32",
                                          block_size=4, max_num_seqs=4, max_model_len=64)
        runner = Runner.from_config(config)
        emulate_cuda_graphs(runner)
        uploads: list[list[str]] = []
        upload = runner._uploader.upload

        def counted(arrays: Any) -> Any:
            uploads.append(sorted(arrays))
            return upload(arrays)

        runner._uploader.upload = counted  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        prompts = {"a": [5, 6, 7], "b": [8, 9, 10, 11, 12, 13]}
        blocks = {"a": [0], "b": [1, 2]}
        out = runner.execute(SchedulerOutput(
            {r: len(p) for r, p in prompts.items()},
            new_requests=[NewRequest(r, p, params, seed=0, block_ids=blocks[r])
                          for r, p in prompts.items()])).result()
        tokens = {r: list(t) for r, t in out.items()}
        next_block = 3
        for step in range(8):
            new_blocks = {}
            for r in ("a", "b"):  # a block when the next token starts one
                if (len(prompts[r]) + len(tokens[r]) - 1) % 4 == 0:
                    new_blocks[r] = [next_block]
                    next_block += 1
            scheduled = ({"a": 1, "b": 1} if step < 6 else {"b": 1})
            new_blocks = {r: b for r, b in new_blocks.items() if r in scheduled}
            if not reuse:
                runner.builder._last = None
            out = runner.execute(SchedulerOutput(
                scheduled, finished_req_ids=["a"] if step == 6 else [],
                new_block_ids=new_blocks)).result()
            for r, t in out.items():
                tokens[r] += list(t)
        return [tokens["a"], tokens["b"]], uploads

    got, uploads = run(reuse=True)
    expected, every_step = run(reuse=False)
    assert got == expected
    assert [("idx_mapping" in names) for names in every_step] == [True] * 9
    # the layout travels with the prefill, the first decode step and the step after "a" left
    # (with b's block for position 12); the steps computing a block's first position (a: 4
    # and 8, steps 1 and 5; b: 8, step 2) send that block only; steps 3, 4 and 7 nothing
    assert [("idx_mapping" in names) for names in uploads] == [True, True, False, False,
                                                               False, True]


def test_batch_rows_go_longest_sequence_first(target: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch holds the longest sequences first (attention starts them first), keeps that
    order while the same requests decode, sorts again when one joins or leaves, and gives the
    tokens of the scheduler's order (``MRV2_LONGEST_FIRST=0``)."""
    from mrv2 import EngineConfig, Runner
    from mrv2.contract.requests import NewRequest, SchedulerOutput

    prompts = {"a": [5, 6, 7], "b": [8, 9, 10, 11, 12, 13], "c": list(range(20, 30)),
               "d": list(range(40, 60))}
    # blocks for every position the steps below reach
    blocks = {"a": [0, 1], "b": [2, 3, 4], "c": [5, 6, 7, 8], "d": [9, 10, 11, 12, 13, 14]}

    def run(longest_first: str) -> tuple[dict[str, list[int]], list[list[str]]]:
        monkeypatch.setenv("MRV2_LONGEST_FIRST", longest_first)
        config = EngineConfig.from_kwargs(model=str(target), device="cpu", dtype="float32",
                                          block_size=4, max_num_seqs=4, max_model_len=64)
        runner = Runner.from_config(config)
        orders = record_row_order(runner)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

        def new(r: str) -> NewRequest:
            return NewRequest(r, prompts[r], params, seed=0, block_ids=blocks[r])

        tokens: dict[str, list[int]] = {}

        def step(scheduled: SchedulerOutput) -> None:
            for r, t in runner.execute(scheduled).result().items():
                tokens.setdefault(r, []).extend(t)

        step(SchedulerOutput({"a": 3, "b": 6, "c": 10},
                             new_requests=[new("a"), new("b"), new("c")]))
        step(SchedulerOutput({"a": 1, "b": 1, "c": 1}))
        step(SchedulerOutput({"a": 1, "b": 1, "c": 1}))
        step(SchedulerOutput({"b": 1, "c": 1, "d": 20}, finished_req_ids=["a"],
                             new_requests=[new("d")]))
        step(SchedulerOutput({"b": 1, "c": 1, "d": 1}))
        return tokens, orders

    tokens, orders = run("1")
    assert orders == [["c", "b", "a"]] * 3 + [["d", "c", "b"]] * 2
    plain_tokens, plain_orders = run("0")
    assert plain_orders == [["a", "b", "c"]] * 3 + [["b", "c", "d"]] * 2
    assert tokens == plain_tokens


def _staggered(path: Path, graphs: bool, **kwargs: Any) -> tuple[dict[str, Any], Any, list]:
    """PROMPTS arriving one a step with a 16-token budget: steps mix prompt chunks with
    decodes. Returns each request's tokens (and prompt logprobs), the engine, and per step
    ``(replay_tokens, num_tokens, num_reqs, num_reqs_padded, drafts verified)``."""
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
              max_model_len=64, max_num_batched_tokens=16, **kwargs)
    engine = llm.engine
    if graphs:
        emulate_cuda_graphs(engine.runner)
    steps: list[tuple[int, int, int, int, int]] = []
    build = engine.runner.builder.build

    def recorded(*args: Any) -> Any:
        plan = build(*args)
        b = plan.batch
        steps.append((plan.replay_tokens, b.num_tokens, b.num_reqs, b.num_reqs_padded,
                      int(b.num_draft_tokens.sum())))
        return plan

    engine.runner.builder.build = recorded
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW]
    params[2] = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW[2], ignore_eos=True,
                               prompt_logprobs=2)
    got: dict[str, Any] = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
        for out in engine.step():
            got[out.request_id] = (out.outputs[0].token_ids, out.prompt_logprobs)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = (out.outputs[0].token_ids, out.prompt_logprobs)
    return got, engine, steps


@pytest.mark.parametrize("spec", [None, "draft_model", "ngram_probabilistic"])
def test_mixed_steps_replay_padded_graphs(target: Path, spec: str | None) -> None:
    """Steps with prompt chunks (beside decodes) replay the mixed graph of the smallest
    captured token count that holds them, over padding requests with empty queries: the
    tokens, sampled and prompt logprobs equal the eager path's. With a speculator, the graphs
    compute logits rows for drafts too: steps verifying drafts beside prompt chunks replay
    them (verification and drafting eager, over the graph's hidden states)."""
    kwargs: dict[str, Any] = {}
    if spec == "draft_model":
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(target),
                                        "num_speculative_tokens": 2}
    elif spec is not None:
        kwargs["speculative_config"] = SPECS[spec]
    eager, _, eager_steps = _staggered(target, graphs=False, **kwargs)
    got, engine, steps = _staggered(target, graphs=True, **kwargs)
    assert got == eager
    assert all(s[0] == 0 for s in eager_steps)
    graphs = engine.runner.graphs
    assert sorted(graphs.mixed_graphs) == [8, 12, 16]
    assert {t: g.num_reqs for t, g in graphs.mixed_graphs.items()} == {8: 8, 12: 8, 16: 8}
    # logits rows: one a request, or 1 + 2 with drafts (at most a row a token)
    assert {t: g.num_rows for t, g in graphs.mixed_graphs.items()} == (
        {8: 8, 12: 12, 16: 16} if spec else {8: 8, 12: 8, 16: 8})
    mixed = [s for s in steps if s[0]]
    # the prompts' steps replay: padded tokens and requests (the first one a prompt alone)
    assert mixed and all(t <= pad and r <= 8 == rp for pad, t, r, rp, _ in mixed)
    assert any(t < pad for pad, t, *_ in mixed) and any(r > 1 for _, _, r, *_ in mixed)
    assert any(d for *_, d in mixed) == bool(spec)  # drafts verified after a mixed graph
    replays = sum(g.graph.replays for g in graphs.mixed_graphs.values())  # type: ignore[attr-defined]
    assert replays == len(mixed)
    assert got["2"][1] is not None  # the prompt logprobs came from the graph's hidden states


def test_mixed_graphs_follow_the_token_cap(target: Path) -> None:
    """``max_mixed_graph_tokens`` caps the mixed graphs' sizes (0: none); a ModelState with
    ``mixed_step_graphs = False`` gets none either; steps beyond the cap run eager."""
    from mrv2.runner.cuda_graphs import mixed_token_sizes

    assert mixed_token_sizes(512, 8192) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192,
                                            *range(256, 513, 32)]
    # beyond 256 tokens (compute-bound linear layers) a step pads by at most an eighth
    sizes = mixed_token_sizes(8192, 8192)
    assert sizes[-9:] == list(range(4096, 8193, 512)) and len(sizes) == 51
    assert all(b - a <= a // 8 for a, b in zip(sizes[:-1], sizes[1:], strict=True) if a >= 256)
    assert mixed_token_sizes(6000, 8192)[-2:] == [5632, 6000]
    assert mixed_token_sizes(100, 8192) == [8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert mixed_token_sizes(512, 20) == [8, 12, 16, 20]
    assert mixed_token_sizes(0, 8192) == [] and mixed_token_sizes(8, 8192) == [8]
    got, engine, steps = _staggered(target, graphs=True, max_mixed_graph_tokens=12)
    assert sorted(engine.runner.graphs.mixed_graphs) == [8, 12]
    assert any(t > 12 and pad == 0 for pad, t, *_ in steps)  # 16-token steps: eager
    assert any(pad for pad, *_ in steps)
    assert got == _staggered(target, graphs=False)[0]
    _, engine, steps = _staggered(target, graphs=True, max_mixed_graph_tokens=0)
    assert not engine.runner.graphs.mixed_graphs and not any(s[0] for s in steps)


def test_measured_cut_drops_the_mixed_graphs_slower_than_eager(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MRV2_MIXED_GRAPHS_MEASURED=1``: after capture the runner keeps the mixed graphs whose
    replay beats an eager step's host time (here: replays take ``tokens`` ms, the host 12 ms),
    found by a binary search; larger steps run eager with the same tokens."""
    from mrv2.runner import capture as capture_module
    from mrv2.runner import cuda_graphs
    from mrv2.runner.cuda_graphs import StepGraphs

    asked: list[int] = []
    graphs = StepGraphs([1], [1], 8)
    graphs.mixed_graphs = {t: cuda_graphs.MixedGraph(None, 1, 1) for t in range(8, 200, 8)}
    assert graphs.drop_slow_mixed(lambda t: asked.append(t) or t > 100) == list(range(104, 200, 8))
    assert len(asked) <= 5 and list(graphs.mixed_graphs) == list(range(8, 101, 8))
    for host_only in (True, False):  # off CUDA both are the call's wall time
        assert cuda_graphs.timed_ms(lambda: time.sleep(0.003), torch.device("cpu"),
                                    host_only) >= 3.0

    replayed: list[int] = []
    replay_mixed = StepGraphs.replay_mixed

    def recorded(self: StepGraphs, tokens: int) -> Any:
        replayed.append(tokens)
        return replay_mixed(self, tokens)

    def fake_ms(fn: Any, device: Any, host_only: bool) -> float:
        fn()
        return 12.0 if host_only else float(replayed[-1])

    monkeypatch.setattr(StepGraphs, "replay_mixed", recorded)
    monkeypatch.setenv(cuda_graphs.MEASURED_ENV_VAR, "1")
    monkeypatch.setattr(capture_module, "timed_ms", fake_ms)
    got, engine, steps = _staggered(target, graphs=True)
    assert sorted(engine.runner.graphs.mixed_graphs) == [8, 12]
    assert any(t > 12 and pad == 0 for pad, t, *_ in steps)  # 16-token steps: eager
    assert any(pad for pad, *_ in steps)
    monkeypatch.delenv(cuda_graphs.MEASURED_ENV_VAR)
    assert got == _staggered(target, graphs=False)[0]


def test_a_model_state_may_keep_prompt_steps_eager(target: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from mrv2.contract.model_state import ModelState

    monkeypatch.setattr(ModelState, "mixed_step_graphs", False)
    got, engine, steps = _staggered(target, graphs=True)
    assert not engine.runner.graphs.mixed_graphs and not any(s[0] for s in steps)
    assert engine.runner.graphs.graphs  # decode steps still replay


@pytest.mark.parametrize("spec", [None, "draft_model", "ngram_probabilistic"])
def test_top_k_tail_graph_equals_eager(target: Path, spec: str | None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps whose batch has top-k / top-p rows sample (and verify drafts) in the
    second tail graph, variant 1 (the default): the eager path's tokens (and drafts); steps
    without them keep variant 0."""
    from mrv2.sample.sampler import TOP_K_TAILS_ENV_VAR

    monkeypatch.delenv(TOP_K_TAILS_ENV_VAR, raising=False)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, top_p=0.9, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=3, top_p=0.8, seed=2, max_tokens=4,
                             ignore_eos=True)]
    kwargs: dict[str, Any] = {}
    if spec == "draft_model":
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(target),
                                        "num_speculative_tokens": 2}
    elif spec is not None:  # drafts verified against the filtered distribution
        kwargs["speculative_config"] = SPECS[spec]
    eager, eager_llm = _run(target, params, False, **kwargs)
    got, llm = _run(target, params, True, **kwargs)
    assert got == eager
    if spec:
        stats, eager_stats = llm.engine.stats(), eager_llm.engine.stats()
        assert stats["spec_num_draft_tokens"] == eager_stats["spec_num_draft_tokens"] > 0
        assert stats["spec_acceptance_rate"] == eager_stats["spec_acceptance_rate"]
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    q = 3 if spec else 1
    top_k_tail = sum(g.replays for (ql, _, v), g in graphs.tail_graphs.items()  # type: ignore[attr-defined]
                     if ql == q and v == 1)
    forward = sum(graphs.graphs[(q, size)].replays for size in (4, 8))  # type: ignore[attr-defined]
    # request 1 (top-p) runs to the end: every decode step has a top-k / top-p row
    assert top_k_tail == forward > 0


def test_graph_variant_of_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which captured tail samples a plan: temperature / greedy plans variant 0 (all-greedy
    ones whatever their top-k / top-p), top-k / top-p plans variant 1 when it is captured,
    min-p and rare stages none."""
    from mrv2.sample.sampler import TOP_K_TAILS_ENV_VAR, SamplePlan, Sampler

    sampler = Sampler(4, 32, torch.device("cpu"))
    plain, top_k = SamplePlan(all_greedy=False), SamplePlan(all_greedy=False, any_top_k_top_p=True)
    greedy_top_k = SamplePlan(all_greedy=True, any_top_k_top_p=True)
    min_p = SamplePlan(all_greedy=False, any_min_p=True, any_top_k_top_p=True)
    rare = SamplePlan(all_greedy=False, any_top_k_top_p=True, rare=[(0, SamplingParams())])
    monkeypatch.setenv(TOP_K_TAILS_ENV_VAR, "0")
    assert len(sampler.graph_plans()) == 1
    assert [sampler.graph_variant(p) for p in (plain, top_k, greedy_top_k, min_p, rare)] == [
        0, None, 0, None, None]
    monkeypatch.delenv(TOP_K_TAILS_ENV_VAR)  # the default
    assert sampler.graph_plans() == [Sampler.graph_plan, Sampler.top_k_graph_plan]
    assert [sampler.graph_variant(p) for p in (plain, top_k, greedy_top_k, min_p, rare)] == [
        0, 1, 0, None, None]

    class Custom(Sampler):  # its own sampling, declared capturable for the plain plan only
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

        def capturable(self, plan: SamplePlan) -> bool:
            return plan == Sampler.graph_plan

    custom = Custom(4, 32, torch.device("cpu"))
    assert custom.graph_plans() == [Sampler.graph_plan]
    assert [custom.graph_variant(p) for p in (plain, top_k, greedy_top_k)] == [0, None, None]


def test_mixed_graphs_default_cap_with_chunked_prefill_off() -> None:
    """By default the mixed graphs reach the token budget; with chunked prefill off, whose
    budget is raised to ``max_model_len``, at most the default budget's 8,192 tokens; 512
    with a speculator; a cap given is taken as given."""
    from types import SimpleNamespace

    from mrv2.config import SchedulerConfig
    from mrv2.runner.capture import max_mixed_graph_tokens

    def runner(chunked: bool, budget: int, cap: int | None = None,
               speculator: object = None) -> Any:
        config = SimpleNamespace(device=SimpleNamespace(max_mixed_graph_tokens=cap),
                                 scheduler=SchedulerConfig(enable_chunked_prefill=chunked))
        return SimpleNamespace(config=config, speculator=speculator, max_num_tokens=budget)

    assert max_mixed_graph_tokens(runner(True, 16384)) == 16384
    assert max_mixed_graph_tokens(runner(False, 40960)) == 8192
    assert max_mixed_graph_tokens(runner(False, 4096)) == 4096
    assert max_mixed_graph_tokens(runner(False, 40960, speculator=object())) == 512
    assert max_mixed_graph_tokens(runner(False, 40960, cap=32768)) == 32768
