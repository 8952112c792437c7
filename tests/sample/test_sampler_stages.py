"""The sampler's per-request stages against direct torch statements of vLLM's semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_helpers import make_batch

from mrv2.contract.params import SamplingParams
from mrv2.sample.masks import apply_masks
from mrv2.sample.sampler import Sampler

VOCAB = 40


def _with(params: SamplingParams, **engine: object) -> SamplingParams:
    for key, value in engine.items():
        setattr(params, key, value)
    return params


def test_masks_match_direct_statement() -> None:
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(logit_bias={3: 5.0, 7: -2.5}),
        SamplingParams(allowed_token_ids=[1, 4, 9]),
        _with(SamplingParams(), _bad_words_token_ids=[[5], [11, 12], [13, 14, 15], [20, 21]]),
        _with(SamplingParams(min_tokens=3, stop_token_ids=[2]), _eos_token_ids=[0]),
        _with(SamplingParams(min_tokens=2, stop_token_ids=[2]), _eos_token_ids=[0]),
        SamplingParams(),
    ]
    histories = [([1, 2], [3]), ([1], []), ([11, 20], [13, 14, 9, 11]),
                 ([5, 6], [7, 8]), ([5, 6], [7, 8]), ([1], [2])]
    batch, table, sampler = make_batch(params, histories, VOCAB, rows=[4, 0, 2, 1, 3, 5])
    logits = torch.randn(len(params), VOCAB, generator=g)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 2.5
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[[1, 4, 9]] = True
    expected[1, ~keep] = float("-inf")
    # Row 2's output ends with 11: [11, 12] bans 12; [13, 14, 15] needs output ending 13 14
    # (it ends 9 11: not banned); [20, 21]: 20 is in the prompt only (not banned).
    expected[2, 5] = float("-inf")
    expected[2, 12] = float("-inf")
    expected[3, [0, 2]] = float("-inf")  # 2 outputs < min_tokens 3; row 4 has reached 2
    special = sampler.plan(batch).rare
    assert [b for b, _ in special] == [0, 1, 2, 3, 4]
    apply_masks(logits, batch.idx_mapping, table, sampler.state, special)
    torch.testing.assert_close(logits, expected)


def test_bad_word_prefix_across_steps() -> None:
    p = _with(SamplingParams(), _bad_words_token_ids=[[13, 14, 15]])
    batch, table, sampler = make_batch([p], [([1], [13, 14])], VOCAB)
    logits = torch.zeros(1, VOCAB)
    apply_masks(logits, batch.idx_mapping, table, sampler.state, sampler.plan(batch).rare)
    assert torch.isinf(logits[0, 15]) and torch.isfinite(logits).sum() == VOCAB - 1


def test_sampler_applies_penalties_then_samples_greedy() -> None:
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.4,
                             presence_penalty=0.3),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={6: 50.0})]
    histories = [([1, 2, 3], [4, 4, 5]), ([1], [2]), ([0], [])]
    batch, table, sampler = make_batch(params, histories, VOCAB, rows=[2, 0, 1])
    logits = torch.randn(3, VOCAB, generator=g) * 2
    logits[0, 4] = 10.0  # favourite, but penalized
    logits[0, 2] = 9.5
    logits[0, 7] = 6.0
    out = sampler(logits.clone(), batch, table)
    # Row 0: 4 -> 10/1.7 - 2*0.4 - 0.3 = 4.78; 2 -> 9.5/1.7 = 5.59; 7 -> 6.0 (unseen) wins.
    assert out.tokens.tolist() == [7, int(logits[1].argmax()), 6]
    assert out.logprobs is None


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    """vLLM adds the bias, then penalizes: a repetition penalty divides the biased logit."""
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={3: 4.0})
    batch, table, sampler = make_batch([p], [([3], [])], VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 5] = 1.0, 3.0
    # (1 + 4) / 2 = 2.5 < 3 (penalizing first would give 1 / 2 + 4 = 4.5)
    assert sampler(logits, batch, table).tokens.tolist() == [5]


def test_top_k_and_min_tokens_past_int64_take_a_row() -> None:
    """Validation bounds neither: a huge ``top_k`` is top-k off, a huge ``min_tokens`` (no
    max_tokens) masks EOS for ever, instead of an OverflowError failing the whole step."""
    huge = 2**64
    params = [SamplingParams(temperature=0.7, top_k=huge),
              _with(SamplingParams(temperature=0, min_tokens=huge, max_tokens=None),
                    _eos_token_ids=[0]),
              SamplingParams(temperature=0.7)]
    batch, table, sampler = make_batch(params, [([1], [2])] * 3, VOCAB, seeds=[3, 4, 3])
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[1, 0] = 50.0
    logits[2] = logits[0]
    tokens = sampler(logits, batch, table).tokens.tolist()
    assert tokens[0] == tokens[2] and tokens[1] != 0


def test_sampler_logprobs_are_raw_log_softmax() -> None:
    g = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=0.7, logprobs=3, presence_penalty=1.0),
              SamplingParams(temperature=1.0, logprobs=0), SamplingParams(temperature=0)]
    batch, table, sampler = make_batch(params, [([1], [2]), ([3], []), ([4], [])], VOCAB,
                              seeds=[5, 6, 7])
    logits = torch.randn(3, VOCAB, generator=g)
    raw = logits.clone()
    out = sampler(logits, batch, table)
    assert torch.equal(logits, raw)  # the raw logits are left untouched
    assert out.logprob_ids is not None and out.logprobs is not None
    assert out.sampled_rank is not None
    full = torch.log_softmax(raw, dim=-1)
    assert torch.equal(out.logprob_ids[:, 0], out.tokens)
    torch.testing.assert_close(out.logprobs, full.gather(1, out.logprob_ids))
    assert torch.equal(out.logprob_ids[:, 1:], full.topk(3, dim=-1).indices)
    chosen = full.gather(1, out.tokens[:, None])
    assert torch.equal(out.sampled_rank, (full >= chosen).sum(-1))


def test_prompt_logprobs_slices_bound_the_logits() -> None:
    from mrv2.sample.prompt_logprobs import PromptChunk, compute_prompt_logprobs

    g = torch.Generator().manual_seed(3)
    head = torch.randn(8, VOCAB, generator=g)
    hidden = torch.randn(12, 8, generator=g)
    prompt_a, prompt_b = list(range(1, 10)), [4, 5, 6, 7]
    _, table, _ = make_batch([SamplingParams(prompt_logprobs=2), SamplingParams(prompt_logprobs=0)],
                          [(prompt_a, []), (prompt_b, [])], VOCAB)
    sizes: list[int] = []

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        sizes.append(h.shape[0])
        return h @ head

    # Step rows 0..5: prompt_a positions 3..8 (its last token predicts no prompt token);
    # rows 6..9: prompt_b positions 0..3.
    chunks = [PromptChunk("a", 0, 0, 3, 5, 2), PromptChunk("b", 1, 6, 0, 3, 0)]
    out = compute_prompt_logprobs(hidden, lm_head, table, chunks, slice_tokens=3)
    assert max(sizes) == 3 and sum(sizes) == 8
    full = torch.log_softmax(hidden @ head, dim=-1)
    a, b = out
    assert (a.first_position, b.first_position) == (4, 1)
    targets_a = torch.tensor(prompt_a[4:9])
    torch.testing.assert_close(a.logprobs[:, 0], full[0:5].gather(1, targets_a[:, None])[:, 0])
    assert torch.equal(a.ids[:, 1:], full[0:5].topk(2, dim=-1).indices)
    targets_b = torch.tensor(prompt_b[1:4])
    torch.testing.assert_close(b.logprobs[:, 0], full[6:9].gather(1, targets_b[:, None])[:, 0])
    assert b.ids.shape == (3, 1)
    ranks = (full[6:9] >= full[6:9].gather(1, targets_b[:, None])).sum(-1)
    assert torch.equal(b.ranks, ranks)


def test_staged_penalty_state_of_a_resumed_request() -> None:
    """A resumed request's prefill is prompt + outputs: they split into mask and counts."""
    from sample_helpers import apply_on_cpu

    from mrv2.contract.requests import NewRequest
    from mrv2.contract.staged_edits import StagedEdits

    sampler = Sampler(3, VOCAB, torch.device("cpu"))
    first = SamplingParams(presence_penalty=1.0)
    staged = StagedEdits()
    sampler.add_request(NewRequest("old", [9, 5, 5], first, 0, []), 1, staged)
    apply_on_cpu(staged)
    state = sampler.state
    assert state.output_counts is not None and state.prompt_mask is not None
    state.output_counts[1, 5] = 7  # stale state of the row's previous request
    sampler.remove_request(1)
    params = SamplingParams(repetition_penalty=1.2, min_tokens=2)
    params._num_prompt_tokens = 3  # filled in by the engine: the original prompt's length
    staged = StagedEdits()
    sampler.add_request(NewRequest("x", [3, 4, 3, 8, 8, 2], params, 0, []), 1, staged)
    sampler.add_request(NewRequest("y", [6], SamplingParams(), 0, []), 0, staged)
    apply_on_cpu(staged)
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [3, 4]
    counts = state.output_counts[1]
    assert counts.nonzero().flatten().tolist() == [2, 8] and counts[8] == 2 and counts[2] == 1
    assert int(state.prompt_len[1]) == 3 and int(state.min_tokens[1]) == 2
    assert float(state.repetition_penalty[1]) == pytest.approx(1.2)
    assert state.num_penalty_rows == 1 and state.num_rare == 1
    state.record_sampled(torch.tensor([1, 0], dtype=torch.int32), torch.tensor([[8], [8]]),
                         torch.tensor([1, 0], dtype=torch.int32))
    assert int(state.output_counts[1, 8]) == 3 and int(state.output_counts[0, 8]) == 0


