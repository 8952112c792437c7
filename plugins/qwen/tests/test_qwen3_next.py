"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, gated shared expert) through the engine
against HF transformers, on one rank and split over two: greedy tokens of several requests at
once (HF's full forward per token: its chunked delta rule, an independent form of ours),
prompts split across steps (the recurrent and convolution states carried between chunks),
preemption (the request computed again from a zero state), every prompt position's
log-probability; prefix caching through state snapshots; speculative decoding refused for it;
names and bad configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import MoEBlock
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.testing import hf_greedy
from mrv2.testing_engine import (
    check_prompt_logprobs,
    check_state_prefix_cache,
    check_state_speculation,
    tokens_at_tp,
)
from mrv2_qwen.qwen3_next import GatedDeltaNet, Qwen3NextForCausalLM
from mrv2_qwen.testing import save_tiny_qwen3_next

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]


def _checkpoint(path: Path) -> torch.nn.Module:
    return save_tiny_qwen3_next(path)


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 8},
                                    {"num_gpu_blocks_override": 12}],
                         ids=["plain", "chunked", "preempt"])
def test_greedy_and_logprobs_match_hf(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    hf = _checkpoint(tmp_path)
    want = [hf_greedy(tmp_path, p, 10) for p in PROMPTS]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True, **kwargs)
    assert llm.engine.prefix_caching is True  # (with snapshots of the state)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    # a second round on the rows the first one left (each request starts from a zero state)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[::-1]], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want[::-1]

    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


