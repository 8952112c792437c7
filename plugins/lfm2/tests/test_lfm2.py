"""LFM2 (gated short convolutions beside attention layers) against HF transformers: every
logit of prefill, decode and continued-chunk steps straight through the model (the
convolution state carried between them, in rows of a shared state table); greedy tokens of
several requests through the engine, prompts split across steps, preemption (the request
computed again from a zero state), a second round on the rows the first left, every prompt
position's log-probability; the convolution on its Triton kernel (interpreted); prefix
caching from state snapshots; speculative decoding; tensor parallelism by channels; a LoRA
adapter; HF's feed-forward sizing; the older ``full_attn_idxs`` configs; bad configs refused
by name. LFM2-MoE (dense layers, then sparse MoE blocks with a sigmoid router and an expert
bias) the same way: its router against HF's, every step logit, greedy tokens and prompt
log-probabilities with prompts split across steps, prefix caching, tensor parallelism."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.layers import FusedMoE, GatedMLP, GroupedTopKRouter, MoEBlock, SelfAttention
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_lfm2 import model as lfm2_model
from mrv2_lfm2.model import Lfm2ForCausalLM, ShortConv, ff_dim_of, layer_types_of
from mrv2_lfm2.moe import Lfm2MoeForCausalLM
from mrv2_lfm2.testing import save_tiny_lfm2, save_tiny_lfm2_moe

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
#: name -> overrides of TINY_LFM2: as it is (conv biases, untied head, a multiplier);
#: no biases, a tied head, the ``full_attn_idxs`` of an older config and the feed-forward's
#: width as ``intermediate_size`` says (``block_auto_adjust_ff_dim`` false: 100, no rounding).
#: ``moe*``: overrides of TINY_LFM2_MOE: as it is (expert bias, renormalized, scaled by 1.5);
#: no expert bias, no renormalization, no scale, one dense layer, no conv biases, tied head.
VARIANTS: dict[str, dict[str, Any]] = {
    "biased": {},
    "tied": {"conv_bias": False, "tie_word_embeddings": True, "layer_types": None,
             "full_attn_idxs": [2], "intermediate_size": 100,
             "block_auto_adjust_ff_dim": False},
    "moe": {},
    "moe-plain": {"use_expert_bias": False, "norm_topk_prob": False,
                  "routed_scaling_factor": 1.0, "num_dense_layers": 1, "conv_bias": False,
                  "tie_word_embeddings": True},
}
Checkpoint = tuple[Path, torch.nn.Module, list[list[int]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, overrides in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        save = save_tiny_lfm2_moe if name.startswith("moe") else save_tiny_lfm2
        hf = save(path, **overrides)
        out[name] = (path, hf, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS])
    return out


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("variant,kwargs", [
    ("biased", {"max_num_batched_tokens": 8}),
    ("biased", {"num_gpu_blocks_override": 12}),
    ("tied", {"max_num_batched_tokens": 8}),
    ("tied", {"max_num_batched_tokens": 8, "triton": True}),
    ("moe", {"max_num_batched_tokens": 8}),
    ("moe-plain", {"max_num_batched_tokens": 8}),
], ids=["chunked", "preempt", "tied-chunked", "tied-chunked-triton", "moe-chunked",
        "moe-plain-chunked"])
def test_greedy_and_logprobs_match_hf(checkpoints: dict[str, Checkpoint], variant: str,
                                      kwargs: dict[str, Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 tokens split the 29-token prompt (and the batch) mid-way: the convolution
    resumes from its state row. ``triton``: the convolution on its Triton kernel (interpreted
    on the CPU; one round, for time)."""
    path, hf, want = checkpoints[variant]
    kwargs = dict(kwargs)
    triton = kwargs.pop("triton", False)
    if triton:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
        from mrv2_kernels import linear_attention

        monkeypatch.setattr(linear_attention, "use_triton", lambda t: True)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True, **kwargs)
    assert llm.engine.runner.keeps_request_state
    assert llm.engine.prefix_caching is True  # (with snapshots of the state)
    assert _generate(llm, PROMPTS) == want
    if triton:
        return
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
        return
    # a second round on the rows the first one left (each request starts from a zero state)
    assert _generate(llm, PROMPTS[::-1]) == want[::-1]
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


