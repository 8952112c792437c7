"""``LLM.update_weights`` (an RL trainer's new policy loaded in place between rollouts, as
TRL and verl do with vLLM): after loading checkpoint B's tensors into an engine built on A,
greedy tokens are HF's on B, for each family's layouts (dense, MoE, GLM, DeepSeek's MLA),
through the emulated CUDA-graph path and with the prefix cache forgotten (its KV was A's);
``reset_prefix_cache`` refuses while requests are in flight; what cannot be updated in place
is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.model_loader.loader import iter_safetensors
from mrv2.testing import TINY_FAMILIES, emulate_cuda_graphs, hf_greedy, make_tiny_checkpoint
from mrv2.testing_checkpoints import save_checkpoint_like

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 16}), **TINY_FAMILIES}
PROMPT = [5, 17, 42, 9, 100, 3, 77, 8, 21]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[
        0].token_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_new_weights_give_the_new_models_tokens(family: str, tmp_path: Path) -> None:
    """std 0.15: every layer shapes the tokens (at HF's init a wrongly loaded expert or head
    barely changes them)."""
    architecture, overrides = FAMILIES[family]
    a = make_tiny_checkpoint(tmp_path / "a", architecture, seed=1, std=0.15, **overrides)
    b = make_tiny_checkpoint(tmp_path / "b", architecture, seed=2, std=0.15, **overrides)
    want = hf_greedy(b, PROMPT, 8)
    llm = LLM(str(a), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              enable_prefix_caching=True)
    emulate_cuda_graphs(llm.engine.runner)
    assert _tokens(llm) == hf_greedy(a, PROMPT, 8) != want  # (the prompt's blocks cached)
    loaded = llm.engine.update_weights_from_disk(str(b))  # (checked whole, then loaded)
    assert loaded == {name for name, _ in llm.engine.runner.model.named_parameters()}
    out = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 0  # nothing of A's KV was reused


def test_refusals(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", head_dim=16)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64)
    llm.engine.add_request(PROMPT, GREEDY)
    assert llm.reset_prefix_cache() is False
    with pytest.raises(RuntimeError, match="idle"):
        llm.update_weights(iter_safetensors(str(path)))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="matches no parameter"):
        llm.update_weights([("model.layers.0.nothing.weight", PROMPT)])  # type: ignore[list-item]
    fp8 = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              quantization="fp8")
    with pytest.raises(ValueError, match="fp8"):
        fp8.update_weights(iter_safetensors(str(path)))


def test_some_modules_only(tmp_path: Path) -> None:
    """DeepSeek-V2 (its MLA module reorders the RoPE rows of what it loads and derives the
    per-head up-projections): new weights for the first layer's attention only give the
    tokens and logprobs of the checkpoint mixing the two; the modules not given keep theirs
    as they were (not reordered twice)."""
    from safetensors.torch import load_file

    architecture, overrides = FAMILIES["deepseek-v2-lite"]
    a = make_tiny_checkpoint(tmp_path / "a", architecture, seed=1, **overrides)
    b = make_tiny_checkpoint(tmp_path / "b", architecture, seed=2, **overrides)
    new = {k: v for k, v in load_file(str(b / "model.safetensors")).items()
           if k.startswith("model.layers.0.self_attn.")}
    mixed = save_checkpoint_like(a, tmp_path / "mixed",
                                 {**load_file(str(a / "model.safetensors")), **new})
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)

    def logprobs(llm: LLM) -> list[float]:
        out = llm.generate({"prompt_token_ids": PROMPT}, scored, use_tqdm=False)[0]
        positions = [*(out.prompt_logprobs or [])[1:], *(out.outputs[0].logprobs or [])]
        return [lp.logprob for p in positions if p for lp in p.values()]

    kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4,
                                  max_model_len=64)
    want = logprobs(LLM(str(mixed), **kwargs))  # (its loading: parity-tested with HF)
    llm = LLM(str(a), **kwargs)
    assert _tokens(llm) == hf_greedy(a, PROMPT, 8)
    llm.update_weights(list(new.items()))  # (checked on meta parameters first)
    assert _tokens(llm) == hf_greedy(mixed, PROMPT, 8)
    assert logprobs(llm) == pytest.approx(want, abs=1e-5)


def test_a_module_given_other_tensors_is_not_reordered_twice(tmp_path: Path) -> None:
    """DeepSeek's MLA reorders its q and kv_a rows (interleaved RoPE) after loading; an
    update of another of its tensors (``o_proj``, the same values) reruns its hook, which
    must leave the rows it did not get as they are (it reordered them again: other tokens)."""
    from safetensors.torch import load_file

    architecture, overrides = FAMILIES["deepseek-v2-lite"]
    a = make_tiny_checkpoint(tmp_path / "a", architecture, seed=1, std=0.15, **overrides)
    llm = LLM(str(a), device="cpu", dtype="float32", block_size=4, max_model_len=64)
    want = hf_greedy(a, PROMPT, 8)
    assert _tokens(llm) == want
    name = "model.layers.0.self_attn.o_proj.weight"
    llm.update_weights([(name, load_file(str(a / "model.safetensors"))[name])])
    assert _tokens(llm) == want


def test_a_refused_load_changes_no_weight(tmp_path: Path) -> None:
    """A list of tensors, or a checkpoint directory, with a bad name or a bad shape past its
    first tensors is refused before any weight is written (no half-updated model); an
    iterator is loaded as it comes."""
    import torch

    path = make_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", head_dim=16)
    other = make_tiny_checkpoint(tmp_path / "wide", "Qwen3ForCausalLM", head_dim=16,
                                 hidden_size=128)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64)
    model = llm.engine.runner.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    new = [(name, t + 1) for name, t in iter_safetensors(str(path))]

    def changed() -> list[str]:
        return [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]

    with pytest.raises(ValueError, match="matches no parameter"):
        llm.update_weights([*new, ("model.layers.0.nothing.weight", new[0][1])])
    with pytest.raises(ValueError, match="expects shape"):
        llm.update_weights((*new[:-1], (new[-1][0], torch.zeros(3, 5))))
    assert changed() == []
    with pytest.raises(ValueError, match="expects shape"):
        llm.engine.update_weights_from_disk(str(other))
    assert changed() == []
    assert all(p.device.type == "cpu" for p in model.parameters())  # (all put back)
    assert _tokens(llm) == hf_greedy(path, PROMPT, 8)


def test_the_check_writes_no_buffer_either() -> None:
    """The whole-list check runs the model's loader on meta tensors: an encoder loading
    buffers too (Gemma 4's vision clip bounds and standardization, ``buffers=True``) must
    not have them written by a list refused further on; the check puts them all back."""
    import torch
    from torch import nn

    from mrv2.layers.weights import load_encoder_weights
    from mrv2.runner.between_steps import BetweenSteps

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

        def load_weights(self, weights: Any) -> set[str]:
            return load_encoder_weights(self, weights, lambda name: name, "encoder",
                                        buffers=True)

    runner: Any = BetweenSteps()
    runner.model = Encoder()
    buffers = dict(runner.model.named_buffers())
    with pytest.raises(ValueError, match="no parameter or buffer 'nothing'"):
        runner.check_weights([("scale", torch.full((2,), 7.0)), ("nothing", torch.ones(1))])
    assert runner.model.scale.tolist() == [1.0, 1.0]
    assert dict(runner.model.named_buffers()) == buffers  # (the same tensors, put back)
    runner.check_weights([("scale", torch.full((2,), 7.0)), ("proj.weight", torch.ones(2, 2))])
    assert runner.model.scale.tolist() == [1.0, 1.0]
