"""GPU: Gemma 3 with images (``Gemma3ForConditionalGeneration``) through the engine with CUDA
graphs and the Triton kernels: fp32 greedy tokens are HF's (``pixel_values`` and
``token_type_ids``: an image's soft tokens attend both ways), with chunked prefill whose budget
would end steps inside images, several images a prompt and text prompts beside them; bf16
graphs on and off agree.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import random_image
from mrv2_gemma.testing import save_tiny_gemma3_vl

pytestmark = pytest.mark.gpu

def _requests(boi: int) -> list[dict[str, Any]]:
    a, b = random_image(40, 24, seed=1), random_image(32, 32, seed=2)
    prompts = [([5, 17, 42, 9, boi, 100, 3] * 3, [a, b, a]), ([boi, 64, 8, boi, 250], [b, a]),
               ([3, 4, 5, 6] * 5, []), ([7, boi], [b])]
    return [{"prompt_token_ids": p, "multi_modal_data": {"image": i}} for p, i in prompts]


def _generate(path: Path, dtype: str, boi: int, **kwargs: Any
              ) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16, gpu_memory_utilization=0.3,
              max_num_batched_tokens=24, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(_requests(boi), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_gemma3_images_with_graphs(tmp_path: Path) -> None:
    hf = save_tiny_gemma3_vl(tmp_path, tied=False, tokenizer=True, image_processor=True)
    boi, soft = hf.config.boi_token_index, hf.config.image_token_index
    got, llm = _generate(tmp_path, "float32", boi)
    processor = llm.engine.input_processor
    expected = []
    hf.generation_config.eos_token_id = None
    for request in _requests(boi):
        ids, items = processor.process(request["prompt_token_ids"], request["multi_modal_data"])
        kwargs: dict[str, Any] = {}
        if items:
            kwargs = {"pixel_values": torch.stack([i.data["pixel_values"] for i in items]),
                      "token_type_ids": (torch.tensor([ids]) == soft).long()}
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              max_new_tokens=24, do_sample=False, **kwargs)
        expected.append([int(t) for t in out[0, len(ids):]])
    llm.shutdown()
    assert got == expected
    eager, llm = _generate(tmp_path, "float32", boi, enforce_eager=True)
    llm.shutdown()
    assert eager == expected
    graphs, llm = _generate(tmp_path, "bfloat16", boi)
    llm.shutdown()
    bf16_eager, llm = _generate(tmp_path, "bfloat16", boi, enforce_eager=True)
    llm.shutdown()
    assert [g[:4] for g in graphs] == [e[:4] for e in bf16_eager]
