"""Gemma3ForConditionalGeneration (Gemma 3 4B/12B/27B's vision-language checkpoints) served for
text prompts: logits against HF's ``Gemma3ForConditionalGeneration`` through the paged cache
(tied and untied heads, the published and the in-memory tensor names), the vision tensors
skipped while unknown text tensors still fail, greedy tokens and chat through the engine (the
chat template from ``chat_template.json``, ``max_model_len`` from ``text_config``), and images
refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.loader import checkpoint_names
from mrv2.testing import (
    check_steps_against_hf,
    make_tiny_tokenizer,
    poisoned_caches,
    random_image,
    redraw_weights,
)
from mrv2_gemma.vl import Gemma3ForConditionalGeneration

VOCAB = 320
TEXT: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "sliding_window": 4, "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1e6}}}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
# (a Gemma-like template that renders image parts; saved as chat_template.json only)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<s>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
REFUSED = "images are not supported for Gemma3ForConditionalGeneration yet"


def _save(path: Path, tied: bool = True) -> torch.nn.Module:
    """A tiny Gemma3ForConditionalGeneration (a local and a global layer, a one-block SigLIP
    tower, 4 tokens an image), its weights redrawn, saved as transformers writes it."""
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, boi_token_index=317,
        eoi_token_index=318, image_token_index=319, tie_word_embeddings=tied)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    redraw_weights(hf)  # (norm offsets far from 0 too)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_hf(tmp_path: Path, tied: bool) -> None:
    """Prefill and decode logits equal HF's for text prompts past the local window, with the
    weights read from the saved files (``language_model.model.*``, ``vision_tower.*``, as
    transformers 5.17 writes them) and from HF's own state dict (``model.language_model.*``,
    ``model.vision_tower.*``, ``lm_head.weight``). The head is tied by the top-level
    ``tie_word_embeddings`` (the untied checkpoint's text_config still says true)."""
    hf = _save(tmp_path, tied)
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
        assert not [n for n, _ in model.named_parameters() if "vision" in n or "modal" in n]
        check_steps_against_hf(model, hf, poisoned_caches(2, 16, 2), (9, 3, 13), vocab=VOCAB,
                               max_len=16)


def test_vision_tensors_skipped_unknown_text_tensors_fail(tmp_path: Path) -> None:
    """Any tensor under the vision tower's or the projector's prefix (either layout) is
    skipped; a text tensor that matches no parameter is an error naming it."""
    _save(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    weights = list(iter_safetensors(tmp_path))
    extra = [(name, torch.zeros(3)) for name in (
        "vision_tower.vision_model.not_a_layer.weight", "model.vision_tower.x.norm.weight",
        "multi_modal_projector.new.weight", "model.multi_modal_projector.mm_soft_emb_norm.weight")]
    model = Gemma3ForConditionalGeneration(config)
    loaded = load_model_weights(model, weights + extra)
    assert loaded == {name for name, _ in model.named_parameters()}
    assert [model.rename(name) for name, _ in extra] == [None] * 4
    for bad in ("language_model.model.layers.0.self_attn.bogus.weight",
                "model.language_model.layers.0.mlp.extra_proj.weight", "language_model.x"):
        with pytest.raises(ValueError, match=f"checkpoint tensor '{bad}' matches no parameter"):
            load_model_weights(Gemma3ForConditionalGeneration(config),
                               weights + [(bad, torch.zeros(3))])


def _checkpoint(path: Path) -> torch.nn.Module:
    """An untied tiny checkpoint (varied greedy tokens) with a tokenizer whose chat template
    is in ``chat_template.json`` alone, as the VL checkpoints ship it."""
    hf = _save(path, tied=False)
    make_tiny_tokenizer(path, vocab_size=VOCAB)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return hf


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


def test_images_are_refused_before_anything_runs(tmp_path: Path) -> None:
    """A prompt with an image, through ``generate`` or an image part of ``LLM.chat``: a
    ValueError naming the architecture, and nothing of the batch queued; no items (an empty
    image list) is a text prompt."""
    _checkpoint(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    image = random_image(32, 32, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt_tokens = llm.engine.stats()["num_prompt_tokens"]
    for mm_data in ({"image": image}, {"image": [image, image]}, {"video": [image]}):
        with pytest.raises(ValueError, match=f"multi_modal_data .*: {REFUSED}"):
            llm.generate([{"prompt_token_ids": [5, 6]},
                          {"prompt_token_ids": [7, 8], "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
        assert not llm.engine.has_unfinished()
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Hello"}]}]
    with pytest.raises(ValueError, match=REFUSED):
        llm.chat(messages, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats()["num_prompt_tokens"] == prompt_tokens  # nothing ran
    empty = llm.generate([{"prompt_token_ids": [7, 8], "multi_modal_data": {"image": []}}],
                         params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": [7, 8]}], params, use_tqdm=False)
    assert empty[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
