"""Gemma 4's text decoder against HF transformers: prefill and decode logits through the paged
cache (prompts past the local window) for a config with everything on (per-layer embeddings,
KV sharing, keys as values, a double-wide MLP, proportional RoPE, soft-capped logits,
``layer_scalar`` s), a plain one (no PLE or sharing, biases) and the MoE block; greedy tokens
through the engine with chunked prefill; the multimodal checkpoint for text prompts (its
names, the audio tensors skipped, placeholder ids as pad); bad configs refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.attention import set_forward_context
from mrv2.contract.kv_cache import PagedKVSpec, layer_specs
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.loader import checkpoint_names
from mrv2.testing import (
    TEST_BLOCK_SIZE,
    TEST_NUM_BLOCKS,
    check_steps_against_hf,
    redraw_weights,
    run_step,
    step_inputs,
    step_metadata,
    torch_context,
)
from mrv2_gemma.gemma4 import Gemma4ForCausalLM, Gemma4SharedAttention
from mrv2_gemma.gemma4_vl import Gemma4ForConditionalGeneration

VOCAB = 128
#: Logit tolerance. Scale-1.0 attention over normed queries and keys amplifies fp32 rounding
#: over the layers: HF's fp32 logits and mrv2's are each up to ~1e-4 from HF's fp64 ones (the
#: blocks themselves agree to ~1e-7: see the MoE test). A wrong feature moves them by ~1.
ATOL = 3e-4
S, F = "sliding_attention", "full_attention"
#: Layers 3 and 4 share layer 2's (local) and layer 1's (global) keys and values with FULL.
LAYERS = [S, F, S, S, F]
FULL: dict[str, Any] = {
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
    "num_kv_shared_layers": 2, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
    "use_double_wide_mlp": True, "final_logit_softcapping": 4.0}
PLAIN: dict[str, Any] = {
    "hidden_size_per_layer_input": 0, "attention_bias": True,
    "rope_parameters": {S: {"rope_type": "default", "rope_theta": 1e3},
                        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                            "rope_theta": 1e4, "factor": 2.0}}}
MOE: dict[str, Any] = {
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
    "num_kv_shared_layers": 1, "enable_moe_block": True, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 32}


def _text(**overrides: Any) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": len(LAYERS), "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
            "max_position_embeddings": 64, "sliding_window": 4, "layer_types": LAYERS,
            "eos_token_id": 1, "bos_token_id": 2, **overrides}


def _redraw(hf: torch.nn.Module) -> None:
    """Every weight far from its init (norms included) and ``layer_scalar`` s (HF buffers)
    away from 1, so each feature shows in the logits."""
    redraw_weights(hf)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(torch.rand(1, generator=gen) + 0.5)


def _save_text(path: Path, **overrides: Any) -> torch.nn.Module:
    config = transformers.Gemma4TextConfig(**_text(**overrides))
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(config).eval()
    _redraw(hf)
    hf.save_pretrained(path)
    return hf


def _caches(model: torch.nn.Module) -> list[torch.Tensor]:
    """A paged cache per cache layer, shaped by its own spec, filled with 1e4 (a slot read
    before it is written shows)."""
    specs = layer_specs(model)
    caches = []
    for i in range(len(specs)):
        spec = specs[i]
        assert isinstance(spec, PagedKVSpec)
        caches.append(torch.full((2, TEST_NUM_BLOCKS, TEST_BLOCK_SIZE, spec.num_kv_heads,
                                  spec.head_dim), 1e4))
    return caches


def _model(path: Path) -> Gemma4ForCausalLM:
    model = Gemma4ForCausalLM(transformers.AutoConfig.from_pretrained(path))
    loaded = load_model_weights(model, iter_safetensors(path))
    assert loaded == {name for name, _ in model.named_parameters()}
    return model


def test_all_features_match_hf(tmp_path: Path) -> None:
    """PLE, KV sharing, keys as values, double-wide MLP, proportional RoPE, final soft-cap:
    logits through the paged cache. The shared layers declare no cache; the global layers'
    caches have their own shape."""
    hf = _save_text(tmp_path, **FULL)
    model = _model(tmp_path)
    specs = layer_specs(model)
    assert [(s.num_kv_heads, s.head_dim, s.sliding_window) for s in specs.values()] == [
        (2, 16, 4), (1, 32, None), (2, 16, 4)]
    shared = [layer.self_attn for layer in model.model.layers[3:]]
    assert [a.source for a in shared if isinstance(a, Gemma4SharedAttention)] == [2, 1]
    assert model.model.layers[4].mlp.down_proj.input_size == 96  # double wide
    prefill, _ = check_steps_against_hf(model, hf, _caches(model), (9, 3, 13), vocab=VOCAB,
                                        max_len=16, atol=ATOL)
    assert max(float(logits.abs().max()) for logits in prefill) <= 4.0  # the final cap
    ids, positions = step_inputs([0], [[5, 17, 42, 9, 100, 3]])
    metadata = step_metadata([0], [6], [[0, 1]])
    with torch.inference_mode(), set_forward_context(torch_context(_caches(model), metadata)):
        plain = model(ids, positions)
        embedded = model(ids, positions, inputs_embeds=model.embed_input_ids(ids))
    torch.testing.assert_close(embedded, plain, atol=0, rtol=0)  # (PLE still reads the ids)


def test_plain_config_matches_hf(tmp_path: Path) -> None:
    """No PLE or sharing, with biases and scaled proportional RoPE."""
    hf = _save_text(tmp_path, **PLAIN)
    model = _model(tmp_path)
    check_steps_against_hf(model, hf, _caches(model), (9, 3, 13), vocab=VOCAB, max_len=16,
                           atol=ATOL)


def test_moe_block_matches_hf(tmp_path: Path) -> None:
    """The router and the GeGLU experts (the core's fused MoE with its ``gelu_tanh``
    epilogue) of every layer equal HF's on the same input; then the logits through the
    cache."""
    hf = _save_text(tmp_path, **MOE)
    model = _model(tmp_path)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(5)) * 3
    with torch.no_grad():
        for theirs, ours in zip(hf.model.layers, model.model.layers, strict=True):
            _, weights, ids = theirs.router(x)
            assert ours.router is not None
            got_weights, got_ids = ours.router(x)
            assert torch.equal(got_ids.long(), ids)
            torch.testing.assert_close(got_weights, weights, atol=1e-6, rtol=1e-6)
            normed = theirs.pre_feedforward_layernorm_2(x)
            expected = theirs.experts(normed, ids, weights)
            for rows in (4, 12):
                torch.testing.assert_close(ours.experts(normed[:rows], weights[:rows],
                                                        got_ids[:rows]),
                                           expected[:rows], atol=1e-6, rtol=1e-5)
    check_steps_against_hf(model, hf, _caches(model), (9, 3, 13), vocab=VOCAB, max_len=16,
                           atol=ATOL)


def test_greedy_tokens_match_hf_through_the_engine(tmp_path: Path) -> None:
    """Prompts and outputs past the window, chunked prefill (8 tokens a step): HF
    ``generate``'s tokens. The sliding layers get block tables of their own though the
    global layer's cache has another shape (one kv head of 32 against two of 16: they share
    tensors through pages), and their blocks out of the window go back to the pool."""
    hf = _save_text(tmp_path, **FULL)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=24)
    runner = llm.engine.runner
    assert runner.kv_table_windows == (None, 4, 4)
    assert runner.kv.tensors[1].shape[3:] == (1, 32) and runner.kv.tensors[0].shape[3:] == (
        2, 16)
    assert runner.kv.tensors[0].untyped_storage().data_ptr() == (
        runner.kv.tensors[1].untyped_storage().data_ptr())  # (one slot: pages)
    prompts = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 120], [3 + i for i in range(9)] + [40], [64]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_generate(hf, p, 10) for p in prompts]
    assert llm.engine.scheduler.tables.num_freed > 0
    assert llm.engine.block_manager.num_free_blocks == 24


def test_kv_bytes_per_token_with_wider_sliding_layers(tmp_path: Path) -> None:
    """With shared pages whose sliding layers are the wider (4 kv heads of 16 against the
    global layer's 1 of 32), the bench's KV bytes a token are the global layer's own (k and v,
    one head of 32, fp32), not the page it shares."""
    from mrv2.bench.measure import kv_bytes_per_token

    _save_text(tmp_path, **{**FULL, "num_key_value_heads": 4})
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=2,
              num_gpu_blocks_override=40)
    runner = llm.engine.runner
    assert runner.kv_table_windows == (None, 4, 4)
    assert runner.kv.bytes_per_block(1, runner.dtype) == 2 * 4 * 16 * 4  # (a page: one slot)
    assert kv_bytes_per_token(runner) == 2 * 1 * 32 * 4


def _hf_generate(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # (as ignore_eos)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _save_multimodal(path: Path, tied: bool) -> torch.nn.Module:
    text = _text(**{**FULL, "vocab_size": 300, "vocab_size_per_layer_input": 300})
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "patch_size": 8, "pooling_kernel_size": 2, "position_embedding_size": 64}
    audio = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "subsampling_conv_channels": [8, 4], "output_proj_dims": 32,
             "conv_kernel_size": 3}
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=audio, tie_word_embeddings=tied,
        image_token_id=297, audio_token_id=298, video_token_id=299, boi_token_id=296,
        eoi_token_id=295, boa_token_id=294, eoa_token_index=293)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    _redraw(hf)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_multimodal_checkpoint_serves_text(tmp_path: Path, tied: bool) -> None:
    """``Gemma4ForConditionalGeneration`` as transformers 5.17 saves it: the decoder under
    ``model.language_model.*`` (the head tied by the top-level flag), the vision tower's and
    embedder's tensors loaded into the image encoder, the audio ones into the audio encoder
    (its clip bounds are buffers); logits as HF's for text prompts, media placeholder ids
    embedded as pad as HF does."""
    hf = _save_multimodal(tmp_path, tied)
    names = checkpoint_names(tmp_path)
    assert "model.language_model.embed_tokens_per_layer.weight" in names
    assert {n.split(".")[1] for n in names} >= {"vision_tower", "audio_tower", "embed_vision",
                                                 "embed_audio"}
    assert ("lm_head.weight" in names) is not tied
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = Gemma4ForConditionalGeneration(config)
    loaded = load_model_weights(model, iter_safetensors(tmp_path))
    params = {name for name, _ in model.named_parameters()}
    assert params <= loaded and loaded - params == {
        name for name, _ in model.named_buffers() if name.startswith("audio.")}
    assert model.tie_word_embeddings is tied and model.config is config.text_config
    caches = _caches(model)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=300, max_len=16, atol=ATOL)
    prompt = [5, 297, 8, 298, 299, 40, 7]  # placeholders without media
    logits, _ = run_step(model, caches, [[0, 1, 2, 3]], [0], [prompt])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=ATOL)


def test_multimodal_engine_serves_text_and_refuses_media(tmp_path: Path) -> None:
    """Greedy tokens of the multimodal checkpoint through the engine are HF's; a prompt with
    an image, the checkpoint shipping no image processor config, is refused naming the file,
    one with an empty image list is text (images: ``test_gemma4_images.py``)."""
    hf = _save_multimodal(tmp_path, tied=False)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    assert llm.engine.runner.model_entry.architecture == "Gemma4ForConditionalGeneration"
    prompt = [5, 17, 42, 9, 100, 3, 77, 8, 8, 250]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_generate(hf, prompt, 6)
    with pytest.raises(ValueError, match="multi_modal_data.image: no image processor settings"):
        llm.generate([{"prompt_token_ids": [7, 297, 8], "multi_modal_data": {"image": [
            torch.zeros(3, 16, 16)]}}], params, use_tqdm=False)
    empty = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": []}}],
                         params, use_tqdm=False)
    assert empty[0].outputs[0].token_ids == out[0].outputs[0].token_ids


@pytest.mark.parametrize(("overrides", "match"), [
    ({"use_bidirectional_attention": "all"}, r"use_bidirectional_attention = 'all'"),
    ({"num_kv_shared_layers": 5}, r"num_kv_shared_layers = 5 must be in \[0, 5\)"),
    ({"num_kv_shared_layers": 4}, r"shared layer 1 \(full_attention\) has no earlier"),
    ({"per_layer_config": {"0": {"intermediate_size": 32}}},
     r"per_layer_config overrides \['intermediate_size'\]"),
    ({"enable_moe_block": True, "num_experts": 4}, r"enable_moe_block = true needs top_k"),
    ({"rope_parameters": {S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5},
                          F: {"rope_type": "default", "rope_theta": 1e6}}},
     r"rope_parameters\['sliding_attention'\].partial_rotary_factor"),
    ({"rope_parameters": {S: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                          F: {"rope_type": "default", "rope_theta": 1e6}}},
     r"rope_parameters\['sliding_attention'\].rope_type = 'dynamic'"),
])
def test_bad_configs_name_the_field(overrides: dict[str, Any], match: str) -> None:
    config = transformers.Gemma4TextConfig(**_text(**overrides))
    with pytest.raises(ValueError, match=match):
        Gemma4ForCausalLM(config)


def test_per_layer_embeddings_refuse_prompt_embeds(tmp_path: Path) -> None:
    """A model with per-layer embeddings reads the prompt's token ids beside their embeddings:
    ``enable_prompt_embeds`` is refused at start-up, naming the architecture; without them
    (PLAIN) prompts given as embeddings run."""
    _save_text(tmp_path / "ple", **FULL)
    with pytest.raises(ValueError, match="Gemma4ForCausalLM model takes no prompt embeddings"):
        LLM(str(tmp_path / "ple"), device="cpu", dtype="float32", enable_prompt_embeds=True)
    _save_text(tmp_path / "plain", **PLAIN)
    llm = LLM(str(tmp_path / "plain"), device="cpu", dtype="float32", block_size=4,
              enable_prompt_embeds=True)
    ids = [5, 17, 42, 9, 100]
    embeds = llm.engine.runner.model.embed_input_ids(torch.tensor(ids)).detach()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": embeds}],
                                     params, use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
