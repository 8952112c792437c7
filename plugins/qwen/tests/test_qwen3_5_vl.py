"""Qwen3.5's vision-language checkpoints with images, through the engine against HF
transformers (dense and MoE): greedy tokens and every prompt and generated position's top-3
log-probabilities, the image rows from Qwen3-VL's tower without deepstack, interleaved M-RoPE
over half of each head in the full-attention layers, the Gated DeltaNet layers' states carried
across steps when the prompt (image included) is split over several."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2_qwen.qwen3_5_vl import Qwen3_5VLForConditionalGeneration
from mrv2_qwen.testing import save_tiny_qwen3_5_vl
from mrv2_qwen_vl.mrope import MRotaryEmbedding
from mrv2_qwen_vl.testing import END, IMAGE, START, random_image

PROMPT = [5, 17, START, IMAGE, END, 42, 9, 100, 3]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_images_match_hf(tmp_path: Path, moe: bool, chunked: bool) -> None:
    """``whole``: the prompt in one step; ``chunked``: split across steps of 4 tokens, so an
    image's rows span steps (the encoder cache sliced) while the recurrent states carry over.
    A second request, text only, shares the batch."""
    hf = save_tiny_qwen3_5_vl(tmp_path, moe=moe)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              **({"max_num_batched_tokens": 4} if chunked else {}))
    model = llm.engine.runner.model
    assert isinstance(model, Qwen3_5VLForConditionalGeneration)
    assert not model.visual.deepstack_merger_list
    ropes = [m.self_attn.rotary_emb for m in model.model.layers if not m.linear]
    assert ropes and all(isinstance(r, MRotaryEmbedding) for r in ropes)

    image = random_image(56, 84, 0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    text_prompt = [8, 8, 120, 7, 33]
    outs = llm.generate([{"prompt_token_ids": PROMPT, "multi_modal_data": {"image": [image]}},
                         {"prompt_token_ids": text_prompt}], params, use_tqdm=False)
    processor = llm.engine.input_processor
    assert processor is not None
    expanded, items = processor.process(PROMPT, {"image": [image]})
    assert expanded.count(IMAGE) == items[0].length >= 4
    kwargs: dict[str, Any] = {
        "pixel_values": torch.cat([i.data["pixel_values"] for i in items]),
        "image_grid_thw": torch.tensor([i.data["grid_thw"] for i in items])}
    for out, ids, mm in ((outs[0], expanded, kwargs), (outs[1], text_prompt, {})):
        got = out.outputs[0].token_ids
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            want = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                               max_new_tokens=8, do_sample=False,
                               mm_token_type_ids=(input_ids == IMAGE).int(), **mm)
            assert got == want[0, len(ids):].tolist()
            sequence = torch.tensor([ids + got])
            logits = hf(sequence, mm_token_type_ids=(sequence == IMAGE).int(), **mm).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert out.prompt_logprobs is not None and out.outputs[0].logprobs is not None
        positions = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
        assert len(positions) == sequence.shape[1] - 1
        for j, logprobs in enumerate(positions, start=1):
            assert logprobs is not None
            assert set(ref[j - 1].topk(3).indices.tolist()) <= set(logprobs), f"position {j}"
            for token, lp in logprobs.items():
                assert lp.logprob == pytest.approx(float(ref[j - 1, token]), abs=2e-4), (
                    f"position {j}, token {token}")
