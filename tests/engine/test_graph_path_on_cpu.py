"""The CUDA-graph decode path on the CPU (:func:`mrv2.testing.emulate_cuda_graphs`): steps
padded to the captured sizes and replayed over the persistent buffers, drafting included, give
the eager path's tokens; the padding requests (stale rows, possibly free or live) draft nothing
and write nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint

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


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_padded_graph_replay_equals_eager(target: Path, spec: str | None) -> None:
    kwargs: dict[str, Any] = {}
    if spec == "draft_model":  # the target drafting for itself: every draft accepted
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(target),
                                        "num_speculative_tokens": 2}
    eager = _generate(target, graphs=False, **kwargs)[0]
    got, llm = _generate(target, graphs=True, **kwargs)
    assert got == eager
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    query_len = 3 if spec else 1
    assert graphs.graphs[(query_len, 8)].replays > 0  # type: ignore[attr-defined]
    assert graphs.graphs[(query_len, 4)].replays > 0  # type: ignore[attr-defined]
    assert bool(graphs.tail_graphs) == (spec is None)  # drafts: sampled eagerly
    if spec:
        assert graphs.draft_graphs[(3, 8)].replays > 0  # type: ignore[attr-defined]
        assert llm.engine.stats()["spec_acceptance_rate"] == 1.0


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
                      graphs.tail_graphs[size].replays)  # type: ignore[attr-defined]
               for size in (4, 8)}
    # Five requests pad to 8 while the top-k and logprobs ones run: eager sampling. Four or
    # fewer pad to 4: eager while the top-k one runs (one step), then in the tail graph.
    assert replays[8][0] > 0 and replays[8][1] == 0
    assert replays[4][1] == replays[4][0] - 1 > 0


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