@pytest.mark.parametrize("chunked", [False, True], ids=["serial", "chunked"])
def test_prefix_cache_resumes_from_state_snapshots(tmp_path: Path, chunked: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests resume from state snapshots; ``chunked``: every prompt chunk of 4 tokens or
    more through the chunked delta rule (its snapshots inside a chunk, its resumed rows)."""
    from mrv2_kernels import chunk_delta_rule

    monkeypatch.setattr(chunk_delta_rule, "CHUNKED_MIN_QUERY_LEN_DELTA", 4 if chunked else 10**9)
    monkeypatch.setenv(chunk_delta_rule.CHUNKED_ENV_VAR, "1")  # (the delta rule: opt-in)
    _checkpoint(tmp_path)
    check_state_prefix_cache(tmp_path)


@pytest.mark.parametrize("chunked", [False, True], ids=["serial", "chunked"])
def test_speculative_decoding_keeps_only_accepted_states(
        tmp_path: Path, chunked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram drafts verified through the Gated DeltaNet layers: rejected drafts leave no
    trace in the recurrent or conv state (greedy tokens equal HF's), with prefix caching's
    snapshots on beside them; ``chunked``: every step with a query of 4 tokens or more
    through the chunked delta rule (verifies beside prompt chunks, its kept states)."""
    from mrv2_kernels import chunk_delta_rule

    monkeypatch.setattr(chunk_delta_rule, "CHUNKED_MIN_QUERY_LEN_DELTA", 4 if chunked else 10**9)
    monkeypatch.setenv(chunk_delta_rule.CHUNKED_ENV_VAR, "1")  # (the delta rule: opt-in)
    _checkpoint(tmp_path)
    check_state_speculation(tmp_path, enable_prefix_caching=True)


def test_structure_names_and_refusals(tmp_path: Path) -> None:
    _checkpoint(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = Qwen3NextForCausalLM(config)
    layers = model.model.layers
    assert [layer.linear for layer in layers] == [True, True, False, True]
    assert isinstance(layers[0].linear_attn, GatedDeltaNet)
    assert type(layers[1].mlp).__name__ == "GatedMLP"
    moe = layers[0].mlp
    assert isinstance(moe, MoEBlock) and moe.shared_expert_gate is not None
    assert layers[2].self_attn.attn.layer_idx == 0  # (the only KV cache layer)
    shapes = layers[0].linear_attn.request_state_shapes()
    assert shapes == {"conv": ((3, 2 * 32 + 32), None), "recurrent": ((4, 16, 8), torch.float32)}

    from mrv2.model_loader import iter_safetensors, load_model_weights
    loaded = load_model_weights(model, iter_safetensors(tmp_path))
    assert loaded == {n for n, _ in model.named_parameters()}
    mtp = [("mtp.fc.weight", torch.randn(4, 4)), ("model.norm.weight", torch.randn(64))]
    assert model.load_weights(mtp) == {"model.norm.weight"}  # (the MTP head: not loaded)

    with pytest.raises(ValueError, match=r"speculative_config.model: the draft model "
                                         r"\(Qwen3NextForCausalLM\) keeps per-request "
                                         r"recurrent state"):
        LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, speculative_config={
            "method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    bad = transformers.AutoConfig.from_pretrained(tmp_path)
    bad.layer_types = ["linear_attention", "sliding_attention", "full_attention",
                       "linear_attention"]
    with pytest.raises(ValueError, match=r"layer_types must list one of \['linear_attention', "
                                         r"'full_attention'\] per layer"):
        Qwen3NextForCausalLM(bad)
    bad = transformers.AutoConfig.from_pretrained(tmp_path)
    bad.linear_num_value_heads = 3
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of "
                                         r"linear_num_key_heads \(2\)"):
        Qwen3NextForCausalLM(bad)


def test_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """Two ranks (processes on the CPU): each holds one key-head group of every linear-attention
    layer (its conv channels, decays and states), half the attention heads and of each expert;
    greedy tokens equal HF's, prompts split across steps."""
    _checkpoint(tmp_path)
    want = [hf_greedy(tmp_path, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for tp, got in tokens_at_tp(tmp_path, PROMPTS, params, (2,),
                                max_num_batched_tokens=8).items():
        assert got == want, tp


def test_sleep_frees_the_request_state(tmp_path: Path) -> None:
    """Sleep mode gives the per-request state's memory back with the KV cache (zeroed on
    waking) and forgets the state snapshots: after waking, the same tokens, nothing cached."""
    _checkpoint(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    states = [t for layer in llm.engine.runner.model_state.request_state_layers
              for t in layer.request_states.values()]
    sizes = [t.untyped_storage().nbytes() for t in states]
    snapshots = llm.engine.scheduler.snapshots
    assert snapshots is not None and snapshots.num_published > 0
    llm.sleep()
    assert all(t.untyped_storage().nbytes() == 0 for t in states)
    assert snapshots.num_published == 0
    llm.wake_up()
    assert [t.untyped_storage().nbytes() for t in states] == sizes
    assert all(bool((t == 0).all()) for t in states)
    after = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == before
    assert all(o.num_cached_tokens == 0 for o in after)


def _fp8_in_projections(dst: Path, reference: Path, block: int) -> None:
    """Quantize the linear-attention input projections (``in_proj_qkvz``, ``in_proj_ba``) of
    block-FP8 checkpoint ``dst`` too, as Qwen3-Next-FP8 stores them: e4m3 values and a
    ``weight_scale_inv`` per ``block`` x ``block`` (its amax / 448), written from the format's
    description; ``reference`` gets the dequantized weights."""
    from safetensors.torch import load_file, save_file

    stored = load_file(dst / "model.safetensors")
    real = load_file(reference / "model.safetensors")
    for name in [n for n in stored if ".linear_attn.in_proj_" in n]:
        w = stored[name].float()
        n, k = w.shape
        nb, kb = -(-n // block), -(-k // block)
        scale = torch.ones(nb, kb)
        for i in range(nb):
            for j in range(kb):
                amax = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().max()
                scale[i, j] = amax / 448 if amax > 0 else 1.0
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        stored[name], stored[name + "_scale_inv"] = q, scale
        real[name] = (q.float() * full).to(real[name].dtype)
    save_file(stored, dst / "model.safetensors")
    save_file(real, reference / "model.safetensors")


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path) -> None:
    """A block-FP8 checkpoint (as Qwen3-Next-80B-A3B-FP8, 16 x 16 blocks here), the
    linear-attention projections whose rows are regrouped after loading included: built on
    the meta device, it loads, and HF's greedy tokens on the dequantized weights match."""
    from mrv2.testing_checkpoints import fp8_checkpoint

    _checkpoint(tmp_path / "src")
    fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", (16, 16))
    _fp8_in_projections(tmp_path / "fp8", tmp_path / "ref", 16)
    want = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    llm = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_gptq_checkpoint_with_quantized_input_projections(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPTQ checkpoint quantizing every linear layer, the linear-attention input
    projections (whose rows are regrouped after loading) included: it loads, and HF's greedy
    tokens on the dequantized weights match."""
    from safetensors.torch import load_file

    from mrv2 import testing_quant

    plain = testing_quant.is_quantized_weight
    monkeypatch.setattr(testing_quant, "is_quantized_weight", lambda n, t, experts=False: (
        plain(n, t, experts=experts) or ".linear_attn.in_proj_" in n and t.dim() == 2))
    _checkpoint(tmp_path / "src")
    testing_quant.gptq_checkpoint(tmp_path / "src", tmp_path / "q", tmp_path / "ref", bits=4,
                                  group_size=16, sym=False, desc_act=True)
    assert "model.layers.0.linear_attn.in_proj_qkvz.qweight" in load_file(tmp_path / "q" /
                                                                  "model.safetensors")
    want = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    llm = LLM(str(tmp_path / "q"), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.reload_weights()  # (the rows regrouped once again, not twice)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want

    # kept packed (a GPU's layout): a reload regroups the packed rows it loaded, once
    monkeypatch.setattr(IntLinearMixin, "_become_plain", lambda self: None)
    packed = LLM(str(tmp_path / "q"), device="cpu", dtype="float32", block_size=4)
    projections = [m for m in packed.engine.runner.model.modules()
                   if isinstance(m, IntLinearMixin) and m.row_order is not None]
    assert projections
    before = [m.dequantized(torch.float32) for m in projections]
    packed.reload_weights()
    for layer, weight in zip(projections, before, strict=True):
        assert torch.equal(layer.dequantized(torch.float32), weight)


def test_the_start_up_kv_check_counts_only_the_attention_layers(tmp_path: Path) -> None:
    """The start-up check that one request of max_model_len fits a KV cache sized from
    memory counts the blocks the engine takes: its attention layers' (the Gated DeltaNet
    layers keep a state a request, no blocks). Exactly that many blocks start; one fewer is
    refused naming max_model_len."""
    _checkpoint(tmp_path)
    kwargs: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                              "max_model_len": 64}
    runner = LLM(str(tmp_path), num_gpu_blocks_override=1, **kwargs).engine.runner
    per_block = runner.kv.bytes_per_block(4, runner.dtype)
    attention = sum(hasattr(layer, "self_attn") for layer in runner.model.model.layers)
    assert 0 < attention < len(runner.model.model.layers)
    assert per_block == attention * 2 * 4 * runner.hf_config.num_key_value_heads * (
        runner.hf_config.head_dim) * 4
    llm = LLM(str(tmp_path), cpu_kv_cache_gb=16.5 * per_block / (1 << 30), **kwargs)
    assert llm.engine.block_manager.num_blocks == 16  # 64 tokens of 4
    with pytest.raises(ValueError, match="max_model_len 64 tokens needs 16 blocks"):
        LLM(str(tmp_path), cpu_kv_cache_gb=15.5 * per_block / (1 << 30), **kwargs)


def test_zero_size_shared_expert_matches_hf(tmp_path: Path) -> None:
    """``shared_expert_intermediate_size: 0``: HF builds a zero-width shared expert and its
    gate (their product adds nothing) and saves both; mrv2 builds neither, loads the
    checkpoint (the empty tensors and the gate passed over) and gives HF's tokens and
    prompt log-probabilities."""
    hf = save_tiny_qwen3_next(tmp_path, shared_expert_intermediate_size=0)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoEBlock)]
    assert blocks and all(b.shared_experts is None and b.shared_expert_gate is None
                          for b in blocks)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tmp_path, PROMPTS[0], 8)
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_on_the_delta_net_and_attention_matches_merged(tmp_path: Path, tp: int) -> None:
    """A LoRA adapter on the Gated DeltaNet's ``in_proj_qkvz`` / ``in_proj_ba`` (rows grouped
    per key head as the checkpoint's: its ``B`` regrouped as the weight is) and ``out_proj``,
    on the gated attention's projections, the dense MLP and the shared experts: greedy tokens
    equal HF's on the adapter merged into the base, on one rank and over two (each its
    key-head groups)."""
    from mrv2_qwen.testing import lora_against_merged

    _checkpoint(tmp_path / "base")
    got, want, plain = lora_against_merged(
        tmp_path / "base", tmp_path, ("in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj",
                                      "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                      "down_proj"),
        PROMPTS[:2], tensor_parallel_size=tp)
    assert want != plain  # (the adapter changes the tokens)
    assert got == want
