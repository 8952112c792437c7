"""Falcon-H1 (attention and a Mamba-2 mixer in parallel in every layer, muP multipliers)
through the engine against HF transformers: greedy tokens of several requests at once (HF's
full forward per token: its chunked SSD scan, an independent form of our token-serial
recurrence), prompts split across steps (the SSM and convolution states carried between
chunks), preemption (the request computed again from a zero state), prefix caching (requests
resuming from state snapshots), every prompt position's log-probability; the mixer's gated
norm before or after the gate, or none; biases and a tied LM head; the multipliers folded
into the weights exactly once; a LoRA adapter against HF running it merged; tensor
parallelism by whole groups and with one replicated group; bad configs refused by name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.layers import GatedMLP, Mamba2Mixer, SelfAttention
from mrv2.layers.embedding import ScaledEmbedding
from mrv2.layers.mamba import GroupGatedRMSNorm
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_falcon_h1.model import FalconH1ForCausalLM
from mrv2_falcon_h1.testing import save_tiny_falcon_h1

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
#: name -> overrides: the gated norm before the gate (HF's default) with one B/C group; the
#: gate before the norm with two groups, every bias and a tied LM head; no gated norm (the
#: published checkpoints: ``mamba_rms_norm`` false, one group), and so with 4 heads of 32
#: channels for the Triton case (the same 128 as 8 x 16: its interpreted delta-rule kernel
#: launches a program per head, half as many).
VARIANTS: dict[str, dict[str, Any]] = {
    "norm-gate": {"mamba_n_groups": 1},
    "gate-norm": {"mamba_norm_before_gate": False, "attention_bias": True,
                  "mamba_proj_bias": True, "projectors_bias": True, "mlp_bias": True,
                  "tie_word_embeddings": True},
    "no-norm": {"mamba_rms_norm": False, "mamba_n_groups": 1},
    "no-norm-wide-heads": {"mamba_rms_norm": False, "mamba_n_groups": 1, "mamba_n_heads": 4},
}
Checkpoint = tuple[Path, torch.nn.Module, list[list[int]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, overrides in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        hf = save_tiny_falcon_h1(path, **overrides)
        out[name] = (path, hf, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS])
    return out


def _generate(llm: LLM, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        **kwargs)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompt_logprobs_match(llm: LLM, hf: torch.nn.Module) -> None:
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


@pytest.mark.parametrize("variant,kwargs", [
    ("norm-gate", {"max_num_batched_tokens": 8}),
    ("norm-gate", {"num_gpu_blocks_override": 12}),
    ("gate-norm", {"max_num_batched_tokens": 8}),
    ("no-norm", {"max_num_batched_tokens": 8}),
    ("no-norm-wide-heads", {"max_num_batched_tokens": 8, "triton": True}),
], ids=["norm-gate-chunked", "norm-gate-preempt", "gate-norm-chunked", "no-norm-chunked",
        "no-norm-chunked-triton"])
def test_greedy_and_logprobs_match_hf(checkpoints: dict[str, Checkpoint], variant: str,
                                      kwargs: dict[str, Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton``: the mixers' conv and delta-free rule on their Triton kernels (interpreted on
    the CPU; one round and 4 heads, for time)."""
    path, hf, want = checkpoints[variant]
    triton = kwargs.pop("triton", False)
    if triton:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
        from mrv2_kernels import linear_attention

        monkeypatch.setattr(linear_attention, "use_triton", lambda t: True)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True, **kwargs)
    assert llm.engine.prefix_caching is True  # (with snapshots of the state)
    assert _generate(llm, PROMPTS) == want
    if triton:
        return
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
        return
    # a second round on the rows the first one left (each request starts from a zero state)
    assert _generate(llm, PROMPTS[::-1]) == want[::-1]
    _prompt_logprobs_match(llm, hf)


def test_prefix_cache_resumes_from_state_snapshots(
        checkpoints: dict[str, Checkpoint]) -> None:
    """Requests resume from snapshots of the SSM and conv states (the attention's KV from the
    cached blocks beside them): greedy tokens equal HF's."""
    from mrv2.testing_engine import check_state_prefix_cache

    check_state_prefix_cache(checkpoints["norm-gate"][0], max_tokens=4)