@pytest.mark.parametrize("variant", ["biased", "moe", "moe-plain"])
def test_step_logits_match_hf(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """Straight through the model (torch attention over paged caches, state rows 2 and 0 of
    a 3-row table, row 1 poisoned): a prefill of 11 and 2 tokens (the second shorter than the
    convolution's state), a decode step, then a chunk of 5 and a decode; every logit against
    HF's full forward of the same tokens (LFM2-MoE: its tokens routed to several experts)."""
    from mrv2.attention import ForwardContext, set_forward_context
    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2.contract.request_state import allocate_request_states, request_state_layers
    from mrv2.model_loader import iter_safetensors, load_model_weights
    from mrv2.testing import TEST_BLOCK_SIZE, poisoned_caches, step_inputs, step_metadata

    path, hf, _ = checkpoints[variant]
    config = transformers.AutoConfig.from_pretrained(path)
    cls = Lfm2MoeForCausalLM if variant.startswith("moe") else Lfm2ForCausalLM
    model = cls(config).eval()
    load_model_weights(model, iter_safetensors(path))
    layers = request_state_layers(model)
    assert len(layers) == model.layer_types.count("conv") >= 2
    allocate_request_states(layers, 3, torch.float32, torch.device("cpu"))
    for layer in layers:
        layer.request_states["conv"][1].fill_(1e4)
    caches = poisoned_caches(2, 16, 2)
    tables = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]
    rows = torch.tensor([2, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (19,), generator=gen).tolist(),
            torch.randint(0, 128, (9,), generator=gen).tolist()]
    steps = [[11, 2], [1, 1], [5, 5], [1, 1]]
    done = [0, 0]
    for sizes in steps:
        new = [s[d:d + n] for s, d, n in zip(seqs, done, sizes, strict=True)]
        ids, positions = step_inputs(done, new)
        md = step_metadata(done, sizes, tables, block_size=TEST_BLOCK_SIZE)
        ctx = ForwardContext(md, caches, [TorchAttentionBackend()] * 2, state_rows=rows)
        with torch.inference_mode(), set_forward_context(ctx):
            logits = model.compute_logits(model(ids, positions))
        got = logits.split(sizes)
        for i, n in enumerate(sizes):
            end = done[i] + n
            with torch.no_grad():
                want = hf(torch.tensor([seqs[i][:end]])).logits[0, done[i]:end]
            torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
        done = [d + n for d, n in zip(done, sizes, strict=True)]


