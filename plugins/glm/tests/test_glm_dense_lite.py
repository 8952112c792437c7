"""GlmForCausalLM, Glm4ForCausalLM and Glm4MoeLiteForCausalLM against HF transformers on tiny
random checkpoints: every logit of a prefill step (with padding) and a decode step through the
paged cache (the latent cache for GLM-4.7-Flash's MLA), then greedy tokens and prompt
log-probabilities through ``LLM`` (chunked prefill; one case with prefix caching and
preemption); the published checkpoints' tensor names; config errors name the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import mrv2_glm
from mrv2 import LLM, SamplingParams
from mrv2.attention import ForwardContext, set_forward_context
from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.kv_cache import LatentKVSpec, layer_specs
from mrv2.layers import head_dim_of
from mrv2.layers.weights import checkpoint_target
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import (
    TEST_BLOCK_SIZE,
    TEST_NUM_BLOCKS,
    check_steps_against_hf,
    hf_greedy,
    poisoned_caches,
    redraw_weights,
    step_inputs,
    step_metadata,
)
from mrv2.testing_engine import check_prompt_logprobs

VOCAB = 128
DENSE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "pad_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False,
}
LITE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3,
    "n_shared_experts": 1, "routed_scaling_factor": 1.8, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "pad_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}
#: ``{case: (architecture, config fields)}``.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # GLM-4-9B-chat-hf's layout: half of each head rotated in interleaved pairs, q/k/v biases,
    # GQA, head_dim not hidden / heads
    "glm": ("GlmForCausalLM", {**DENSE}),
    # GLM-4-0414: the extra post-attention / post-MLP norms; a quarter of each head rotated,
    # no biases
    "glm4": ("Glm4ForCausalLM", {**DENSE, "partial_rotary_factor": 0.25, "head_dim": 32,
                                 "attention_bias": False}),
    # GLM-4.7-Flash's layout: q_lora_rank, interleaved rope, 2 of 4 expert groups, dense layer
    # between sparse ones
    "glm4-moe-lite": ("Glm4MoeLiteForCausalLM", {
        **LITE, "q_lora_rank": 24, "n_group": 4, "topk_group": 2,
        "mlp_layer_types": ["dense", "sparse", "dense"]}),
    # no q_lora_rank, half-split rope, YaRN (DeepSeek's mscale terms), raw routing weights
    "glm4-moe-lite-yarn": ("Glm4MoeLiteForCausalLM", {
        **LITE, "q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                            "original_max_position_embeddings": 64, "mscale": 0.707,
                            "mscale_all_dim": 0.707}}),
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 120, 11], [3 + i for i in range(13)], [64]]


def save_hf(path: Path, case: str) -> torch.nn.Module:
    """HF's model of ``case``, weights redrawn (correction biases nonzero), saved."""
    arch, fields = CASES[case]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**fields)
    config.architectures = [arch]
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).eval()
    redraw_weights(hf)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(3))
    hf.save_pretrained(path)
    return hf


