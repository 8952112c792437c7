"""GPU: Aya Vision (``AyaVisionForConditionalGeneration``: the SigLIP tower over each image's
tiles and thumbnail, the pixel-shuffle SwiGLU projector, a Command R7B decoder with sliding
and global layers; HF's ``TILE_i`` / ``<|IMG_PATCH|>`` layout) through the engine with CUDA
graphs and the Triton kernels: fp32 greedy tokens and prompt log-probabilities are HF's with
graphs on and off, images split across chunked-prefill steps; in bf16 every prompt position's
log-probability is near HF's bf16 model's, every greedy token is HF's best or a near tie of it
with HF fed the engine's own tokens (``check_greedy_up_to_ties``), and graphs on and off
agree. HF is fed the engine's own tiles (the image processor is checked against HF's on the
CPU), and its logits are multiplied by ``logit_scale`` as the engine's (see
``mrv2_cohere.aya_vision``).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import check_greedy_up_to_ties

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
#: bf16 bounds against HF's bf16 model (the ones Idefics3's GPU test uses, for the same kind
#: of tower and decoder sizes): a greedy token at most this far below HF's best where HF is
#: fed the engine's tokens, and a prompt log-probability at most this far off ...
BF16_TIE = 0.4
BF16_MAX = 0.4
#: ... with the mean bound, 0.05, what a wrong position or layer would break.
BF16_MEAN = 0.05
LOGIT_SCALE = 0.5
SPECIAL = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
           "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL")


def _checkpoint(path: Path, dtype: torch.dtype) -> tuple[Any, int]:
    """A tiny checkpoint saved in ``dtype`` (24-pixel tiles of 9 image tokens, up to 6 tiles
    and the thumbnail; 4 decoder layers, one in four global), HF's model on CUDA in that dtype
    (its logits times ``logit_scale``) and the ``<|IMG_PATCH|>`` id."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=SPECIAL)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    patch = int(tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"))
    config = transformers.AyaVisionConfig(
        text_config={"model_type": "cohere2", "vocab_size": len(tokenizer) + 8,
                     "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "sliding_window": 16, "max_position_embeddings": 2048,
                     "logit_scale": LOGIT_SCALE, "pad_token_id": None, "bos_token_id": 0,
                     "eos_token_id": 1},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": 3,
                       "num_attention_heads": 2, "patch_size": 4, "image_size": 24,
                       "vision_use_head": False},
        vision_feature_layer=-1, downsample_factor=2, image_token_index=patch,
        alignment_intermediate_size=96)  # type: ignore[call-arg]  # (read by getattr)
    config.architectures = ["AyaVisionForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.AyaVisionForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf = hf.to(dtype)
    hf.save_pretrained(path)
    images = GotOcr2ImageProcessorPil(size={"height": 24, "width": 24}, crop_to_patches=True,
                                      min_patches=1, max_patches=6)
    transformers.AyaVisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4,
                                    img_size=24, downsample_factor=2).save_pretrained(path)
    hf.lm_head.register_forward_hook(lambda module, args, out: out * LOGIT_SCALE)
    return hf.cuda(), patch


def _pixels(hf: Any, items: list[Any]) -> dict[str, Any]:
    """HF's image input on CUDA: the engine's tiles of the prompt's images, in order."""
    if not items:
        return {}
    tiles = torch.cat([item.data["pixel_values"] for item in items])
    return {"pixel_values": tiles.to("cuda", hf.dtype)}


def _requests(patch: int) -> list[dict[str, Any]]:
    a, b = random_image(80, 40, seed=1), random_image(24, 24, seed=2)
    return [
        {"prompt_token_ids": [5, 17, patch, 9, 3, patch, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [patch, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1 + i % 200 for i in range(97)]}]


def _logprobs(hf: Any, items: list[Any], ban: int | None = None) -> Any:
    """HF's log-softmax over a sequence of token ids, with the image tiles of ``items``
    (``ban``: that token's logits lowered by 100, the engine's ``logit_bias``)."""
    def run(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([seq], device="cuda"), **_pixels(hf, items)).logits[0]
        logits = logits.float()
        if ban is not None:
            logits[:, ban] -= 100.0
        return torch.log_softmax(logits, dim=-1)
    return run


def _run(path: Path, dtype: str, eager: bool, patch: int, hf: Any, ban: int | None = None
         ) -> tuple[list[list[int]], list[list[int]], Any, list[tuple[list[int], Any]]]:
    """The engine's greedy tokens, HF's (same prompts, expanded by the engine), the engine's
    prompt logprobs of the first request beside HF's, and per request its expanded ids with
    HF's log-softmax over any ids after that prompt. ``ban``: a token the engine's greedy
    never picks (``logit_bias`` -100) nor HF's reference (an image token generated by the
    random model would be one placeholder more than the images' features in HF's forward)."""
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
    requests = _requests(patch)
    processor = llm.engine.input_processor
    assert processor is not None
    expected, expanded = [], []
    for request in requests:
        images = request.get("multi_modal_data", {}).get("image", [])
        ids, items = processor.process(request["prompt_token_ids"], {"image": images})
        expanded.append((ids, items))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"),
                              attention_mask=torch.ones(1, len(ids), device="cuda"),
                              max_new_tokens=MAX_TOKENS, do_sample=False, **_pixels(hf, items))
        expected.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logit_bias=None if ban is None else {ban: -100.0})
    got = [list(o.outputs[0].token_ids)
           for o in llm.generate(requests, params, use_tqdm=False)]
    lp = llm.generate([requests[0]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)[0].prompt_logprobs
    llm.shutdown()
    ids, items = expanded[0]
    want = _logprobs(hf, items)(ids)
    assert lp is not None and len(lp) == len(ids)
    pairs = []
    for pos in range(1, len(ids)):
        mine = lp[pos]
        assert mine is not None
        pairs.append((mine[ids[pos]].logprob, float(want[pos - 1, ids[pos]])))
    return got, expected, pairs, [(ids, _logprobs(hf, items, ban)) for ids, items in expanded]


def test_aya_vision_images_fp32_graphs(tmp_path: Path) -> None:
    hf, patch = _checkpoint(tmp_path, torch.float32)
    hf.generation_config.eos_token_id = None
    for eager in (False, True):
        got, expected, pairs, _ = _run(tmp_path, "float32", eager, patch, hf)
        assert got == expected, eager
        for mine, theirs in pairs:
            assert mine == pytest.approx(theirs, abs=2e-3)


def test_aya_vision_images_bf16_parity(tmp_path: Path) -> None:
    hf, patch = _checkpoint(tmp_path, torch.bfloat16)
    hf.generation_config.eos_token_id = None
    runs = {}
    for eager in (False, True):
        got, _, pairs, refs = _run(tmp_path, "bfloat16", eager, patch, hf, ban=patch)
        runs[eager] = got
        for tokens, (ids, logprobs) in zip(got, refs, strict=True):
            check_greedy_up_to_ties(tokens, ids, logprobs, tol=BF16_TIE)
        err = max(abs(mine - theirs) for mine, theirs in pairs)
        mean = sum(abs(mine - theirs) for mine, theirs in pairs) / len(pairs)
        assert err < BF16_MAX and mean < BF16_MEAN, (eager, err, mean)
    assert [g[:4] for g in runs[False]] == [g[:4] for g in runs[True]]
