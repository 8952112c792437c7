"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral's decoder, the Pixtral vision tower
and the patch-merging projector) through the engine against HF transformers: greedy tokens and
every prompt position's log-probability with images of two aspect ratios (so different
``[IMG]`` / ``[IMG_BREAK]`` grids), two in a prompt, an image shared between requests and a
text prompt beside them, chunked prefill splitting images across steps; the encoder cache on a
second round; checkpoint names in both layouts; bad input refused by name. Ministral 3's
decoder (``ministral3``: the queries scaled by position past
``original_max_position_embeddings``) too; another text decoder refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import HfInputs, check_images_against_hf
from mrv2_mistral3.model import Mistral3ForConditionalGeneration

TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
TEXT: dict[str, Any] = {
    "model_type": "mistral", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "rope_theta": 1e4}
#: Ministral 3's decoder: YaRN, and the query scale past 8 positions (within the prompts).
MINISTRAL3: dict[str, Any] = {
    **{k: v for k, v in TEXT.items() if k != "rope_theta"}, "model_type": "ministral3",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                        "original_max_position_embeddings": 8, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "llama_4_scaling_beta": 0.5}}
VISION: dict[str, Any] = {
    "model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "patch_size": 4,
    "image_size": 64}


def _checkpoint(path: Path, text: dict[str, Any] = TEXT) -> tuple[Any, list[int]]:
    """A tiny checkpoint with its tokenizer (the image tokens special) and image processor;
    HF's model and the ids of ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=TOKENS)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in TOKENS]
    config = transformers.Mistral3Config(text_config=dict(text), vision_config=VISION,
                                         image_token_index=ids[0], spatial_merge_size=2,
                                         tie_word_embeddings=False)
    config.architectures = ["Mistral3ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    transformers.PixtralImageProcessorPil(size={"longest_edge": 32},
                                          patch_size={"height": 4, "width": 4}
                                          ).save_pretrained(path)
    return hf, ids


def _hf_inputs(path: Path) -> HfInputs:
    processor: Any = transformers.PixtralImageProcessorPil.from_pretrained(str(path))

    def inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not images:
            return {}
        out = processor(images=images, patch_size={"height": 8, "width": 8},
                        return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}
    return inputs


@pytest.mark.parametrize("text", [TEXT, MINISTRAL3], ids=["mistral", "ministral3"])
def test_tokens_and_logprobs_match_hf_with_images(tmp_path: Path, text: dict[str, Any]
                                                  ) -> None:
    hf, (img, brk, end) = _checkpoint(tmp_path, text)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)  # (images of 15-16 tokens: split across steps)
    a, b = random_image(40, 24, seed=1), random_image(24, 32, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, img, 100, 3], [a]), ([img, 64, 8, img, 50], [b, a]), ([3, 4, 5, 6], [])]
    # (encoder_runs 2: image a once for both requests, across chunks)
    expanded = check_images_against_hf(llm, hf, prompts, _hf_inputs(tmp_path), encoder_runs=2)
    grids = set()
    for ids, items in expanded:
        for item in items:
            run = ids[item.offset: item.offset + item.length]
            assert run[-1] == end and run.count(end) == 1
            grids.add((run.count(brk) + 1, run.count(img) // (run.count(brk) + 1)))
    assert len(grids) == 2  # (two aspect ratios)


def test_checkpoint_names_and_bad_input(tmp_path: Path) -> None:
    """The saved names and HF's in-memory ones load every parameter; a tensor matching none
    is an error naming it; a placeholder count, a kind or a limit that does not fit is refused
    by name, nothing queued."""
    hf, (img, _, _) = _checkpoint(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    for weights in (iter_safetensors(tmp_path), hf.state_dict().items()):
        model = Mistral3ForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded == {name for name, _ in model.named_parameters()}
    with pytest.raises(ValueError, match="language_model.model.layers.0.bogus.weight"):
        load_model_weights(Mistral3ForConditionalGeneration(config),
                           [*iter_safetensors(tmp_path),
                            ("language_model.model.layers.0.bogus.weight", torch.zeros(2))])
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    image = random_image(16, 16, seed=0)
    params = SamplingParams(max_tokens=2)
    for mm_data, match in (({"image": [image, image]}, "2 images but the prompt has 1"),
                           ({"video": [image]}, r"unsupported keys \['video'\]")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [5, img], "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    object.__setattr__(config.text_config, "model_type", "qwen2")
    with pytest.raises(ValueError, match="text_config.model_type = 'qwen2' is not supported"):
        Mistral3ForConditionalGeneration(config)