def load(path: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(mrv2_glm, config.architectures[0])(config)
    load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    return model.eval()


def check_latent_steps(model: Any, hf: torch.nn.Module) -> None:
    """:func:`mrv2.testing.check_steps_against_hf` over MLA's latent caches (poisoned)."""
    specs = layer_specs(model)
    assert set(specs.values()) == {LatentKVSpec(32 + 8)}
    caches = [torch.full((TEST_NUM_BLOCKS, TEST_BLOCK_SIZE, 40), 1e4) for _ in specs]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 3, 10)]
    perm = torch.randperm(TEST_NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[3 * i:3 * i + 3] for i in range(len(prompts))]

    def step(contexts: list[int], tokens: list[list[int]], pad: int) -> list[torch.Tensor]:
        ids, positions = step_inputs(contexts, tokens, pad)
        metadata = step_metadata(contexts, [len(t) for t in tokens], tables, pad)
        context = ForwardContext(metadata, caches, [MLABackend()] * len(caches))
        with torch.inference_mode(), set_forward_context(context):
            logits = model.compute_logits(model(ids, positions))
        return list(logits[:len(ids) - pad].split([len(t) for t in tokens]))

    nxt = torch.randint(0, VOCAB, (len(prompts),), generator=gen).tolist()
    prefill = step([0] * len(prompts), prompts, 2)
    decode = step([len(p) for p in prompts], [[t] for t in nxt], 0)
    with torch.no_grad():
        for prompt, token, first, second in zip(prompts, nxt, prefill, decode, strict=True):
            expected = hf(torch.tensor([prompt + [token]])).logits[0]
            torch.testing.assert_close(first, expected[:-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(second, expected[-1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_greedy_tokens_and_prompt_logprobs_match_hf(tmp_path: Path, case: str) -> None:
    hf = save_hf(tmp_path, case)
    model = load(tmp_path)
    config = model.config
    if CASES[case][0] == "Glm4MoeLiteForCausalLM":
        check_latent_steps(model, hf)
    else:
        caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                                 config.num_hidden_layers)
        check_steps_against_hf(model, hf, caches, (7, 3, 10), vocab=VOCAB, max_len=12)

    kwargs: dict[str, Any] = {"max_num_batched_tokens": 8}
    if case == "glm":  # (prefix caching and preemption once: the core's, shared by all)
        kwargs = {"enable_prefix_caching": True, "num_gpu_blocks_override": 10}
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tmp_path, p, 8) for p in PROMPTS]
    if case == "glm":
        assert llm.engine.stats()["num_preemptions"] > 0
    ids = PROMPTS[1]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


#: Tensor names of the published checkpoints (layer 0; GLM-4.7-Flash: a dense and a sparse
#: layer, and its MTP layer, here 3) -> the parameter each loads into (None: skipped). The
#: dense models' fused ``mlp.gate_up_proj``: test_fused_gate_up_and_quantized_qk_tensors.
PUBLISHED: dict[str, dict[str, str | None]] = {
    "GlmForCausalLM": {  # THUDM/glm-4-9b-chat-hf
        "model.layers.0.self_attn.q_proj.bias": "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.self_attn.k_proj.weight": "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight": "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight":
            "model.layers.0.post_attention_layernorm.weight",
        "lm_head.weight": "lm_head.weight",
    },
    "Glm4ForCausalLM": {  # THUDM/GLM-4-9B-0414
        "model.layers.0.post_self_attn_layernorm.weight":
            "model.layers.0.post_self_attn_layernorm.weight",
        "model.layers.0.post_mlp_layernorm.weight": "model.layers.0.post_mlp_layernorm.weight",
        "model.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.v_proj.bias": "model.layers.0.self_attn.qkv_proj.bias",
    },
    "Glm4MoeLiteForCausalLM": {  # zai-org/GLM-4.7-Flash
        "model.layers.0.self_attn.q_a_proj.weight": "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight":
            "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.q_b_proj.weight": "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight":
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight":
            "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.self_attn.kv_b_proj.weight": "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.mlp.gate_proj.weight": "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.1.mlp.gate.weight": "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias":
            "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.7.up_proj.weight": "model.layers.1.mlp.experts.w13_weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight":
            "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.3.eh_proj.weight": None,  # (the MTP layer of a 3-layer model)
        "model.layers.3.mlp.experts.0.gate_proj.weight": None,
    },
}


@pytest.mark.parametrize("arch", list(PUBLISHED))
def test_published_tensor_names_load(arch: str) -> None:
    fields = {"glm": DENSE, "glm4": DENSE}.get(arch.split("For")[0].lower(), {
        **LITE, "q_lora_rank": 24})
    model = getattr(mrv2_glm, arch)(
        getattr(transformers, arch.replace("ForCausalLM", "Config"))(**fields))
    params = dict(model.named_parameters())
    for name, want in PUBLISHED[arch].items():
        target = checkpoint_target(name, model.stacked_params, model.rename)
        assert (None if target is None else target[0]) == want, name
        assert want is None or want in params, want


def test_fused_gate_up_and_quantized_qk_tensors(tmp_path: Path) -> None:
    """The GLM-4 checkpoints' fused ``mlp.gate_up_proj`` loads as gate and up (a wrong row
    count names the tensor); a q/k tensor whose rows cannot be reordered (GPTQ's ``qweight``,
    its output rows on the second axis) is refused."""
    save_hf(tmp_path, "glm")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = mrv2_glm.GlmForCausalLM(config)
    gate_up = torch.randn(2 * 96, 64)
    loaded = model.load_weights([("model.layers.1.mlp.gate_up_proj.weight", gate_up)])
    assert loaded == {"model.layers.1.mlp.gate_up_proj.weight"}
    torch.testing.assert_close(model.model.layers[1].mlp.gate_up_proj.weight.data, gate_up)
    with pytest.raises(ValueError, match=r"gate_up_proj\.weight' \(190, 64\): the config's "
                                         r"gate/up projections need 192 rows"):
        model.load_weights([("model.layers.1.mlp.gate_up_proj.weight", gate_up[:190])])
    with pytest.raises(ValueError, match=r"q_proj\.qweight.*interleaved RoPE"):
        model.load_weights([("model.layers.0.self_attn.q_proj.qweight",
                             torch.zeros(8, 96, dtype=torch.int32))])


@pytest.mark.parametrize(("arch", "fields", "match"), [
    ("GlmForCausalLM", {"hidden_act": "gelu"}, r"config\.hidden_act = 'gelu'"),
    ("Glm4ForCausalLM", {"partial_rotary_factor": 0.3}, r"config\.partial_rotary_factor"),
    ("Glm4MoeLiteForCausalLM", {"mlp_layer_types": ["dense", "moe", "sparse"]},
     r"config\.mlp_layer_types = .*'dense' or 'sparse'"),
    ("Glm4MoeLiteForCausalLM", {"partial_rotary_factor": 0.5},
     r"config\.partial_rotary_factor = 0\.5: MLA rotates"),
    ("Glm4MoeLiteForCausalLM", {"num_experts_per_tok": 9}, r"config\.num_experts_per_tok"),
])
def test_config_errors_name_the_field(arch: str, fields: dict[str, Any], match: str) -> None:
    base = DENSE if "Moe" not in arch else {**LITE, "q_lora_rank": 24}
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**base)
    for name, value in fields.items():  # (set after HF's own checks)
        setattr(config, name, value)
        if name == "partial_rotary_factor":
            config.rope_parameters = {**config.rope_parameters, name: value}
    with pytest.raises(ValueError, match=match):
        getattr(mrv2_glm, arch)(config)


