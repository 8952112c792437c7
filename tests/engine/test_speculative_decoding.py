"""Speculative decoding end to end on CPU: steps of 1 + k tokens give the one-token path's tokens.

An oracle speculator (drafts from a known continuation, some corrupted on purpose) makes every
acceptance case happen on tiny random models: all drafts kept, none, a prefix. n-gram then runs
as users run it, and must change nothing but speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams, hookimpl
from mrv2.contract.batch import InputBatch
from mrv2.contract.speculator import Speculator, SpeculatorInputs, StepSamples
from mrv2.contract.state_table import RequestStateTable
from mrv2.plugins import PluginManager
from mrv2.testing import make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
NEW_TOKENS = 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class Oracle(Speculator):
    """Drafts the known continuation of each sequence; every ``corrupt``-th draft is wrong."""

    futures: list[list[int]] = []
    corrupt = 0

    def propose(self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
                table: RequestStateTable) -> None:
        k = self.num_speculative_tokens
        for i, row in enumerate(batch.idx_mapping_cpu.tolist()):
            n = int(table.num_tokens[row])
            known = table.token_ids[row, :n].tolist()
            future = next((f for f in self.futures if f[:n] == known), known)
            drafts = (future[n : n + k] + [0] * k)[:k]
            for j in range(k):
                if self.corrupt and (n + j) % self.corrupt == 0:
                    drafts[j] = (drafts[j] + 1) % 256
                if n + j < table.token_ids.shape[1] and int(samples.num_sampled[i]) > 0:
                    table.token_ids[row, n + j] = drafts[j]


class OraclePlugin:
    """Registers the oracle speculator."""

    @hookimpl
    def mrv2_register_speculators(self, register: Any) -> None:
        register("oracle", f"{__name__}:Oracle")


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    manager = PluginManager(autoload=True, allow=["qwen", "llama"], block=[])
    manager.register(OraclePlugin(), name="oracle")
    engine_kwargs = {"device": "cpu", "dtype": "float32", "block_size": 4, **kwargs}
    return LLM(str(checkpoint), plugins=manager, **engine_kwargs)


def _generate(llm: LLM, params: SamplingParams = GREEDY,
              prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    return _generate(_llm(checkpoint))


@pytest.mark.parametrize("corrupt", [0, 1, 3], ids=["all-kept", "none-kept", "some-kept"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_oracle_drafts_give_the_one_token_tokens(
    checkpoint: Path, expected: list[list[int]], corrupt: int, async_scheduling: bool
) -> None:
    Oracle.futures = [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    Oracle.corrupt = corrupt
    llm = _llm(checkpoint, async_scheduling=async_scheduling,
               speculative_config={"method": "oracle", "num_speculative_tokens": 3})
    assert _generate(llm) == expected
    stats = llm.engine.stats()
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert drafted > 0
    if corrupt == 0:
        assert accepted == drafted  # every draft right: every draft kept
    elif corrupt == 1:
        assert accepted == 0
    else:
        assert 0 < accepted < drafted
    per_pos, kept = stats["spec_num_drafts_per_pos"], stats["spec_num_accepted_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == drafted and sum(kept) == accepted
    assert per_pos[0] == stats["spec_num_steps"] and per_pos == sorted(per_pos, reverse=True)
    assert all(a <= d for a, d in zip(kept, per_pos, strict=True))
    assert kept == sorted(kept, reverse=True)  # position j is kept only after j - 1 is
    expected_rate = {0: 1.0, 1: 0.0}.get(corrupt)
    if expected_rate is not None:
        assert stats["spec_acceptance_rate_per_pos"] == [expected_rate] * 3
    assert stats["spec_mean_accepted_length"] == pytest.approx(
        1 + accepted / stats["spec_num_steps"])
    runner = llm.engine.runner
    assert len(runner.table) == 0 and llm.engine.block_manager.usage == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 8},  # chunked prefill beside 1 + k decode steps
        {"num_gpu_blocks_override": 16},  # tiny cache: preemption while drafts are in flight
        {"max_model_len": 40},  # drafts cut short at the end of the context
    ],
    ids=["chunked", "tiny-cache", "short-context"],
)
def test_oracle_drafts_under_pressure(checkpoint: Path, expected: list[list[int]],
                                      kwargs: dict[str, Any]) -> None:
    Oracle.futures = [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    Oracle.corrupt = 4
    plain = _generate(_llm(checkpoint, **kwargs))  # max_model_len 40 cuts outputs short
    llm = _llm(checkpoint, speculative_config={"method": "oracle", "num_speculative_tokens": 4},
               **kwargs)
    assert _generate(llm) == plain
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_ngram_changes_nothing_but_speed(checkpoint: Path, expected: list[list[int]],
                                         async_scheduling: bool) -> None:
    llm = _llm(checkpoint, async_scheduling=async_scheduling, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2})
    assert _generate(llm) == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_no_drafts_before_the_first_sample(checkpoint: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A prompt of 9 tokens in chunks of 8: its second step (the last prompt token alone)
    verifies no drafts, since the chunk before it sampled nothing and so the drafter wrote
    none (the row past the prompt holds stale tokens); the steps after the first sample do."""
    llm = _llm(checkpoint, max_num_batched_tokens=8, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    scheduler = llm.engine.scheduler
    steps: list[tuple[int, int, int]] = []
    schedule = scheduler._schedule

    def record(request: Any, n: int, out: Any, drafts: int = 0) -> None:
        steps.append((request.num_computed_tokens, n, drafts))
        schedule(request, n, out, drafts)

    monkeypatch.setattr(scheduler, "_schedule", record)
    prompt = [7, 8, 9] * 3  # repeats: n-gram drafts from the first step that may verify any
    tokens = _generate(llm, prompts=[prompt])
    assert steps[:2] == [(0, 8, 0), (8, 1, 0)], steps
    assert any(drafts for _, _, drafts in steps[2:]), steps
    monkeypatch.undo()
    assert tokens == _generate(_llm(checkpoint), prompts=[prompt])


def test_seeded_sampling_and_mixed_params_equal_without_speculation(checkpoint: Path) -> None:
    """Seeded samples match token for token; requests with penalties (which do not
    speculate) and with logprobs (which do) share steps with ones that do."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=NEW_TOKENS),
              SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, presence_penalty=1.0),
              SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logit_bias={7: 3.0})]
    prompts = PROMPTS[:4]

    def run(**kwargs: Any) -> list[Any]:
        llm = _llm(checkpoint, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    plain = run()
    spec = run(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert [t for t, _ in spec] == [t for t, _ in plain]
    for got, want in zip(spec[2][1], plain[2][1], strict=True):  # the logprobs request's too
        assert got.keys() == want.keys()  # (values within fp32 noise of the batch's shapes)
        for token, lp in got.items():
            assert lp.rank == want[token].rank
            assert lp.logprob == pytest.approx(want[token].logprob, abs=1e-5)


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_logprobs_requests_verify_drafts(checkpoint: Path, expected: list[list[int]],
                                         method: str) -> None:
    """Requests asking for logprobs (one for prompt logprobs too) verify drafts, and each
    kept token's logprobs are reported: under strict verification its row's own sample's
    (the tokens and every token's logprobs, ids, ranks and values, are those of a run
    without speculation); under probabilistic verification greedy requests are verified
    strictly (the same again), and a sampled one's kept tokens differ, so their logprobs are
    checked against teacher forcing: the prompt logprobs of prompt + answer, without
    speculation."""
    Oracle.futures = [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    Oracle.corrupt = 3  # some drafts kept, some not
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logprobs=0),
              SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logprobs=1)]
    prompts = PROMPTS[:3]

    def run(**kwargs: Any) -> tuple[list[Any], LLM]:
        llm = _llm(checkpoint, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        prompt_lps.append(outs[0].prompt_logprobs)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs,
                 o.outputs[0].cumulative_logprob) for o in outs], llm

    prompt_lps: list[Any] = []
    plain, _ = run()
    # the sampled request's drafts: its own draws without speculation, so a probabilistic
    # test often rejects a draft its row sampled, and the position takes another token
    Oracle.futures.insert(0, prompts[2] + plain[2][0])
    spec, llm = run(speculative_config={"method": "oracle", "num_speculative_tokens": 3,
                                        "rejection_sample_method": method})
    strict = method == "strict"
    same = spec if strict else spec[:2]  # (probabilistic: the sampled request draws anew)
    assert [t for t, _, _ in same] == [t for t, _, _ in plain[: len(same)]]
    assert [t for t, _, _ in spec[:2]] == expected[:2]
    if not strict:  # teacher forcing: each kept token's logprob given the tokens before it
        tokens, got, total = spec[2]
        forced = _llm(checkpoint).generate(
            {"prompt_token_ids": prompts[2] + tokens},  # type: ignore[arg-type]
            SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        assert forced.prompt_logprobs is not None and got is not None
        teacher = forced.prompt_logprobs[len(prompts[2]):]
        assert len(got) == len(tokens) == len(teacher)
        for token, mine, theirs in zip(tokens, got, teacher, strict=True):
            assert theirs is not None and token in mine
            assert mine[token].rank == theirs[token].rank
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-5)
        assert total == pytest.approx(sum(p[t].logprob for t, p in zip(tokens, got,
                                                                          strict=True)),
                                      abs=1e-4)
    for (tokens, got, total), (_, want, want_total) in zip(same, plain, strict=False):
        if got is None or want is None or len(got) != len(want):
            raise AssertionError("logprobs missing or of the wrong length")
        assert total == pytest.approx(want_total, abs=1e-4)
        for token, mine, theirs in zip(tokens, got, want, strict=True):
            assert token in mine and mine.keys() == theirs.keys()
            for t, lp in mine.items():
                assert lp.rank == theirs[t].rank
                assert lp.logprob == pytest.approx(theirs[t].logprob, abs=1e-5)
    stats = llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0 and stats["spec_num_draft_tokens"] > 0
    alone = _llm(checkpoint, speculative_config={"method": "oracle",
                                                 "num_speculative_tokens": 3,
                                                 "rejection_sample_method": method})
    alone.generate({"prompt_token_ids": prompts[0]}, params[0],  # type: ignore[arg-type]
                   use_tqdm=False)
    assert alone.engine.stats()["spec_num_accepted_tokens"] > 0  # it verified drafts too
    mine, theirs = prompt_lps[1], prompt_lps[0]  # (the first request's, with prompt logprobs)
    assert mine is not None and theirs is not None and len(mine) == len(prompts[0])
    for a, b in zip(mine[1:], theirs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def test_min_tokens_requests_verify_drafts(checkpoint: Path, expected: list[list[int]]) -> None:
    """``min_tokens=m`` with a stop token: every draft row counts the outputs before its own
    position (the stop token is masked exactly until the ``m``-th output), so the request
    verifies drafts and gives the tokens of a run without speculation: stopped at a stop
    token's first allowed place (one the free run first produces at ``m``), and past one
    the free run produces early (masked there, so the run goes another way)."""
    Oracle.futures = [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    Oracle.corrupt = 0
    cases = [(i, m) for i, free in enumerate(expected) for m in range(4, NEW_TOKENS - 1)
             if free[m] not in free[:m]]
    cases = [next(c for c in cases if c[0] == i) for i in dict.fromkeys(i for i, _ in cases)]
    assert len(cases) >= 2, f"{expected}: too few tokens first produced late"
    prompts, params = [], []
    for i, m in cases:
        for stop in (expected[i][m], expected[i][1]):
            prompts.append({"prompt_token_ids": PROMPTS[i]})
            params.append(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=m,
                                         stop_token_ids=[stop]))

    def run(**kwargs: Any) -> tuple[list[list[int]], LLM]:
        llm = _llm(checkpoint, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run()
    spec, llm = run(speculative_config={"method": "oracle", "num_speculative_tokens": 3})
    assert spec == plain
    for k, (i, m) in enumerate(cases):
        assert plain[2 * k] == expected[i][: m + 1]  # stopped where the mask lifted
    assert llm.engine.stats()["spec_num_accepted_tokens"] >= sum(m for _, m in cases)


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 3.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
    {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.5}],
    ids=["repetition", "frequency", "presence", "all"])
def test_penalty_requests_verify_drafts(checkpoint: Path, penalty: dict[str, float]) -> None:
    """Requests with penalties verify drafts: a draft row counts the drafts before it as
    outputs (``mrv2.sample.draft_penalties``), so greedy and seeded requests give a run
    without speculation's tokens, drafts drawn from that run (most kept) or not."""
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             **penalty),
              SamplingParams(temperature=0.9, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True,
                             **penalty)]
    prompts = [PROMPTS[4], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    params = [params[0], params[1], params[0], params[1]]

    def run(**kwargs: Any) -> tuple[list[list[int]], LLM]:
        llm = _llm(checkpoint, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run()
    free = _generate(_llm(checkpoint), GREEDY, [prompts[0]])[0]
    assert plain[0] != free  # the penalty decides tokens
    Oracle.futures = [p + o for p, o in zip(prompts, plain, strict=True)]
    Oracle.corrupt = 5
    spec, llm = run(speculative_config={"method": "oracle", "num_speculative_tokens": 3})
    assert spec == plain
    assert llm.engine.stats()["spec_num_accepted_tokens"] >= 2 * NEW_TOKENS


def test_bad_words_requests_verify_drafts(checkpoint: Path, expected: list[list[int]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests with bad words verify drafts: a draft row bans a word's last token where the
    drafts before it complete the word's other tokens (they lie in the state table before
    the row's position), so the tokens are those of a run without speculation, drafts drawn
    from that run or from the free run (which has the banned pairs)."""
    import mrv2.engine.request_ops as request_ops

    # banned pairs the free runs produce (after index 1, so a draft row meets them)
    words = [[e[i], e[i + 1]] for e in expected[:3] for i in (3, 6)]
    prepare = request_ops.prepare_params

    def with_words(*args: Any) -> SamplingParams:  # (no tokenizer here: the ids given)
        params = prepare(*args)
        params._bad_words_token_ids = [list(w) for w in words]
        return params

    monkeypatch.setattr(request_ops, "prepare_params", with_words)
    prompts = PROMPTS[:3]

    def run(**kwargs: Any) -> tuple[list[list[int]], LLM]:
        llm = _llm(checkpoint, **kwargs)
        return _generate(llm, GREEDY, prompts), llm

    plain, _ = run()
    assert plain != expected[:3]  # the bans decide tokens
    for futures in (plain, expected[:3]):
        Oracle.futures = [p + o for p, o in zip(prompts, futures, strict=True)]
        Oracle.corrupt = 0
        spec, llm = run(speculative_config={"method": "oracle", "num_speculative_tokens": 3})
        assert spec == plain
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def test_stops_inside_accepted_drafts(checkpoint: Path, expected: list[list[int]]) -> None:
    """A stop token among accepted drafts ends the request there; later tokens are dropped."""
    Oracle.futures = [p + e for p, e in zip(PROMPTS, expected, strict=True)]
    Oracle.corrupt = 0
    stop = expected[0][5]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop])
    plain = _generate(_llm(checkpoint), params, PROMPTS[:1])
    spec = _generate(_llm(checkpoint, speculative_config={"method": "oracle",
                                                          "num_speculative_tokens": 4}),
                     params, PROMPTS[:1])
    assert spec == plain and plain[0][-1] == stop and len(plain[0]) <= 6


def test_bad_speculative_config_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        _llm(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_min": 5, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="needs num_speculative_tokens >= 1"):
        _llm(checkpoint, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        _llm(checkpoint, speculative_config="{method: ngram")


def test_runner_refuses_malformed_draft_steps(checkpoint: Path) -> None:
    from mrv2.contract.requests import NewRequest, SchedulerOutput

    llm = _llm(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    runner = llm.engine.runner
    request = NewRequest("r", [3, 4, 5], SamplingParams(temperature=0), 0, [0, 1])
    with pytest.raises(ValueError, match="draft tokens in 3 scheduled"):
        runner.execute(SchedulerOutput({"r": 3}, new_requests=[request],
                                       num_draft_tokens={"r": 2}))
    assert len(runner.table) == 0  # refused before anything changed
    runner.execute(SchedulerOutput({"r": 3}, new_requests=[request])).result()
    with pytest.raises(ValueError, match=r"d in 1\.\.2"):
        runner.execute(SchedulerOutput({"r": 4}, num_draft_tokens={"r": 3}))
    out = runner.execute(SchedulerOutput({"r": 3}, num_draft_tokens={"r": 2}))
    tokens = out.result()["r"]
    assert 1 <= len(tokens) <= 3
    info = runner.table.info[runner.table.row_of("r")]
    assert info.num_known - info.num_computed == 1
    assert info.num_computed == int(runner.table.num_computed[runner.table.row_of("r")])
    assert torch.equal(runner.table.num_tokens[runner.table.row_of("r")],
                       torch.tensor(info.num_known, dtype=torch.int32))


class CacheProbe(Speculator):
    """A drafter with a cache layer of its own: writes each step's token ids as its K/V (through
    its backend, at the step's slots: the block space it shares with the target), then drafts
    the token its cache holds one block back, read through the block table."""

    layer = -1

    def kv_cache_specs(self, first_layer_idx: int) -> dict[int, Any]:
        from mrv2.contract.kv_cache import PagedKVSpec

        CacheProbe.layer = first_layer_idx
        return {first_layer_idx: PagedKVSpec(num_kv_heads=1, head_dim=8)}

    def propose(self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
                table: RequestStateTable) -> None:
        cache, backend = self.kv_caches[self.layer], self.kv_backends[self.layer]
        ids = batch.input_ids[: batch.num_tokens].float()[:, None, None].expand(-1, 1, 8)
        backend.write_kv(ids, ids + 0.5, cache, batch.slot_mapping[: batch.num_tokens])
        for i, row in enumerate(batch.idx_mapping_cpu.tolist()):
            n = int(table.num_tokens[row])
            back = max(n - 1 - 4, 0)  # block size 4: a position one block back
            block = int(table.block_table[row, back // 4])
            token = int(cache[0, block, back % 4, 0, 0])
            for j in range(self.num_speculative_tokens):
                if n + j < table.token_ids.shape[1] and int(samples.num_sampled[i]) > 0:
                    table.token_ids[row, n + j] = token


def test_a_drafter_gets_cache_layers_of_its_own(checkpoint: Path,
                                                expected: list[list[int]]) -> None:
    class Plugin:
        @hookimpl
        def mrv2_register_speculators(self, register: Any) -> None:
            register("probe", f"{__name__}:CacheProbe")

    manager = PluginManager(autoload=True, allow=["qwen", "llama"], block=[])
    manager.register(Plugin(), name="probe")
    llm = LLM(str(checkpoint), plugins=manager, device="cpu", dtype="float32", block_size=4,
              speculative_config={"method": "probe", "num_speculative_tokens": 2})
    kv = llm.engine.runner.kv
    assert CacheProbe.layer == 2  # after the target's two layers
    assert [g.layer_indices for g in kv.groups] == [(0, 1), (2,)]
    assert kv.tensors[2].shape == (2, llm.engine.runner.num_kv_blocks, 4, 1, 8)
    target = sum(kv.specs[i].bytes_per_block(4, torch.float32) for i in (0, 1))
    assert kv.bytes_per_block(4, torch.float32) == target + 2 * 4 * 1 * 8 * 4  # drafter's too
    assert _generate(llm) == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    cache = kv.tensors[2]
    assert bool((cache[0] != 0).any()) and bool(((cache[1] - cache[0])[cache[0] != 0] == 0.5).all())


def test_prompt_lookup_min_alone_is_the_longest_match_too(checkpoint: Path,
                                                          expected: list[list[int]]) -> None:
    """vLLM's rule: ``prompt_lookup_min`` given alone above the default longest match (4)
    raises that bound to it, rather than refusing the configuration."""
    llm = _llm(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                               "prompt_lookup_min": 5})
    speculator: Any = llm.engine.runner.speculator
    assert (speculator.min_n, speculator.max_n) == (5, 5)
    assert _generate(llm) == expected
