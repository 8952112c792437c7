"""GPU: Command A Vision (``Cohere2VisionForConditionalGeneration``: every SigLIP layer and
``post_layernorm`` over each image's tiles and thumbnail, the pixel-shuffle SwiGLU projector
without a LayerNorm, a Command A decoder with sliding and global layers; HF's
``<|START_OF_IMG|>`` / ``<|IMG_PATCH|>`` / ``<|IMG_LINE_BREAK|>`` layout) through the engine
with CUDA graphs and the Triton kernels: fp32 greedy tokens and prompt log-probabilities
(image rows included) are HF's with graphs on and off, images split across chunked-prefill
steps, beside a text prompt past the window; in bf16 graphs on and off agree on the first
tokens. HF is fed the engine's own tiles (the image processor is checked against HF's on the
CPU; with torchvision the engine runs HF's own), and its logits are multiplied by
``logit_scale`` as the engine's (see ``mrv2_cohere.cohere2_vision``).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
LOGIT_SCALE = 0.5
TOKENS = {"boi_token": "<|START_OF_IMG|>", "image_token": "<|IMG_PATCH|>",
          "img_line_break_token": "<|IMG_LINE_BREAK|>", "eoi_token": "<|END_OF_IMG|>"}


def _checkpoint(path: Path) -> tuple[Any, int]:
    """A tiny fp32 checkpoint (24-pixel tiles of 9 image tokens, up to 6 tiles and the
    thumbnail; 4 decoder layers, one in four global; a tower with its pooling head), HF's
    model on CUDA (its logits times ``logit_scale``) and the ``<|IMG_PATCH|>`` id."""
    from mrv2_cohere.cohere2_vision import Cohere2VisionImageProcessorPil

    make_tiny_tokenizer(path, vocab_size=300, special_tokens=tuple(TOKENS.values()))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path),
                                                               extra_special_tokens=TOKENS)
    tokenizer.save_pretrained(path)
    patch = int(tokenizer.image_token_id)
    config = transformers.Cohere2VisionConfig(
        text_config={"model_type": "cohere2", "vocab_size": len(tokenizer) + 8,
                     "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "sliding_window": 16, "max_position_embeddings": 2048,
                     "logit_scale": LOGIT_SCALE, "pad_token_id": None, "bos_token_id": 0,
                     "eos_token_id": 1},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": 3,
                       "num_attention_heads": 2, "patch_size": 4, "image_size": 24,
                       "vision_use_head": True},
        downsample_factor=2, image_token_id=patch, alignment_intermediate_size=96)
    config.architectures = ["Cohere2VisionForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Cohere2VisionForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    images = Cohere2VisionImageProcessorPil(size={"height": 24, "width": 24}, max_patches=6)
    images.patch_size = 3
    transformers.Cohere2VisionProcessor(image_processor=images,
                                        tokenizer=tokenizer).save_pretrained(path)
    settings = json.loads((path / "processor_config.json").read_text())
    settings["image_processor"]["image_processor_type"] = "Cohere2VisionImageProcessor"
    (path / "processor_config.json").write_text(json.dumps(settings))
    hf.lm_head.register_forward_hook(lambda module, args, out: out * LOGIT_SCALE)
    hf.generation_config.eos_token_id = None
    return hf.cuda(), patch


def _pixels(items: list[Any]) -> dict[str, Any]:
    if not items:
        return {}
    return {"pixel_values": torch.cat([item.data["pixel_values"] for item in items]).cuda()}


def _requests(patch: int) -> list[dict[str, Any]]:
    a, b = random_image(80, 40, seed=1), random_image(24, 24, seed=2)
    return [
        {"prompt_token_ids": [5, 17, patch, 9, 3, patch, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [patch, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1 + i % 200 for i in range(97)]}]


def _run(path: Path, dtype: str, eager: bool, patch: int, hf: Any | None
         ) -> tuple[list[list[int]], list[list[int]], list[tuple[float, float]]]:
    """The engine's greedy tokens; with ``hf``, HF's (same expanded prompts and tiles) and
    the first request's prompt log-probabilities, the engine's beside HF's."""
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
    requests = _requests(patch)
    processor = llm.engine.input_processor
    assert processor is not None
    expanded = [processor.process(r["prompt_token_ids"],
                                  {"image": r.get("multi_modal_data", {}).get("image", [])})
                for r in requests]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
    lp = llm.generate([requests[0]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)[0].prompt_logprobs
    llm.shutdown()
    if hf is None:
        return got, [], []
    expected = []
    for ids, items in expanded:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"),
                              attention_mask=torch.ones(1, len(ids), device="cuda"),
                              max_new_tokens=MAX_TOKENS, do_sample=False, **_pixels(items))
        expected.append([int(t) for t in out[0, len(ids):]])
    ids, items = expanded[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device="cuda"), **_pixels(items)).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    assert lp is not None and len(lp) == len(ids)
    pairs = []
    for pos in range(1, len(ids)):
        mine = lp[pos]
        assert mine is not None
        pairs.append((mine[ids[pos]].logprob, float(want[pos - 1, ids[pos]])))
    return got, expected, pairs


def test_cohere2_vision_images_fp32_graphs(tmp_path: Path) -> None:
    hf, patch = _checkpoint(tmp_path)
    for eager in (False, True):
        got, expected, pairs = _run(tmp_path, "float32", eager, patch, hf)
        assert got == expected, eager
        for mine, theirs in pairs:
            assert mine == pytest.approx(theirs, abs=2e-3)


def test_cohere2_vision_bf16_graphs_on_off_agree(tmp_path: Path) -> None:
    _, patch = _checkpoint(tmp_path)
    graphs = _run(tmp_path, "bfloat16", False, patch, None)[0]
    eager = _run(tmp_path, "bfloat16", True, patch, None)[0]
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