def test_lite_mtp_layer_drafts_and_keeps_greedy_tokens(tmp_path: Path) -> None:
    """GLM-4.7-Flash's MTP layer (``model.layers.{num_hidden_layers}.*``: an MLA + MoE block,
    named as published) drafts through the ``mtp`` speculator: greedy tokens as without it,
    drafts really made; the main model skips the layer's tensors."""
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
        Glm4MoeLiteDecoderLayer,
    )

    from mrv2.testing_checkpoints import make_mtp_checkpoint

    def mtp_block(config: Any, layer_idx: int) -> torch.nn.Module:
        config = copy.deepcopy(config)  # (HF sizes mlp_layer_types to the main layers)
        config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        return Glm4MoeLiteDecoderLayer(config, layer_idx)

    fields = {**LITE, "q_lora_rank": 24, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    path = make_mtp_checkpoint(tmp_path, "Glm4MoeLiteForCausalLM", mtp_block, **fields)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    outputs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        kwargs: dict[str, Any] = {} if spec is None else {"speculative_config": spec}
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
    assert outputs[0] == outputs[1]
    assert outputs[0] == [hf_greedy(path, p, 8) for p in PROMPTS[:2]]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("arch", ["GlmForCausalLM", "Glm4ForCausalLM"])
def test_lora_adapter_matches_hf_merged(tmp_path: Path, arch: str) -> None:
    """A PEFT adapter on the q/k/v/o projections and the fused ``gate_up_proj`` (its ``B``
    rows of q and k put in the halves order as the weight's): HF's merged model's tokens."""
    from mrv2 import LoRARequest
    from mrv2.testing import make_tiny_checkpoint
    from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

    base = make_tiny_checkpoint(tmp_path / "base", arch, std=0.15, pad_token_id=0)
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, seed=2, targets=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj"))
    prompt = PROMPTS[0]
    want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / "merged"), prompt, 6)
    assert want != hf_greedy(base, prompt, 6)
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                       lora_request=LoRARequest("glm", 1, str(adapter)))[0]
    assert out.outputs[0].token_ids == want


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path) -> None:
    """Every projection in block FP8 (32 x 32 blocks: whole heads of 32 rows, whole gate and
    up halves), as FP8 checkpoints are published: the q/k rows (fp8 bytes) reordered as
    they load, the fused gate/up weight and block scales cut into halves; HF's greedy tokens
    on the dequantized weights."""
    from mrv2.testing import make_tiny_checkpoint
    from mrv2.testing_checkpoints import fp8_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "GlmForCausalLM", std=0.15, pad_token_id=0,
                               head_dim=32)
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", (32, 32))
    llm = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS[:2]]
