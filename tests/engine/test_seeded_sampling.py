"""Seeded sampling: the same tokens whatever else shares the batch; the sampler's stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.sample.sampler import apply_min_p, apply_top_k_top_p
from mrv2.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM")
    return LLM(str(path), device="cpu", dtype="float32", block_size=4)


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_ignores_batch_composition(llm: LLM) -> None:
    target = [11, 22, 33, 44]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=10,
                            ignore_eos=True)
    alone = _tokens(llm, [target], [params])[0]
    others = [[7] * 9, [3, 1, 4, 1, 5, 9, 2, 6], [200, 100]]
    other_params = [SamplingParams(temperature=0.8, seed=s, max_tokens=5 + s, ignore_eos=True)
                    for s in range(3)]
    mixed = _tokens(llm, [others[0], target, *others[1:]],
                    [other_params[0], params, *other_params[1:]])
    assert mixed[1] == alone
    # A different seed gives a different sample (for a random-weight model with a flat
    # distribution, 10 equal tokens by chance is negligible).
    other_seed = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=99, max_tokens=10,
                                ignore_eos=True)
    assert _tokens(llm, [target], [other_seed])[0] != alone


def test_unseeded_requests_differ_but_runs_repeat(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, seed=7)
        runs.append(_tokens(llm, [[5, 6, 7], [5, 6, 7]], [params, params]))
    assert runs[0] == runs[1]  # engine seed makes the whole run reproducible
    assert runs[0][0] != runs[0][1]  # two unseeded requests draw different noise


def test_top_k_top_p_mask() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    top_k = torch.tensor([3, 0, 10])
    top_p = torch.tensor([1.0, 0.5, 1.0])
    out = apply_top_k_top_p(logits, top_k, top_p)
    kept = torch.isfinite(out)
    assert kept[0].sum() == 3 and set(kept[0].nonzero().flatten().tolist()) == set(
        logits[0].topk(3).indices.tolist()
    )
    probs = torch.softmax(logits[1], -1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    n_keep = int((cum - probs[order] < 0.5).sum())
    assert kept[1].sum() == n_keep
    assert kept[2].all()
    torch.testing.assert_close(out[kept], logits[kept])


def test_min_p_mask() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.2]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]
