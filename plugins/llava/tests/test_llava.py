"""LLaVA (``LlavaForConditionalGeneration``: a Llama / Mistral / Qwen2 / Qwen3 text decoder,
a CLIP tower, the projector) through the engine against HF transformers: the prompt expanded
as HF's ``LlavaProcessor`` expands it; greedy tokens and every prompt position's
log-probability with two images in a prompt, an image shared between requests and a text
prompt beside them, chunked prefill splitting images across steps; the encoder cache on a
second round; checkpoint names in every layout; bad input and an unsupported text decoder or
tower refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2_llava.model import LlavaForConditionalGeneration

TEXTS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "mistral": {"model_type": "mistral", "sliding_window": 24},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
}
VISION: dict[str, Any] = {"model_type": "clip_vision_model", "hidden_size": 32,
                          "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 16, "patch_size": 4}
TOKENS_PER_IMAGE = 16  # (16 / 4)**2 patches + CLS - CLS (default strategy)


def _checkpoint(path: Path, kind: str) -> tuple[Any, int]:
    """A tiny checkpoint with its tokenizer (``<image>`` special) and CLIP image processor;
    HF's model and the ``<image>`` id."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=("<image>",))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    image = int(tokenizer.convert_tokens_to_ids("<image>"))
    text = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, **TEXTS[kind]}
    config = transformers.LlavaConfig(text_config=text, vision_config=VISION,
                                      image_token_index=image, tie_word_embeddings=False)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    _processor().save_pretrained(path)
    return hf, image


def _processor() -> Any:
    return transformers.CLIPImageProcessorPil(size={"shortest_edge": 16},
                                              crop_size={"height": 16, "width": 16})


def _hf_inputs(images: list[Any]) -> dict[str, Any]:
    if not images:
        return {}
    return {"pixel_values": _processor()(images=images, return_tensors="pt")["pixel_values"]}


def test_prompt_expanded_as_hf_processor(tmp_path: Path) -> None:
    """The token ids equal HF's ``LlavaProcessor``'s (``num_additional_image_tokens=1``, as
    the published LLaVA-1.5 processors set it) for a text with two images."""
    _, image = _checkpoint(tmp_path, "llama")
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    hf_processor = transformers.LlavaProcessor(
        image_processor=_processor(), tokenizer=tokenizer, patch_size=4,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)
    text = "Hello <image> world, and<image>!"
    images = [random_image(40, 20, seed=1), random_image(16, 16, seed=2)]
    want = hf_processor(text=text, images=images, return_tensors="pt")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    ids, items = llm.engine.input_processor.process(
        tokenizer(text, add_special_tokens=False)["input_ids"], {"image": images})
    assert ids == [int(t) for t in want["input_ids"][0]]
    assert [ids.count(image), len(items)] == [2 * TOKENS_PER_IMAGE, 2]
    for n, item in enumerate(items):
        assert item.length == TOKENS_PER_IMAGE
        assert set(ids[item.offset:item.offset + item.length]) == {image}
        torch.testing.assert_close(item.data["pixel_values"], want["pixel_values"][n])


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_tokens_and_logprobs_match_hf_with_images(tmp_path: Path, kind: str) -> None:
    hf, image = _checkpoint(tmp_path, kind)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=6)  # (images of 16 tokens: split across steps)
    a, b = random_image(40, 20, seed=1), random_image(16, 16, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, image, 100, 3], [a]), ([image, 64, 8, image, 50], [b, a]),
        ([3, 4, 5, 6], [])]
    processor = llm.engine.input_processor
    hf.generation_config.eos_token_id = None
    want = []
    for prompt, images in prompts:
        ids, items = processor.process(prompt, {"image": images})
        assert [item.length for item in items] == [TOKENS_PER_IMAGE] * len(images)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              max_new_tokens=6, do_sample=False, **_hf_inputs(images))
        want.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": i}} for p, i in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    state = llm.engine.runner.model_state
    assert state.encoder_runs == 2  # image a once for both requests, across chunks
    again = llm.generate(requests[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want[:2]
    assert state.encoder_runs == 2

    ids, _ = processor.process(prompts[1][0], {"image": prompts[1][1]})
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), **_hf_inputs(prompts[1][1])).logits[0]
    want_lp = torch.log_softmax(logits.double(), dim=-1)
    got = llm.generate([requests[1]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0].prompt_logprobs
    assert got is not None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        mine = got[pos]
        assert mine is not None
        assert mine[ids[pos]].logprob == pytest.approx(float(want_lp[pos - 1, ids[pos]]),
                                                       abs=1e-4), pos


def _published(weights: Any) -> Any:
    """transformers 4's layout of the ``llava-hf`` files."""
    for name, tensor in weights:
        if name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        elif name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("model.vision_tower.")
        yield name.removeprefix("model."), tensor


def test_checkpoint_names_and_bad_input(tmp_path: Path) -> None:
    """The saved names, HF's in-memory ones and the published layout load every parameter; a
    placeholder count, a kind or an image count that does not fit is refused by name,
    nothing queued; a text decoder or a tower not built here is refused naming the field."""
    hf, image = _checkpoint(tmp_path, "qwen2")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    for weights in (iter_safetensors(tmp_path), hf.state_dict().items(),
                    _published(hf.state_dict().items())):
        model = LlavaForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded >= {name for name, _ in model.named_parameters()}
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              limit_mm_per_prompt=2)
    picture = random_image(16, 16, seed=0)
    params = SamplingParams(max_tokens=2)
    for prompt, mm_data, match in (
            ([5, image], {"image": [picture, picture]}, "2 images but the prompt has 1"),
            ([5, image, image], {"image": [picture]}, "1 images but the prompt has 2"),
            ([5, image], {"video": [picture]}, r"unsupported keys \['video'\]"),
            ([image] * 3, {"image": [picture] * 3}, "3 images; at most 2")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    object.__setattr__(config.text_config, "model_type", "mixtral")
    with pytest.raises(ValueError, match="text_config.model_type = 'mixtral' is not supported"):
        LlavaForConditionalGeneration(config)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    object.__setattr__(config.vision_config, "model_type", "pixtral")
    with pytest.raises(ValueError, match="vision_config.model_type = 'pixtral' is not supp"):
        LlavaForConditionalGeneration(config)
