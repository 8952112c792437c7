"""Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B's vision-language checkpoints) on text
prompts: logits against HF's ``Gemma3ForConditionalGeneration`` through the paged cache
(tied and untied heads, the published and the in-memory tensor names; the vision encoder's
tensors loaded too), unknown tensors refused by name, greedy tokens and chat through the engine
(the chat template from ``chat_template.json``, ``max_model_len`` from ``text_config``), and a
prompt with an empty image list served as text. Images: ``test_gemma3_images.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.loader import checkpoint_names
from mrv2.testing import check_steps_against_hf, poisoned_caches
from mrv2_gemma.testing import TEMPLATE, VOCAB, save_tiny_gemma3_vl
from mrv2_gemma.vl import Gemma3ForConditionalGeneration


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_hf(tmp_path: Path, tied: bool) -> None:
    """Prefill and decode logits equal HF's for text prompts past the local window, with the
    weights read from the saved files (``language_model.model.*``, ``vision_tower.*``, as
    transformers 5.17 writes them) and from HF's own state dict (``model.language_model.*``,
    ``model.vision_tower.*``, ``lm_head.weight``). The head is tied by the top-level
    ``tie_word_embeddings`` (the untied checkpoint's text_config still says true)."""
    hf = save_tiny_gemma3_vl(tmp_path, tied)
    names = checkpoint_names(tmp_path)
    assert "language_model.model.embed_tokens.weight" in names
    assert any(name.startswith("vision_tower.") for name in names)
    assert ("language_model.lm_head.weight" in names) is not tied
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.text_config.tie_word_embeddings  # (transformers' default, even untied)
    for weights in (iter_safetensors(tmp_path), hf.state_dict().items()):
        model = Gemma3ForConditionalGeneration(config)
        load_model_weights(model, weights)
        assert model.tie_word_embeddings is tied
        assert model.config is config.text_config and model.hf_config is config
        windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
        assert windows == [4, None]
        assert {n for n, _ in model.named_parameters() if n.startswith("vision.")}
        check_steps_against_hf(model, hf, poisoned_caches(2, 16, 2), (9, 3, 13), vocab=VOCAB,
                               max_len=16)


def test_unknown_tensors_fail(tmp_path: Path) -> None:
    """Every tensor loads (the encoder's under either layout's prefix); a tensor under the
    vision tower's or the projector's prefix, or a text tensor, that matches no parameter is an
    error naming it."""
    save_tiny_gemma3_vl(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    weights = list(iter_safetensors(tmp_path))
    model = Gemma3ForConditionalGeneration(config)
    loaded = load_model_weights(model, weights)
    assert loaded == {name for name, _ in model.named_parameters()}
    for bad in ("language_model.model.layers.0.self_attn.bogus.weight",
                "model.language_model.layers.0.mlp.extra_proj.weight", "language_model.x"):
        with pytest.raises(ValueError, match=f"checkpoint tensor '{bad}' matches no parameter"):
            load_model_weights(Gemma3ForConditionalGeneration(config),
                               weights + [(bad, torch.zeros(3))])
    for bad in ("vision_tower.vision_model.not_a_layer.weight",
                "model.multi_modal_projector.new.weight"):
        with pytest.raises(ValueError, match=bad.split(".")[-2]):
            load_model_weights(Gemma3ForConditionalGeneration(config),
                               weights + [(bad, torch.zeros(3))])


def _checkpoint(path: Path) -> torch.nn.Module:
    """An untied tiny checkpoint (varied greedy tokens) with a tokenizer whose chat template
    is in ``chat_template.json`` alone, as the VL checkpoints ship it."""
    return save_tiny_gemma3_vl(path, tied=False, tokenizer=True)


def _hf_generate(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # (as ignore_eos)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def test_greedy_tokens_and_chat_match_hf_through_the_engine(tmp_path: Path) -> None:
    """Prompts and outputs past the window, chunked prefill on: HF ``generate``'s tokens;
    ``LLM.chat`` on a text message renders ``chat_template.json``'s template."""
    hf = _checkpoint(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    assert llm.engine.runner.max_model_len == 128  # text_config.max_position_embeddings
    assert llm.engine.runner.model_entry.architecture == "Gemma3ForConditionalGeneration"
    prompts = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_generate(hf, p, 10) for p in prompts]

    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None and tokenizer.chat_template == TEMPLATE
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]
    ids = tokenizer.apply_chat_template(messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|user|>Hello world</s><|assistant|>")
    chat = llm.chat(messages, params, use_tqdm=False)
    assert chat[0].outputs[0].token_ids == _hf_generate(hf, ids, 10)


def test_an_empty_image_list_is_a_text_prompt(tmp_path: Path) -> None:
    """No items (an empty image list) is a text prompt: its tokens are a plain prompt's."""
    _checkpoint(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    empty = llm.generate([{"prompt_token_ids": [7, 8], "multi_modal_data": {"image": []}}],
                         params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": [7, 8]}], params, use_tqdm=False)
    assert empty[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