def test_a_burst_of_requests_stages_as_one_at_a_time() -> None:
    """``Sampler.add_requests`` (the runner's call for a step's new requests: one staged put
    per column block) leaves the same device columns, CPU flags and penalty state as one
    ``add_request`` per request, a resumed penalty request included; a subclass that
    overrides ``add_request`` alone still gets one call per request."""
    from sample_helpers import apply_on_cpu

    from mrv2.contract.requests import NewRequest
    from mrv2.contract.staged_edits import StagedEdits

    resumed = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=3)
    resumed._num_prompt_tokens = 2
    requests = [
        NewRequest("a", [4, 2, 9], SamplingParams(temperature=0.7, top_k=5, seed=11), 11, []),
        NewRequest("b", [1, 2, 3, 3, 7], resumed, 5, []),
        NewRequest("c", [8], SamplingParams(temperature=0.0), 0, []),
        NewRequest("d", [6, 6], SamplingParams(top_p=0.9, min_p=0.2, logprobs=2), 3, []),
    ]
    rows = [5, 0, 3, 1]
    one, many = Sampler(6, VOCAB, torch.device("cpu")), Sampler(6, VOCAB, torch.device("cpu"))
    staged = StagedEdits()
    for request, row in zip(requests, rows, strict=True):
        one.add_request(request, row, staged)
    apply_on_cpu(staged)
    staged = StagedEdits()
    many.add_requests(requests, rows, staged)
    apply_on_cpu(staged)
    a, b = one.state, many.state
    assert torch.equal(a.floats, b.floats) and torch.equal(a.ints, b.ints)
    assert b.floats[0, 5] == pytest.approx(0.7) and int(b.ints[1, 0]) == 5  # not all zeros
    for flag in ("greedy", "top_k_top_p", "min_p_on", "rare", "prompt_len_cpu"):
        assert np.array_equal(getattr(a, flag), getattr(b, flag)), flag
    assert a.params == b.params and (a.num_rare, a.num_penalty_rows) == (b.num_rare, 1) == (2, 1)
    assert a.output_counts is not None and b.output_counts is not None
    assert b.output_counts[0].nonzero().flatten().tolist() == [3, 7]
    assert torch.equal(a.output_counts, b.output_counts)
    assert torch.equal(a.prompt_mask, b.prompt_mask)

    calls: list[int] = []

    class PerRequest(Sampler):
        def add_request(self, request: NewRequest, row: int, staged: StagedEdits) -> None:
            calls.append(row)
            super().add_request(request, row, staged)

    PerRequest(6, VOCAB, torch.device("cpu")).add_requests(requests, rows, StagedEdits())
    assert calls == rows


