"""Bad input: a clear error before any work starts; the engine keeps serving the others."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from mrv2 import LLM, EngineConfig, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"seed": -2**63 - 1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -3}, "prompt_logprobs"),  # (above max_logprobs: the engine)
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        # values float32 cannot hold (the sampler's tables are float32: 1e39 and inf became
        # inf there and sampled token 0 under any mask, a top_p of 1e-46 became 0)
        ({"temperature": 1e39}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 1e-46}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": float("nan")}, "min_p"),
        # a bool is no count of tokens (True was taken as 1), and a single value where a
        # list belongs is named (it raised "'int' object is not iterable")
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"top_k": True}, "top_k"),
        ({"seed": False}, "seed"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 2}, "stop_token_ids"),
        ({"stop": 5}, "stop"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{message}="):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_extreme_but_valid_sampling_values_keep_the_top_token(llm: LLM) -> None:
    """The smallest top_p float32 holds keeps the most likely token (greedy's tokens); the
    largest temperature (2, vLLM's) samples among every token the masks allow (a choice's
    tokens only: the output is one of them); beam search refuses a non-finite
    length_penalty or temperature, naming it."""
    from mrv2.contract.params import F32_TINY, MAX_TEMPERATURE
    from mrv2.engine.beam_search import BeamSearchParams

    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5,
                                                   ignore_eos=True), use_tqdm=False)
    tiny = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=F32_TINY, max_tokens=5,
                                                 ignore_eos=True, seed=1), use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    allowed = [11, 12, 13]
    hot = llm.generate([prompt], SamplingParams(temperature=MAX_TEMPERATURE, max_tokens=4,
                                                seed=2, allowed_token_ids=allowed,
                                                ignore_eos=True), use_tqdm=False)
    assert set(hot[0].outputs[0].token_ids) <= set(allowed)
    for name, value in (("length_penalty", float("nan")), ("temperature", float("inf"))):
        with pytest.raises(ValueError, match=f"BeamSearchParams.{name}="):
            BeamSearchParams(beam_width=2, max_tokens=3, **{name: value})


def test_prompt_too_long_and_empty(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": [1] * 64}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"in \[0, 256\)"):
        llm.generate({"prompt_token_ids": [1, 999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate({"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[300]))


def test_one_bad_prompt_runs_nothing_and_engine_keeps_serving(llm: LLM) -> None:
    good = {"prompt_token_ids": [3, 4, 5]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError):
        llm.generate([good, {"prompt_token_ids": [1] * 100}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    # A bad request added while others run leaves them untouched.
    engine = llm.engine
    first = engine.add_request([3, 4, 5], params)
    with pytest.raises(ValueError):
        engine.add_request([1] * 100, params)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    expected = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    assert finished == {first: expected}


def _finish(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Step ``engine`` until idle: each finished output's samples' tokens by request id."""
    finished: dict[str, list[list[int]]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [list(o.token_ids) for o in out.outputs]
    return finished


def test_ids_of_an_n_requests_samples_are_refused_before_any_state_changes(llm: LLM) -> None:
    """A parent of ``n > 1`` takes its samples' ids (``<id>#n<i>``): a parent whose samples'
    ids a request holds, or a request taking a sample's id of a parent in flight (one
    already finished too: its output would be merged into the parent's), is refused
    before anything is queued; the requests in flight finish under their own ids."""
    engine = llm.engine
    one = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # (top_k=1: each sample greedy's tokens; greedy itself takes n=1 only, as vLLM's)
    two = SamplingParams(top_k=1, max_tokens=3, ignore_eos=True, n=2)
    engine.add_request([3, 4, 5], one, request_id="a#n1")
    with pytest.raises(ValueError, match=r"'a' is already in use \(by its samples' ids "
                                         r"\['a#n1'\]\)"):
        engine.add_request([3, 4, 5], two, request_id="a")
    assert engine.scheduler.num_unfinished == 1 and not engine._flight.fanout.parents
    engine.add_request([3, 4, 5], two, request_id="b#n0")  # a parent; then one of its id
    with pytest.raises(ValueError, match="'b' is already in use"):
        engine.add_request([3, 4, 5], two, request_id="b")
    assert engine.scheduler.num_unfinished == 3
    finished = _finish(engine)
    assert set(finished) == {"a#n1", "b#n0"}
    assert finished["a#n1"][0] == finished["b#n0"][0] == finished["b#n0"][1]
    assert not engine._flight.fanout.parents and not engine._flight.fanout.child_parent


def test_the_id_of_a_finished_sample_of_a_parent_in_flight_is_refused(ckpt: Path) -> None:
    engine = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64,
                 max_num_seqs=1).engine  # (one request at a time: sample 0 ends first)
    one = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request([3, 4, 5], SamplingParams(top_k=1, max_tokens=3, ignore_eos=True, n=2),
                       request_id="c")
    while "c#n0" in engine._flight.requests:
        assert engine.step() == []
    assert "c#n1" in engine._flight.requests
    with pytest.raises(ValueError, match="'c#n0' is already in use"):
        engine.add_request([3, 4, 5], one, request_id="c#n0")
    finished = _finish(engine)
    assert set(finished) == {"c"} and len(finished["c"]) == 2


def test_an_id_left_to_the_engine_skips_the_ids_callers_took(llm: LLM) -> None:
    """An id the engine numbers passes over a caller's own ids (and its samples' ids)
    instead of refusing a request whose caller chose no id."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine._flight.numbers = itertools.count(1000)
    engine.add_request([3, 4, 5], params, request_id="1000")
    engine.add_request([3, 4, 5], params, request_id="1001#n1")
    assert engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, n=2)) == "1002"
    assert set(_finish(engine)) == {"1000", "1001#n1", "1002"}


def test_params_changed_after_submission_leave_the_request_as_submitted(llm: LLM) -> None:
    """The engine keeps its own copy of a request's params: the caller reusing its object
    (here, an out-of-vocabulary bias key) changes neither that request nor anyone's step."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={9: 100.0},
                            allowed_token_ids=[9, 10])
    first = engine.add_request([3, 4, 5], params)
    params.logit_bias.clear()
    params.logit_bias[10**6] = 1.0
    params.allowed_token_ids.append(10**6)  # type: ignore[union-attr]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {first: [9, 9, 9]}