@pytest.mark.parametrize("variant", ["biased", "moe"])
def test_prefix_cache_resumes_from_state_snapshots(
        checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """Requests resume from snapshots of the convolutions' states (the attention's KV from
    the cached blocks beside them): greedy tokens equal HF's."""
    from mrv2.testing_engine import check_state_prefix_cache

    check_state_prefix_cache(checkpoints[variant][0], max_tokens=4)


@pytest.mark.parametrize("variant", ["tied", "moe-plain"])
def test_speculative_decoding_keeps_only_accepted_states(
        checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """n-gram drafts verified through the convolutions: rejected drafts leave no trace in
    their state (greedy tokens equal HF's)."""
    from mrv2.testing_engine import check_state_speculation

    check_state_speculation(checkpoints[variant][0])


def test_structure_and_names(checkpoints: dict[str, Checkpoint]) -> None:
    """Layer kinds, KV-cache indices, state shapes and the feed-forward's width (HF's
    sizing, with and without the multiplier); the saved and the in-memory names load every
    parameter alike."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    path, hf, _ = checkpoints["biased"]
    config = transformers.AutoConfig.from_pretrained(path)
    model = Lfm2ForCausalLM(config)
    layers = cast(list[Any], list(model.model.layers))
    assert [layer.kind for layer in layers] == ["conv", "full_attention"] * 2
    conv = layers[0].conv
    assert isinstance(conv, ShortConv) and layers[0].self_attn is None
    assert conv.request_state_shapes() == {"conv": ((3, 64), None)}
    attn = layers[3].self_attn
    assert isinstance(attn, SelfAttention) and attn.attn.layer_idx == 1
    assert attn.q_norm is not None and attn.q_norm.eps == 1e-5
    assert isinstance(layers[0].feed_forward, GatedMLP)
    assert layers[0].feed_forward.down_proj.input_size == 128 == ff_dim_of(config)
    every = {n for n, _ in model.named_parameters()}
    assert load_model_weights(model, iter_safetensors(path)) == every
    again = Lfm2ForCausalLM(config)
    assert again.load_weights(hf.state_dict().items()) == every
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    hf_conv: Any = cast(Any, hf).model.layers[0].conv
    assert torch.equal(conv.conv_weight, hf_conv.conv.weight[:, 0])
    assert conv.conv_bias is not None and torch.equal(conv.conv_bias, hf_conv.conv.bias)

    tied_path = checkpoints["tied"][0]
    tied_config = transformers.AutoConfig.from_pretrained(tied_path)
    tied = Lfm2ForCausalLM(tied_config)
    assert tied.layer_types == ["conv", "conv", "full_attention", "conv"]
    assert ff_dim_of(tied_config) == 100
    assert tied.lm_head.tied and cast(Any, tied.model.layers[0]).conv.conv_bias is None
    every = {n for n, _ in tied.named_parameters()}
    assert load_model_weights(tied, iter_safetensors(tied_path)) == every


def test_ff_dim_is_hfs() -> None:
    """The feed-forward width of each published size and of the sizing's corners, as HF's
    ``Lfm2MLP`` builds it; without ``block_ffn_dim_multiplier`` (an older config's null,
    which transformers 5.17's config class no longer takes: its ``Lfm2MLP`` still reads it)
    no rounding to ``block_multiple_of`` (vLLM rounds: 6826 -> 6912)."""
    from types import SimpleNamespace

    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    base: dict[str, Any] = dict(hidden_size=16, block_auto_adjust_ff_dim=True,
                                block_multiple_of=256, block_ffn_dim_multiplier=1.0)
    cases: list[dict[str, Any]] = [
        dict(intermediate_size=12288),  # (1.2B: 8192)
        dict(intermediate_size=6656),  # (350M: 4437 -> 4608)
        dict(intermediate_size=10240, block_ffn_dim_multiplier=None),  # (6826)
        dict(intermediate_size=100, block_auto_adjust_ff_dim=False),
        dict(intermediate_size=300, block_multiple_of=64, block_ffn_dim_multiplier=1.7)]
    for case in cases:
        config = SimpleNamespace(**{**base, **case})
        with torch.device("meta"):
            hf = Lfm2MLP(config)  # type: ignore[arg-type]
        assert ff_dim_of(config) == hf.w1.out_features, case


@pytest.mark.parametrize("variant", ["biased", "moe"])
def test_lora_matches_merged_hf(checkpoints: dict[str, Checkpoint], tmp_path: Path,
                                variant: str) -> None:
    """An adapter on HF's attention (``q/k/v_proj``, ``out_proj``) and feed-forward (``w1``,
    ``w3``, ``w2``) names: the engine's tokens equal HF's running it merged into the weights
    (LFM2-MoE: the attention's q/k/v and the dense layers' feed-forwards). An adapter on a
    convolution's projections or on a routed expert (not adaptable layers) is refused naming
    it."""
    from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

    base, _, plain = checkpoints[variant]
    moe = variant == "moe"
    targets = ("q_proj", "k_proj", "v_proj", "w1", "w2", "w3") + (() if moe else ("out_proj",))
    adapter = make_lora_adapter(base, tmp_path / "adapter", rank=4, seed=3, targets=targets,
                                exclude=".experts." if moe else ".conv.")
    merged = merge_lora_checkpoint(base, adapter, tmp_path / "merged")
    want = [hf_greedy(merged, p, MAX_TOKENS) for p in PROMPTS]
    assert want != plain
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(adapter)))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    refused = [("in_proj", r"layers\.0\.conv\.in_proj")]
    if moe:
        refused.append(("w2", r"layers\.2\.feed_forward\.experts\.0\.w2"))
    for i, (target, module) in enumerate(refused):
        bad = make_lora_adapter(base, tmp_path / target, rank=4, targets=(target,),
                                exclude=".feed_forward.w2" if moe else None)
        with pytest.raises(ValueError, match=rf"module .*{module}.* is not an adaptable layer"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(target, 2 + i, str(bad)))


def test_refusals(checkpoints: dict[str, Checkpoint], monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints["biased"][0]

    def bad(**fields: Any) -> Any:
        config = transformers.AutoConfig.from_pretrained(path)
        for key, value in fields.items():
            setattr(config, key, value)
        return config

    with pytest.raises(ValueError, match=r"layer_types must list one of .* got \['mamba'\]"):
        Lfm2ForCausalLM(bad(layer_types=["conv", "mamba", "conv", "full_attention"]))
    with pytest.raises(ValueError, match="layer_types lists 2 layers, num_hidden_layers is 4"):
        Lfm2ForCausalLM(bad(layer_types=["conv", "full_attention"]))
    with pytest.raises(ValueError, match="conv_L_cache must be at least 2, got 1"):
        Lfm2ForCausalLM(bad(conv_L_cache=1))
    legacy = bad(layer_types=None, full_attn_idxs=None)
    assert layer_types_of(legacy) == ["full_attention"] * 4  # (as transformers reads it)
    monkeypatch.setattr(lfm2_model, "resolve_tp", lambda size: (0, 3))
    with pytest.raises(ValueError, match="hidden_size .* must be divisible"):
        Lfm2ForCausalLM(bad())


@pytest.mark.parametrize("variant,kwargs", [
    ("biased", {}), ("moe", {}), ("moe", {"enable_expert_parallel": True}),
], ids=["dense", "moe", "moe-expert-parallel"])
def test_tensor_parallel_matches_hf(checkpoints: dict[str, Checkpoint], variant: str,
                                    kwargs: dict[str, Any]) -> None:
    """Two ranks (processes on the CPU): each holds half of every convolution's channels
    (its slice of ``B``, ``C``, ``x``, the conv weight and bias, its state), half the
    attention heads and MLP columns (LFM2-MoE: and half of every expert's columns, or with
    expert parallelism half of the experts whole; the router on every rank); greedy tokens
    equal HF's, prompts split across steps."""
    from mrv2.testing_engine import tokens_at_tp

    path, _, want = checkpoints[variant]
    for tp, got in tokens_at_tp(path, PROMPTS, GREEDY, (2,), max_num_batched_tokens=8,
                                **kwargs).items():
        assert got == want, tp


@pytest.mark.parametrize("variant", ["moe", "moe-plain"])
def test_moe_router_is_hfs(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """Every MoE block's router against HF's ``Lfm2MoeTopKRouter`` on the same hidden states:
    the same experts (as sets: the order of equal picks is free) with the same weights
    (sigmoid scores, picked on score + expert bias, renormalized, scaled). The tiny model
    routes tokens to many expert pairs, and its expert bias changes picks (so a router that
    dropped it would fail here)."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    path, hf, _ = checkpoints[variant]
    config = transformers.AutoConfig.from_pretrained(path)
    model = Lfm2MoeForCausalLM(config)
    load_model_weights(model, iter_safetensors(path))
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    for i in range(config.num_dense_layers, config.num_hidden_layers):
        block = cast(Any, model.model.layers[i]).feed_forward
        theirs = cast(Any, hf).model.layers[i].feed_forward
        with torch.no_grad():
            weights, ids = block.gate(x)
            _, want_w, want_ids = theirs.gate(x, getattr(theirs, "expert_bias", None))
        order, want_order = ids.long().argsort(-1), want_ids.argsort(-1)
        assert torch.equal(ids.long().gather(1, order), want_ids.gather(1, want_order)), i
        torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order),
                                   atol=1e-5, rtol=1e-5)
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= 8, i
        if variant == "moe":
            bias = theirs.expert_bias
            assert torch.equal(block.gate.e_score_correction_bias, bias) and bias.abs().sum()
            unbiased = torch.sigmoid(x @ theirs.gate.weight.T).topk(2, dim=-1).indices
            assert not torch.equal(unbiased.sort(-1).values, want_ids.sort(-1).values), i
            assert 1.5 - 1e-4 < float(weights.sum(-1).mean()) < 1.5 + 1e-4  # (renormed, x1.5)
        else:
            assert block.gate.e_score_correction_bias is None


def test_moe_structure_and_names(checkpoints: dict[str, Checkpoint]) -> None:
    """Dense SwiGLUs of exactly ``intermediate_size`` (no LFM2 sizing) in the first
    ``num_dense_layers``, MoE blocks (a sigmoid one-group router, the experts stacked) after;
    the saved names (one tensor per expert, the expert bias a buffer) and HF's in-memory
    ones (stacked ``gate_up_proj`` / ``down_proj``) load every parameter alike."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    path, hf, _ = checkpoints["moe"]
    config = transformers.AutoConfig.from_pretrained(path)
    model = Lfm2MoeForCausalLM(config)
    layers = cast(list[Any], list(model.model.layers))
    assert [layer.kind for layer in layers] == ["conv", "full_attention"] * 2 + ["conv"]
    for layer in layers[:2]:
        assert isinstance(layer.feed_forward, GatedMLP)
        assert layer.feed_forward.down_proj.input_size == 96 != ff_dim_of(config)
    for layer in layers[2:]:
        block = layer.feed_forward
        assert isinstance(block, MoEBlock) and block.shared_experts is None
        assert isinstance(block.experts, FusedMoE)
        assert (block.experts.num_experts, block.experts.intermediate_size) == (8, 32)
        gate = block.gate
        assert isinstance(gate, GroupedTopKRouter)
        assert (gate.top_k, gate.n_group, gate.scoring, gate.renormalize,
                gate.routed_scaling_factor) == (2, 1, "sigmoid", True, 1.5)
    every = {n for n, _ in model.named_parameters()}
    assert load_model_weights(model, iter_safetensors(path)) == every
    again = Lfm2MoeForCausalLM(config)
    assert again.load_weights(hf.state_dict().items()) == every
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    experts = cast(Any, hf).model.layers[3].feed_forward.experts
    assert torch.equal(layers[3].feed_forward.experts.w13_weight, experts.gate_up_proj)
    assert torch.equal(layers[3].feed_forward.experts.w2_weight, experts.down_proj)

    plain_path = checkpoints["moe-plain"][0]
    plain = Lfm2MoeForCausalLM(transformers.AutoConfig.from_pretrained(plain_path))
    assert isinstance(cast(Any, plain.model.layers[1]).feed_forward, MoEBlock)
    assert plain.lm_head.tied
    every = {n for n, _ in plain.named_parameters()}
    assert load_model_weights(plain, iter_safetensors(plain_path)) == every
    # a stray expert bias where use_expert_bias is off is not read (as HF reads none)
    assert plain.rename("model.layers.1.feed_forward.expert_bias") is None


def test_moe_refusals(checkpoints: dict[str, Checkpoint]) -> None:
    path = checkpoints["moe"][0]

    def bad(**fields: Any) -> Any:
        config = transformers.AutoConfig.from_pretrained(path)
        for key, value in fields.items():
            setattr(config, key, value)
        return config

    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 8\]"):
        Lfm2MoeForCausalLM(bad(num_experts_per_tok=9))
    with pytest.raises(ValueError, match="LFM2-MoE: num_experts .* must be at least 1"):
        Lfm2MoeForCausalLM(bad(moe_intermediate_size=0))
    with pytest.raises(ValueError, match="layer_types lists 2 layers, num_hidden_layers is 5"):
        Lfm2MoeForCausalLM(bad(layer_types=["conv", "full_attention"]))