def test_profile_scratch_runs_the_widest_stages() -> None:
    """The runner's memory probe (``Sampler.profile_scratch``) runs the temperature pass,
    top-k / top-p and the Gumbel kernel over dummy rows of the sampler's vocabulary."""
    sampler = Sampler(4, VOCAB, torch.device("cpu"))
    sampler.profile_scratch(6, torch.bfloat16)  # more rows than requests: a 1 + k step


def test_top_k_top_p_sampling_equals_filtering_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches with top-k / top-p rows sample with the filter's thresholds applied inside the
    sampling kernel (the kernels, or the torch path): the tokens of dividing by the
    temperature, filtering, then sampling, as a direct statement does."""
    from mrv2_kernels.gumbel import gumbel_sample_ref
    from mrv2_kernels.top_k_top_p import top_k_top_p_ref

    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=9, top_p=0.7),
              SamplingParams(temperature=0.9)]
    batch, table, sampler = make_batch(params, [([1, 2], [3])] * 5, VOCAB, seeds=[4, 5, 6, 7, 8])
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    rows = batch.logits_idx_mapping.long()
    state = sampler.state
    greedy = state.temperature[rows] < 1e-5
    x = logits / torch.where(greedy, 1.0, state.temperature[rows])[:, None]
    want = torch.empty(5, dtype=torch.int64)
    gumbel_sample_ref(top_k_top_p_ref(x, state.top_k[rows], state.top_p[rows]),
                      state.seed[rows], batch.logits_positions, greedy, want)
    for kernels in ("torch", "triton"):
        for keys in ("1", "0"):  # the thresholds in the sampling kernel / a filtered copy
            monkeypatch.setenv("MRV2_KERNELS", kernels)
            monkeypatch.setenv("MRV2_TOP_K_KEYS", keys)
            assert torch.equal(sampler(logits.clone(), batch, table).tokens, want), kernels
    # the filters matter: plain temperature sampling differs somewhere
    plain = torch.empty(5, dtype=torch.int64)
    gumbel_sample_ref(x, state.seed[rows], batch.logits_positions, greedy, plain)
    assert not torch.equal(plain, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_take_the_lowest_index_on_every_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy (temperature 0: SamplingParams raises one in (0, 0.01) to 0.01, as vLLM's) is
    torch's argmax: a tie goes to the lowest index, whatever stages the rows batched beside it
    bring (top-k, min-p, penalties, logprobs), through the torch and the Triton kernels."""
    others = [None, SamplingParams(temperature=0.8, top_k=3),
              SamplingParams(temperature=0.8, min_p=0.2), SamplingParams(temperature=0.8,
                                                                         presence_penalty=1.0),
              SamplingParams(temperature=0.8, logprobs=2), SamplingParams(temperature=0.7)]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 21, 33]] = 9.0  # a three-way tie at the maximum
    logits = logits.to(dtype)
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("MRV2_KERNELS", kernels)
        for other in others:
            params = [SamplingParams(temperature=0.0, top_k=-1, top_p=1.0)]
            if other is not None:
                params.append(other)
            batch, table, sampler = make_batch(params, [([1, 2], [3])] * len(params),
                                               VOCAB, seeds=[5] * len(params))
            out = sampler(logits[: len(params)].clone(), batch, table)
            assert int(out.tokens[0]) == 7, (kernels, other)