def test_a_prompt_refused_while_queueing_leaves_none_queued(llm: LLM) -> None:
    """A refusal that comes only as the prompts are queued (bad words, and this model has no
    tokenizer) aborts the prompts queued before it: none stays behind to run in a later
    call."""
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, bad_words=["x"])]
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 2, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_penalty_past_the_counters_limit_is_refused_at_submission(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalties need ``max_num_seqs x vocab`` per-token counters; past their limit a request
    with a penalty is refused when it is submitted (the field and the way out named), before
    it takes a row or fails a step, and the request already running finishes as alone."""
    import mrv2.sample.state as sampling_state

    engine = llm.engine
    assert engine.runner.sampler.state.output_counts is None  # not allocated yet: the case
    rows = engine.config.scheduler.max_num_seqs
    monkeypatch.setattr(sampling_state, "PENALTY_STATE_MAX_ELEMENTS", rows * 256 - 1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = engine.add_request([3, 4, 5], params)
    with pytest.raises(ValueError, match=rf"presence_penalty=0.5: penalties need {rows * 256} "
                       rf"per-token counters \(max_num_seqs={rows} x vocab 256\).*at most "
                       rf"{rows - 1},"):
        engine.add_request([3, 4], SamplingParams(presence_penalty=0.5, max_tokens=4))
    with pytest.raises(ValueError, match="repetition_penalty=1.2: "):
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(repetition_penalty=1.2),
                     use_tqdm=False)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert engine.runner.sampler.state.output_counts is None
    monkeypatch.undo()
    expected = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)
    assert finished == {first: expected[0].outputs[0].token_ids}


def test_bad_engine_config_names_field(ckpt: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="block_size"):
        EngineConfig.from_kwargs(block_size=3)
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="unknown engine argument 'max_len'"):
        EngineConfig.from_kwargs(max_len=3)
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        LLM(str(ckpt), device="cpu", max_model_len=1000)


def test_unknown_architecture_and_missing_files(tmp_path: Path, ckpt: Path) -> None:
    import json
    import shutil

    weird = tmp_path / "weird"
    shutil.copytree(ckpt, weird)
    config = json.loads((weird / "config.json").read_text())
    config["architectures"] = ["RwkvForCausalLM"]
    (weird / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"registered architectures: .*LlamaForCausalLM.*"
                                         r"Install a plugin that registers it"):
        LLM(str(weird), device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(ckpt / "config.json", no_weights / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(no_weights), device="cpu")


def test_mismatched_weight_shape(tmp_path: Path) -> None:
    import json

    ckpt = make_tiny_checkpoint(tmp_path / "a", "LlamaForCausalLM")
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 96  # checkpoint tensors are 128 wide
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(ckpt), device="cpu")


def test_runner_rejects_a_bad_step_without_changing_state(ckpt: Path) -> None:
    from mrv2.contract.requests import NewRequest, SchedulerOutput
    from mrv2.runner.runner import Runner

    runner = Runner.from_config(EngineConfig.from_kwargs(
        model=str(ckpt), device="cpu", dtype="float32", block_size=4))
    params = SamplingParams(temperature=0)
    new = [NewRequest("a", [1, 2, 3], params, seed=0, block_ids=[0]),
           NewRequest("b", [4, 5], params, seed=1, block_ids=[1])]
    runner.execute(SchedulerOutput({"a": 3, "b": 1}, new_requests=new)).result()
    with pytest.raises(ValueError, match="'b': scheduled 5 tokens but only 1"):
        runner.execute(SchedulerOutput({"a": 1, "b": 5}))
    # nothing moved: the same step, well formed, still runs
    tokens = runner.execute(SchedulerOutput({"a": 1, "b": 1})).result()
    assert set(tokens) == {"a", "b"}


def test_new_requests_are_checked_before_any_takes_a_row(ckpt: Path) -> None:
    """A step's new requests are all checked before the first one takes a row: a bad one
    leaves the state table as it was, and the same requests, well formed, then run."""
    from mrv2.contract.requests import NewRequest, SchedulerOutput
    from mrv2.runner.runner import Runner

    runner = Runner.from_config(EngineConfig.from_kwargs(
        model=str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=16))
    params = SamplingParams(temperature=0)
    good = NewRequest("a", [1, 2, 3], params, seed=0, block_ids=[0])
    with pytest.raises(ValueError, match="'b' has 17 tokens; allowed 1..16"):
        runner.execute(SchedulerOutput({"a": 3, "b": 1}, new_requests=[
            good, NewRequest("b", list(range(17)), params, seed=1, block_ids=[1])]))
    assert len(runner.table) == 0
    # a penalty past the counters' limit (the runner's own check, before any row changes)
    import mrv2.sample.state as sampling_state

    limit = sampling_state.PENALTY_STATE_MAX_ELEMENTS
    sampling_state.PENALTY_STATE_MAX_ELEMENTS = 1
    try:
        with pytest.raises(ValueError, match="frequency_penalty=0.3: penalties need"):
            runner.execute(SchedulerOutput({"a": 3, "b": 1}, new_requests=[good, NewRequest(
                "b", [4], SamplingParams(frequency_penalty=0.3), seed=1, block_ids=[1])]))
    finally:
        sampling_state.PENALTY_STATE_MAX_ELEMENTS = limit
    assert len(runner.table) == 0 and runner.sampler.state.output_counts is None
    new = [good, NewRequest("b", [4, 5], params, seed=1, block_ids=[1])]
    assert set(runner.execute(SchedulerOutput({"a": 3, "b": 2}, new_requests=new)).result()) \
        == {"a", "b"}


def test_a_burst_of_new_rows_stages_as_one_at_a_time() -> None:
    """``BatchBuilder.stage_new_rows`` (one staged put per table for a step's new requests)
    writes the same tokens, block table and counts as ``stage_new_row`` per request."""
    import torch

    from mrv2.contract.staged_edits import StagedEdits
    from mrv2.contract.state_table import RequestStateTable, RowInfo
    from mrv2.runner.batch_builder import BatchBuilder

    rows, computed = [3, 0, 5], [0, 0, 8]
    tokens = [[7, 1, 4, 4, 2], [9], list(range(100, 116))]
    blocks = [[2, 6], [], [1, 3, 5, 0]]
    tables = []
    for batched in (False, True):
        table = RequestStateTable(6, 16, 4, torch.device("cpu"))
        table.token_ids.fill_(-1)
        table.block_table.fill_(-1)
        for i, row in enumerate(rows):
            table.info[row] = RowInfo(str(i), computed[i], len(tokens[i]), len(tokens[i]))
        builder = object.__new__(BatchBuilder)
        builder.table = table
        staged = StagedEdits()
        if batched:
            builder.stage_new_rows(rows, tokens, blocks, computed, staged)
        else:
            for i, row in enumerate(rows):
                builder.stage_new_row(row, tokens[i], blocks[i], computed[i], staged)
        staged.apply({k: torch.from_numpy(v) for k, v in staged.arrays().items()})
        tables.append(table)
    a, b = tables
    for name in ("token_ids", "block_table", "num_computed", "num_tokens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert b.token_ids[5].tolist() == tokens[2] and b.token_ids[3, :6].tolist() == [7, 1, 4, 4,
                                                                                       2, -1]
    assert b.block_table[0].tolist() == [-1] * 4 and b.num_tokens.tolist() == [1, 0, 0, 5, 0, 16]
    assert np.array_equal(a.num_blocks, b.num_blocks) and b.num_blocks.tolist() == [0, 0, 0, 2,
                                                                                      0, 4]
    with pytest.raises(ValueError, match="'1' would hold more blocks"):
        builder.stage_new_rows([0], [[1]], [[1, 2, 3, 4, 5]], [0], StagedEdits())


def test_chunked_prefill_off_raises_the_default_token_budget_to_max_model_len(
        ckpt: Path) -> None:
    """vLLM's rule: with chunked prefill off the default token budget is at least
    max_model_len (a prompt of the whole context runs in one step; the default 8192 refused
    every longer prompt), and the runner's buffers follow it."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=16, cpu_kv_cache_gb=0.05,
              enable_chunked_prefill=False,
              hf_overrides={"max_position_embeddings": 9000})
    engine = llm.engine
    assert engine.max_model_len == 9000
    assert engine.config.scheduler.max_num_batched_tokens == 9000
    assert engine.runner.max_num_tokens == 9000
    prompt = [1 + i % 200 for i in range(8500)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert engine.validate(prompt, params) == 2
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_chunked_prefill_off_refuses_an_explicit_budget_below_max_model_len(
        ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than "
                                         r"max_model_len \(64\)"):
        LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64,
            enable_chunked_prefill=False, max_num_batched_tokens=32)
    # larger, or equal, is the caller's own budget; chunked prefill on: any budget
    for kwargs in ({"enable_chunked_prefill": False, "max_num_batched_tokens": 100},
                   {"max_num_batched_tokens": 32}):
        llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64,
                  **kwargs)
        assert llm.engine.config.scheduler.max_num_batched_tokens == kwargs[
            "max_num_batched_tokens"]
