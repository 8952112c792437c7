"""GPU: LFM2-VL with images (the SigLIP2 NaFlex tower over each tile and thumbnail, the
pixel-unshuffle projector, LFM2's hybrid decoder with its convolution state) through the engine
with CUDA graphs and the Triton kernels: fp32 greedy tokens and prompt log-probabilities are
HF's with graphs on and off, images split across chunked-prefill steps; in bf16 every prompt
position's log-probability is near HF's bf16 model's, every greedy token is HF's best or a
near tie of it with HF fed the engine's own tokens (``check_greedy_up_to_ties``), and graphs
on and off agree. HF is fed the engine's own patches; where torchvision is installed, the
engine's preprocessing is also checked bit for bit against HF's ``Lfm2VlImageProcessor``
(which needs it) on this host's CPU.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import random_image
from mrv2.testing_engine import check_greedy_up_to_ties
from mrv2_lfm2.testing import TINY_VL_IMAGES, hf_vl_inputs, save_tiny_lfm2_vl
from mrv2_lfm2.vl_inputs import ImageSettings, preprocess

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
#: bf16 bounds against HF's bf16 model (as for the other vision-language families): a greedy
#: token at most this far below HF's best where HF is fed the engine's tokens, and a prompt
#: log-probability at most this far off (mean under 0.05).
BF16_TIE = 0.4
BF16_MAX = 0.4


def _requests(image: int) -> list[dict[str, Any]]:
    a, b = random_image(80, 40, seed=1), random_image(20, 28, seed=2)
    return [
        {"prompt_token_ids": [5, 17, image, 9, 3, image, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [image, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1 + i % 200 for i in range(97)]}]


def _logprobs(hf: Any, items: list[Any]) -> Any:
    """HF's log-softmax over a sequence of token ids, with the image frames of ``items``."""
    def run(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([seq], device="cuda"),
                        **hf_vl_inputs(items, "cuda")).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)
    return run


def _run(path: Path, dtype: str, eager: bool, image: int, hf: Any
         ) -> tuple[list[list[int]], list[list[int]], Any, list[tuple[list[int], Any]]]:
    """The engine's greedy tokens, HF's (same prompts, expanded by the engine), the engine's
    prompt logprobs of the first request beside HF's, and per request its expanded ids with
    HF's log-softmax."""
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
    requests = _requests(image)
    processor: Any = llm.engine.input_processor
    expected, expanded = [], []
    for request in requests:
        images = request.get("multi_modal_data", {}).get("image", [])
        ids, items = processor.process(request["prompt_token_ids"], {"image": images})
        expanded.append((ids, items))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"),
                              attention_mask=torch.ones(1, len(ids), device="cuda"),
                              max_new_tokens=MAX_TOKENS, do_sample=False,
                              **hf_vl_inputs(items, "cuda"))
        expected.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids)
           for o in llm.generate(requests, params, use_tqdm=False)]
    lp: Any = llm.generate([requests[0]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)[0].prompt_logprobs
    llm.shutdown()
    ids, items = expanded[0]
    want = _logprobs(hf, items)(ids)
    assert lp is not None and len(lp) == len(ids)
    pairs = [(lp[pos][ids[pos]].logprob, float(want[pos - 1, ids[pos]]))
             for pos in range(1, len(ids))]
    return got, expected, pairs, [(ids, _logprobs(hf, items)) for ids, items in expanded]


def test_lfm2_vl_images_fp32_graphs(tmp_path: Path) -> None:
    model, image = save_tiny_lfm2_vl(tmp_path)
    hf: Any = model.cuda()
    hf.generation_config.eos_token_id = None
    for eager in (False, True):
        got, expected, pairs, _ = _run(tmp_path, "float32", eager, image, hf)
        assert got == expected, eager
        for mine, theirs in pairs:
            assert mine == pytest.approx(theirs, abs=2e-3)


def test_lfm2_vl_images_bf16_parity(tmp_path: Path) -> None:
    model, image = save_tiny_lfm2_vl(tmp_path, dtype=torch.bfloat16)
    hf: Any = model.cuda()
    hf.generation_config.eos_token_id = None
    runs = {}
    for eager in (False, True):
        got, _, pairs, refs = _run(tmp_path, "bfloat16", eager, image, hf)
        runs[eager] = got
        for tokens, (ids, logprobs) in zip(got, refs, strict=True):
            check_greedy_up_to_ties(tokens, ids, logprobs, tol=BF16_TIE)
        err = max(abs(mine - theirs) for mine, theirs in pairs)
        mean = sum(abs(mine - theirs) for mine, theirs in pairs) / len(pairs)
        assert err < BF16_MAX and mean < 0.05, (eager, err, mean)
    assert [g[:4] for g in runs[False]] == [g[:4] for g in runs[True]]


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="HF's Lfm2VlImageProcessor needs torchvision")
def test_lfm2_vl_preprocessing_is_hf_processors() -> None:
    """The engine's patches, frame grids and tile grid equal HF's image processor's (tiny
    and LFM2-VL's own settings; tiled, untiled and extreme aspects)."""
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    real = {"encoder_patch_size": 16, "downsample_factor": 2, "tile_size": 512,
            "max_image_tokens": 256, "min_image_tokens": 64}
    for cfg in (TINY_VL_IMAGES, {**TINY_VL_IMAGES, "do_image_splitting": False}, real):
        hf = Lfm2VlImageProcessor(**{k: v for k, v in cfg.items()
                                     if k != "image_processor_type"})
        settings = ImageSettings.of(cfg)
        for h, w in ((40, 56), (12, 20), (100, 30), (7, 5), (1000, 1500), (2048, 300)):
            img = random_image(h, w, seed=h * w)
            out = hf([img], return_tensors="pt", return_row_col_info=True)
            patches, shapes, grid = preprocess(img, settings)
            counts = out["pixel_attention_mask"].sum(1).tolist()
            want = torch.cat([out["pixel_values"][i, :n] for i, n in enumerate(counts)])
            assert [tuple(s) for s in out["spatial_shapes"].tolist()] == shapes
            assert (out["image_rows"][0], out["image_cols"][0]) == grid
            assert torch.equal(patches, want), (cfg, h, w)
