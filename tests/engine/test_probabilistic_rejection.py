"""Probabilistic rejection end to end on CPU (``rejection_sample_method="probabilistic"``):
greedy rows stay exact, and a sampled token that went through verification has the target's
distribution (a chi-square test against HF's own probabilities, which also shows it would
catch a wrong distribution).

n-gram drafts are one-hot, so a draft ``d`` is kept with probability ``p(d)`` and a rejected
position resamples from ``p`` without ``d``; the law of the output is ``p`` either way.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint, redraw_weights

VOCAB = 16
#: Every token once: after any first output token, the 1-gram lookup finds a draft.
PROMPT = [3, 11, 0, 7, 14, 5, 9, 1, 12, 6, 15, 2, 10, 4, 13, 8]
STD = 0.15
NGRAM = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
         "prompt_lookup_max": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose next-token distributions are far from uniform (weights redrawn)."""
    import transformers

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM",
                                vocab_size=VOCAB, eos_token_id=VOCAB - 1, bos_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    redraw_weights(hf, seed=3, std=STD)
    hf.save_pretrained(path)
    return path


def _llm(checkpoint: Path, **kwargs: object) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, **kwargs)


def test_greedy_rows_are_exact_beside_sampled_ones(checkpoint: Path) -> None:
    prompts = [PROMPT, PROMPT[::-1], PROMPT[:7] * 2]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    hot = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    expected = [o.outputs[0].token_ids for o in _llm(checkpoint).generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)]
    llm = _llm(checkpoint, speculative_config={**NGRAM, "num_speculative_tokens": 3,
                                               "rejection_sample_method": "probabilistic"})
    params = [greedy, hot, greedy, hot, greedy, hot]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in (0, 1)], params)
    assert [o.outputs[0].token_ids for o in outs[::2]] == expected
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs[1::2])
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def _chi_square(observed: Counter[int], expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the vocabulary, cells with expected count < 5 pooled."""
    obs = torch.tensor([observed.get(v, 0) for v in range(VOCAB)], dtype=torch.float64)
    big = expected >= 5
    cells_o = torch.cat([obs[big], obs[~big].sum().view(1)])
    cells_e = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = cells_e > 0
    stat = float(((cells_o[keep] - cells_e[keep]) ** 2 / cells_e[keep]).sum())
    return stat, int(keep.sum()) - 1


def _critical(df: int) -> float:
    """The chi-square quantile at p = 1e-4 (Wilson-Hilferty; z = 3.719)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + 3.719 * math.sqrt(a)) ** 3


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_verified_token_has_the_target_distribution(checkpoint: Path,
                                                    temperature: float) -> None:
    """The second output token (the one verified against a 1-gram draft) of 1,500 seeded
    requests, against the exact mixture of HF's next-token probabilities given each first
    token, at the request's temperature (a temperature other than 1 without top-k / top-p /
    min-p once verified at 1: the T = 1 law)."""
    import transformers

    n = 1500
    llm = _llm(checkpoint, speculative_config={**NGRAM,
                                               "rejection_sample_method": "probabilistic"})
    assert llm.engine.runner.sampler.verify_method == "probabilistic"
    # (max_tokens 3: the step that makes the second token has room for one draft)
    params = [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, params, use_tqdm=False)
    pairs = [(o.outputs[0].token_ids[0], o.outputs[0].token_ids[1]) for o in outs]
    stats = llm.engine.stats()
    drafts, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert drafts >= n and 0 < accepted < n  # both outcomes of the test happened

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint),
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        firsts = sorted({t1 for t1, _ in pairs})
        logits = hf(torch.tensor([PROMPT + [t1] for t1 in firsts])).logits[:, -1].double()
    by_first = dict(zip(firsts, logits, strict=True))
    observed = Counter(t2 for _, t2 in pairs)
    other = 0.7 if temperature == 1.0 else 1.0
    for t, should_pass in ((temperature, True), (other, False)):
        expected = sum(torch.softmax(by_first[t1] / t, -1) for t1, _ in pairs)
        assert isinstance(expected, torch.Tensor)
        stat, df = _chi_square(observed, expected)
        assert (stat < _critical(df)) == should_pass, (t, stat, df)


def test_unknown_method_names_the_field(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"rejection_sample_method[\s\S]*'strict', "
                                         r"'probabilistic' or 'synthetic'"):
        _llm(checkpoint, speculative_config={**NGRAM, "rejection_sample_method": "fast"})


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_synthetic_acceptance_keeps_drafts_at_the_rate(checkpoint: Path, rate: float) -> None:
    """Benchmarks only: each draft is kept with probability ``rate`` whatever the model says;
    greedy requests too (the noise keys are the request seed and the position)."""
    llm = _llm(checkpoint, speculative_config={
        **NGRAM, "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rate": rate})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 40, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert all(0 <= t < VOCAB for o in outs for t in o.outputs[0].token_ids)
    stats = llm.engine.stats()
    per_pos = stats["spec_acceptance_rate_per_pos"]
    assert stats["spec_num_drafts_per_pos"][0] >= 200
    if rate in (0.0, 1.0):
        assert per_pos[0] == rate and stats["spec_acceptance_rate"] == rate
    else:  # binomial: 5 standard deviations
        n = stats["spec_num_drafts_per_pos"][0]
        assert abs(per_pos[0] - rate) < 5 * math.sqrt(rate * (1 - rate) / n)


def test_synthetic_needs_its_rate() -> None:
    from mrv2.config import EngineConfig

    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        EngineConfig.from_kwargs(speculative_config={**NGRAM,
                                                     "rejection_sample_method": "synthetic"})
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        EngineConfig.from_kwargs(speculative_config={**NGRAM, "synthetic_acceptance_rate": 0.5})
