"""Gemma 4 with images (``Gemma4ForConditionalGeneration``, ``use_bidirectional_attention:
"vision"``) through the engine: greedy tokens equal HF ``generate``'s with ``pixel_values``,
``image_position_ids`` and ``mm_token_type_ids`` (an image's soft tokens attend both ways on
the sliding layers, including the kv-shared ones) for images of different aspect ratios (so
different soft-token counts), several a prompt, shared between requests, with chunked prefill
whose budget would end steps inside an image; the encoder cache on a second round; a video
without its placeholder refused by name (videos: ``test_gemma4_video.py``), audio for want
of an audio tower (audio: ``test_gemma4_audio.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.engine.request import Request
from mrv2.testing import random_image, redraw_weights
from mrv2.testing_engine import check_images_against_hf

S, F = "sliding_attention", "full_attention"
IMAGE, BOI, EOI = 120, 121, 122
TEXT: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "max_position_embeddings": 512, "sliding_window": 8, "layer_types": [S, F, S, S, F],
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
    "num_kv_shared_layers": 2, "use_bidirectional_attention": "vision", "eos_token_id": 1,
    "bos_token_id": 2, "pad_token_id": 0}
VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
    "position_embedding_size": 64}


def _checkpoint(path: Path) -> Any:
    config = transformers.Gemma4Config(
        text_config=TEXT, vision_config=VISION, audio_config=None, image_token_id=IMAGE,
        boi_token_id=BOI, eoi_token_id=EOI, video_token_id=123, audio_token_id=124,
        boa_token_id=125, eoa_token_index=126)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                         pooling_kernel_size=2).save_pretrained(path)
    return hf


def _hf_inputs(ids: list[int], items: list[Any]) -> dict[str, Any]:
    if not items:
        return {}
    return {"pixel_values": torch.stack([i.data["pixel_values"] for i in items]),
            "image_position_ids": torch.stack([i.data["position_ids"] for i in items]),
            "mm_token_type_ids": (torch.tensor([ids]) == IMAGE).long()}


def test_greedy_tokens_match_hf_with_images(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _checkpoint(tmp_path)
    cuts: list[tuple[int, int, int]] = []
    chunk_size = Request.chunk_size

    def counted(self: Request, start: int, n: int) -> int:
        got = chunk_size(self, start, n)
        if got < n:
            cuts.append((start, n, got))
        return got

    monkeypatch.setattr(Request, "chunk_size", counted)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=80)
    a, b = random_image(40, 24, seed=1), random_image(32, 32, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, 9, IMAGE, 100, 3], [a]), ([IMAGE, 64, 8, IMAGE, 50], [b, a]),
        ([3, 4, 5, 6] * 3, [])]
    processor = llm.engine.input_processor
    # (every prompt position's log-probability checked, the image rows too: on the kv-shared
    # layers only they see the two-way attention, the text after them reads earlier layers'
    # keys; encoder_runs 2: image a once for both requests)
    expanded = check_images_against_hf(
        llm, hf, prompts, lambda ids, items, images: _hf_inputs(ids, items), encoder_runs=2,
        atol=1e-3)
    counts = []
    for ids, items in expanded:
        for item in items:
            assert ids[item.offset - 1] == BOI and ids[item.offset + item.length] == EOI
            assert item.bidirectional
        counts += [item.length for item in items]
    assert len(set(counts)) > 1  # (aspect ratios: different soft-token counts)
    assert cuts  # a step would have ended inside an image: it ended before it
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    # (the model is one where the two-way attention changes the logits)
    ids, items = processor.process(prompts[0][0], {"image": [a]})
    inputs = _hf_inputs(ids, items)
    with torch.no_grad():
        both = hf(torch.tensor([ids]), **inputs).logits
        inputs.pop("mm_token_type_ids")
        causal = hf(torch.tensor([ids]), **inputs).logits
    assert (both - causal).abs().max() > 1e-3

    with pytest.raises(ValueError, match=r"multi_modal_data\.video: "):  # (no <|video|>)
        llm.generate([{"prompt_token_ids": [5, IMAGE], "multi_modal_data": {"video": [a]}}],
                     params, use_tqdm=False)
    clip = (torch.randn(4000).numpy(), 16000)  # (this checkpoint has no audio tower)
    with pytest.raises(ValueError, match=r"multi_modal_data.audio: the checkpoint has no "
                                         "audio_config"):
        llm.generate([{"prompt_token_ids": [5, 124], "multi_modal_data": {"audio": clip}}],
                     params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_bench_multimodal_runs(tmp_path: Path) -> None:
    """``mrv2 bench multimodal`` on the tiny Gemma 4 (CPU): every row reported."""
    from mrv2.bench.multimodal import bench
    from mrv2.entrypoints.cli import build_parser

    _checkpoint(tmp_path)
    args = build_parser().parse_args([
        "bench", "multimodal", "--model", str(tmp_path), "--device", "cpu", "--dtype",
        "float32", "--load-format", "auto", "--batch-sizes", "1", "2", "--image-size", "40",
        "--prompt-len", "6", "--new-tokens", "3", "--max-model-len", "256"])
    results = bench(args)
    assert results["encoder_ms_per_image"] > 0
    assert [r["batch"] for r in results["with_image"]] == [1, 2]
    assert all(r["images_per_s"] > 0 and r["tpot_ms"] > 0 for r in results["with_image"])
