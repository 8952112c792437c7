"""GPU: InternVL with images (InternViT over an image's tiles, a Qwen2 decoder) through the
engine with CUDA graphs and the Triton kernels: fp32 greedy tokens are HF's with graphs on and
off, images split across chunked-prefill steps; bf16 graphs on and off agree.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights

pytestmark = pytest.mark.gpu

TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>")


def test_internvl_images_with_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32 against HF's CPU reference: cuDNN's TF32 convolutions (torch's default) off
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    make_tiny_tokenizer(tmp_path, vocab_size=300, special_tokens=TOKENS)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    context = int(tokenizer.convert_tokens_to_ids(TOKENS[2]))
    config = transformers.InternVLConfig(
        text_config={"model_type": "qwen2", "vocab_size": 320, "hidden_size": 128,
                     "intermediate_size": 256, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 1024},
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": [32, 32], "patch_size": [4, 4]},
        image_token_id=context, downsample_ratio=0.5, tie_word_embeddings=False)
    config.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.InternVLForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(tmp_path)
    transformers.GotOcr2ImageProcessorPil(
        size={"height": 32, "width": 32}, max_patches=4, crop_to_patches=True
    ).save_pretrained(tmp_path)
    a, b = random_image(80, 40, seed=1), random_image(32, 32, seed=2)
    requests: list[dict[str, Any]] = [
        {"prompt_token_ids": [5, 17, context, 9] * 2, "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [context, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1 + i % 200 for i in range(97)]}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs: dict[tuple[str, bool], list[list[int]]] = {}
    expected: list[list[int]] = []
    hf.generation_config.eos_token_id = None
    for dtype, eager in (("float32", False), ("float32", True), ("bfloat16", False),
                         ("bfloat16", True)):
        llm = LLM(str(tmp_path), device="cuda", dtype=dtype, block_size=16,
                  gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
        if not expected:
            for request in requests:
                images = request.get("multi_modal_data", {}).get("image", [])
                ids, _ = llm.engine.input_processor.process(
                    request["prompt_token_ids"], {"image": images})
                kwargs: dict[str, Any] = {}
                if images:  # (the engine's processor: transformers' torchvision backend
                    # where torchvision is installed, whose resize is not PIL's to the bit)
                    processor = llm.engine.input_processor.image_processor
                    kwargs = {"pixel_values": processor(images=images, crop_to_patches=True,
                                                        return_tensors="pt")["pixel_values"]}
                with torch.no_grad():
                    gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                      max_new_tokens=24, do_sample=False, **kwargs)
                expected.append([int(t) for t in gen[0, len(ids):]])
        outs = llm.generate(requests, params, use_tqdm=False)
        llm.shutdown()
        runs[dtype, eager] = [o.outputs[0].token_ids for o in outs]
    assert runs["float32", False] == expected and runs["float32", True] == expected
    assert [g[:4] for g in runs["bfloat16", False]] == [e[:4] for e in runs["bfloat16", True]]
