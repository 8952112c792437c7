"""Draft-model speculation on CPU: a model drafting for itself has every draft accepted (greedy
and seeded sampling), another model changes nothing but speed, under chunked prefill, prefix
caching and preemption; bad drafts are refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
NEW = 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def other(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on every matrix: a draft that is often right, not always (two
    independent random models agree only by chance)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("draft")
    shutil.copy(target / "config.json", path / "config.json")
    gen = torch.Generator().manual_seed(7)
    tensors = {name: t + torch.randn(t.shape, generator=gen) * 0.004 if t.dim() == 2 else t
               for name, t in load_file(target / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller model of another family with the target's vocabulary."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("small"), "LlamaForCausalLM", seed=7,
                                num_hidden_layers=1, hidden_size=32, intermediate_size=64)


def _llm(target: Path, draft: Path | None, k: int = 3, **kwargs: object) -> LLM:
    if draft is not None:
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft),
                                        "num_speculative_tokens": k}
    return LLM(str(target), device="cpu", dtype="float32", block_size=4, **kwargs)


def _run(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(target: Path) -> list[list[int]]:
    return _run(_llm(target, None))


def test_target_as_its_own_draft_accepts_everything(target: Path,
                                                    expected: list[list[int]]) -> None:
    llm = _llm(target, target)
    assert _run(llm) == expected
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_acceptance_rate"] == 1.0
    assert llm.engine.block_manager.usage == 0.0


def test_seeded_sampling_self_draft_accepts_everything_and_equals_no_speculation(
        target: Path) -> None:
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=NEW, ignore_eos=True)
              for s in range(len(PROMPTS))]
    plain = _run(_llm(target, None), params)
    llm = _llm(target, target, k=2)
    assert _run(llm, params) == plain
    assert llm.engine.stats()["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("kwargs", [
    {}, {"max_num_batched_tokens": 8}, {"num_gpu_blocks_override": 18},
    {"enable_prefix_caching": False},
], ids=["plain", "chunked", "tiny-cache", "no-prefix-cache"])
def test_another_model_changes_nothing_but_speed(target: Path, other: Path,
                                                  expected: list[list[int]],
                                                  kwargs: dict[str, object]) -> None:
    llm = _llm(target, other, **kwargs)
    assert _run(llm) == expected
    stats = llm.engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    if "num_gpu_blocks_override" in kwargs:
        assert stats["num_preemptions"] > 0
    assert llm.engine.block_manager.usage == 0.0


def test_probabilistic_rejection_with_a_draft_model(target: Path, other: Path,
                                                    expected: list[list[int]]) -> None:
    """Argmax drafts (a one-hot q) under the probabilistic test: greedy output exact, sampled
    requests served, drafts accepted."""
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, speculative_config={
        "method": "draft_model", "model": str(other), "num_speculative_tokens": 3,
        "rejection_sample_method": "probabilistic"})
    assert _run(llm) == expected
    hot = [SamplingParams(temperature=0.9, seed=s, max_tokens=NEW, ignore_eos=True)
           for s in range(len(PROMPTS))]
    assert all(len(t) == NEW for t in _run(llm, hot))
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def test_a_draft_of_another_family(target: Path, small: Path,
                                   expected: list[list[int]]) -> None:
    llm = _llm(target, small, k=2)
    assert _run(llm) == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_bad_drafts_are_refused(target: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(target), device="cpu", speculative_config={"method": "draft_model",
                                                            "num_speculative_tokens": 2})
    small_vocab = make_tiny_checkpoint(tmp_path / "v", "Qwen3ForCausalLM", vocab_size=128)
    with pytest.raises(ValueError, match=r"vocab_size \(128\) must equal the target's \(256\)"):
        _llm(target, small_vocab)


def test_a_draft_of_shorter_context_is_refused_up_front(target: Path, tmp_path: Path) -> None:
    """A draft model whose positions end before ``max_model_len`` would fail mid-run (its
    rotary table read past its end, every request of the step lost): refused at start-up,
    and taken with ``max_model_len`` within its context."""
    short = make_tiny_checkpoint(tmp_path / "short", "Qwen3ForCausalLM",
                                 max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"max_position_embeddings \(32\) is below "
                                         r"max_model_len \(\d+\)[\s\S]*at most 32"):
        _llm(target, short)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS if len(p) < 24]

    def run(draft: Path | None) -> list[list[int]]:
        outs = _llm(target, draft, max_model_len=32).generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert run(short) == run(None)


def test_a_request_past_the_pool_names_the_lookahead(target: Path) -> None:
    """47 tokens fit 12 blocks of 4; the drafter's 3 lookahead slots need a 13th: the refusal
    says so (it read as 47 tokens needing 13 blocks)."""
    llm = _llm(target, target, num_gpu_blocks_override=12)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with pytest.raises(ValueError, match=r"47 tokens \(and the drafter's 3 lookahead slots\) "
                                         r"needs 13 KV blocks; the cache has 12"):
        llm.generate([{"prompt_token_ids": list(range(1, 18))}], params, use_tqdm=False)


def test_a_draft_reaches_a_context_rope_scaling_derives(tmp_path: Path) -> None:
    """Target and draft with YaRN (original 64 * factor 4): both reach ``max_model_len`` 256,
    past their ``max_position_embeddings`` 64, so a 100-token prompt drafts (every draft of
    the model for itself accepted); a draft without the scaling is refused, naming why."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 1e4}
    target = make_tiny_checkpoint(tmp_path / "t", "Qwen3ForCausalLM", std=0.15,
                                  max_position_embeddings=64, rope_parameters=yarn)
    prompt = [{"prompt_token_ids": [(7 * i + 3) % 250 + 2 for i in range(100)]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = _llm(target, target)
    assert llm.engine.runner.max_model_len == 256
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    want = _llm(target, None).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    plain = make_tiny_checkpoint(tmp_path / "p", "Qwen3ForCausalLM", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_position_embeddings \(64\) is below "
                                         r"max_model_len \(256\)[\s\S]*at most 64"):
        _llm(target, plain)