def test_structure_and_folded_multipliers(checkpoints: dict[str, Checkpoint]) -> None:
    """Every layer holds a mixer, attention and a gated MLP; the multipliers sit in the
    weights (HF's times each factor), the saved and the in-memory names load every parameter
    alike, and loading again (``update_weights``) scales nothing twice."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    path, hf, _ = checkpoints["norm-gate"]
    config = transformers.AutoConfig.from_pretrained(path)
    model = FalconH1ForCausalLM(config)
    layer = cast(Any, model.model.layers[1])
    mixer = layer.mamba
    assert isinstance(mixer, Mamba2Mixer) and isinstance(layer.self_attn, SelfAttention)
    assert isinstance(layer.feed_forward, GatedMLP)
    assert layer.self_attn.attn.layer_idx == 1 and layer.self_attn.head_dim == 24
    assert mixer.request_state_shapes() == {"conv": ((3, 128 + 2 * 16), None),
                                            "ssm": ((8, 16, 16), torch.float32)}
    assert (mixer.dt_min, mixer.dt_max) == (0.05, 0.6) and mixer.out_proj.bias is None
    assert isinstance(mixer.norm, GroupGatedRMSNorm) and mixer.norm.norm_before_gate
    every = {n for n, _ in model.named_parameters()}
    assert load_model_weights(model, iter_safetensors(path)) == every
    again = FalconH1ForCausalLM(config)
    assert again.load_weights(hf.state_dict().items()) == every
    assert model.load_weights(iter_safetensors(path)) == every  # (a second load)
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name

    theirs: Any = cast(Any, hf).model.layers[1]
    attn, q, k = layer.self_attn, theirs.self_attn.q_proj.weight, theirs.self_attn.k_proj.weight
    torch.testing.assert_close(attn.qkv_proj.weight[:96], q * 1.3)
    torch.testing.assert_close(attn.qkv_proj.weight[96:144], k * 1.3 * 0.6)
    torch.testing.assert_close(attn.o_proj.weight, theirs.self_attn.o_proj.weight * 0.8)
    gate_up = layer.feed_forward.gate_up_proj.weight
    torch.testing.assert_close(gate_up[:96], theirs.feed_forward.gate_proj.weight * 1.4)
    torch.testing.assert_close(gate_up[96:], theirs.feed_forward.up_proj.weight)
    torch.testing.assert_close(layer.feed_forward.down_proj.weight,
                               theirs.feed_forward.down_proj.weight * 0.6)
    in_proj = theirs.mamba.in_proj.weight
    scale = theirs.mamba.mup_vector.reshape(-1, 1) * 1.2
    torch.testing.assert_close(mixer.in_proj.weight, in_proj * scale)
    torch.testing.assert_close(mixer.out_proj.weight, theirs.mamba.out_proj.weight * 0.9)
    hf_model: Any = cast(Any, hf).model
    torch.testing.assert_close(model.model.embed_tokens.weight,
                               hf_model.embed_tokens.weight * 2.5)
    torch.testing.assert_close(model.lm_head.weight, cast(Any, hf).lm_head.weight * 0.7)
    assert model.logits_multiplier == 1.0
    rows = torch.ones(attn.qkv_proj.output_size, 1)  # (a LoRA B's rows take the same factors)
    assert attn.qkv_proj.row_order is not None
    assert attn.qkv_proj.row_order(rows)[94:98, 0].tolist() == pytest.approx(
        [1.3, 1.3, 1.3 * 0.6, 1.3 * 0.6])

    tied_path, tied_hf, _ = checkpoints["gate-norm"]
    tied = FalconH1ForCausalLM(transformers.AutoConfig.from_pretrained(tied_path))
    assert isinstance(tied.model.embed_tokens, ScaledEmbedding) and tied.lm_head.tied
    assert tied.logits_multiplier == 0.7
    tied_mixer = cast(Any, tied.model.layers[0]).mamba
    assert tied_mixer.out_proj.bias is not None and not tied_mixer.norm.norm_before_gate
    every = {n for n, _ in tied.named_parameters()}
    assert load_model_weights(tied, iter_safetensors(tied_path)) == every
    torch.testing.assert_close(tied.model.embed_tokens.weight,
                               cast(Any, tied_hf).model.embed_tokens.weight)
    bias = cast(Any, tied.model.layers[0]).self_attn.qkv_proj.bias
    k_bias = cast(Any, tied_hf).model.layers[0].self_attn.k_proj.bias
    torch.testing.assert_close(bias[96:144], k_bias * 0.6)  # (not the input's 1.3)

    plain = FalconH1ForCausalLM(
        transformers.AutoConfig.from_pretrained(checkpoints["no-norm"][0]))
    assert cast(Any, plain.model.layers[0]).mamba.norm is None
    assert not any(".mamba.norm." in n for n, _ in plain.named_parameters())


def test_lora_matches_merged_hf(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    """An adapter on every attention and MLP projection: the engine's tokens equal HF's
    running the adapter merged into the weights (so the muP factors scale its updates too)."""
    from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

    base, _, plain = checkpoints["no-norm"]
    adapter = make_lora_adapter(base, tmp_path / "adapter", rank=4, seed=3)
    merged = merge_lora_checkpoint(base, adapter, tmp_path / "merged")
    want = [hf_greedy(merged, p, MAX_TOKENS) for p in PROMPTS]
    assert want != plain
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    assert _generate(llm, PROMPTS, lora_request=LoRARequest("a", 1, str(adapter))) == want


def test_refusals(checkpoints: dict[str, Checkpoint]) -> None:
    path = checkpoints["norm-gate"][0]

    def bad(**fields: Any) -> Any:
        config = transformers.AutoConfig.from_pretrained(path)
        for key, value in fields.items():
            setattr(config, key, value)
        return config

    with pytest.raises(ValueError, match="mamba_use_mlp is false"):
        FalconH1ForCausalLM(bad(mamba_use_mlp=False))
    with pytest.raises(ValueError, match=r"hidden_act .* must be one of .* got 'relu2'"):
        FalconH1ForCausalLM(bad(hidden_act="relu2"))
    with pytest.raises(ValueError, match=r"ssm_multipliers must be 5 finite numbers"):
        FalconH1ForCausalLM(bad(ssm_multipliers=[1.0, 2.0]))
    with pytest.raises(ValueError, match=r"mlp_multipliers must be 2 finite numbers"):
        FalconH1ForCausalLM(bad(mlp_multipliers=[1.0]))
    with pytest.raises(ValueError, match=r"mamba_d_head \(10\) times mamba_n_heads \(8\)"):
        FalconH1ForCausalLM(bad(mamba_d_head=10))
    with pytest.raises(ValueError, match=r"mamba_n_heads \(6\) must be a multiple of "
                                         r"mamba_n_groups \(4\)"):
        FalconH1ForCausalLM(bad(mamba_n_heads=6, mamba_n_groups=4))
    with pytest.raises(ValueError, match="time_step_limit must be"):
        FalconH1ForCausalLM(bad(time_step_limit=(0.5, 0.1)))
    with pytest.raises(ValueError, match="partial_rotary_factor must be 1"):
        FalconH1ForCausalLM(bad(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.5}))
    with pytest.raises(ValueError, match="key_multiplier must be a finite number"):
        FalconH1ForCausalLM(bad(key_multiplier=float("nan")))
    model = FalconH1ForCausalLM(bad())
    o_proj = cast(Any, model.model.layers[0]).self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(torch.zeros(o_proj.weight.shape, dtype=torch.int8),
                                       requires_grad=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj .* no float "
                                         r"weight .* quantized"):
        model.load_weights([])


@pytest.mark.parametrize("variant", ["norm-gate", "gate-norm"])
def test_tensor_parallel_matches_hf(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """Two ranks (processes on the CPU): each holds four heads of every Mamba-2 mixer and one
    group (``gate-norm``: its own of two, the norm per group on the rank; ``norm-gate``, as
    the published checkpoints: the one group replicated, the norm's statistics all-reduced),
    half the attention heads and MLP columns; the attention's and the mixer's partial outputs
    (biases added once) reduced together; greedy tokens equal HF's, prompts split across
    steps."""
    from mrv2.testing_engine import tokens_at_tp

    path, _, want = checkpoints[variant]
    for tp, got in tokens_at_tp(path, PROMPTS, GREEDY, (2,),
                                max_num_batched_tokens=8).items():
        assert got == want, tp
