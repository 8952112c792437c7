"""Gemma 3 with images (``Gemma3ForConditionalGeneration``) through the engine: greedy tokens
equal HF ``generate``'s with ``pixel_values`` and ``token_type_ids`` (an image's soft tokens
attend to each other both ways) for several images a prompt, images shared between requests,
chunked prefill whose budget would end steps inside an image (cut back: the case is counted),
and the encoder and prefix caches on a second round; the processor's expansion equals what
HF's processor gives by tokenizing the expanded text (newline runs merged); bad input refused
with errors naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.engine.request import Request
from mrv2.testing import random_image
from mrv2.testing_engine import check_images_against_hf
from mrv2_gemma.testing import save_tiny_gemma3_vl
from mrv2_gemma.vl_inputs import Gemma3InputProcessor


def _hf_generate(hf: Any, ids: list[int], pixels: torch.Tensor | None, n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # (as ignore_eos)
    kwargs: dict[str, Any] = {}
    if pixels is not None:
        soft = hf.config.image_token_index
        kwargs = {"pixel_values": pixels, "token_type_ids": (torch.tensor([ids]) == soft).long()}
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                          max_new_tokens=n, do_sample=False, **kwargs)
    return [int(t) for t in out[0, len(ids):]]


def test_greedy_tokens_match_hf_with_images(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    hf = save_tiny_gemma3_vl(tmp_path, tied=False, tokenizer=True, image_processor=True)
    boi, soft = hf.config.boi_token_index, hf.config.image_token_index
    cuts: list[tuple[int, int, int]] = []
    chunk_size = Request.chunk_size

    def counted(self: Request, start: int, n: int) -> int:
        got = chunk_size(self, start, n)
        if got < n:
            cuts.append((start, n, got))
        return got

    monkeypatch.setattr(Request, "chunk_size", counted)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    a, b = random_image(40, 24, seed=1), random_image(32, 32, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, 9, boi, 100, 3], [a]), ([boi, 64, 8, boi, 250], [b, a]), ([3, 4, 5, 6], [])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    processor = llm.engine.input_processor

    def hf_inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not items:
            return {}
        return {"pixel_values": torch.stack([i.data["pixel_values"] for i in items]),
                "token_type_ids": (torch.tensor([ids]) == soft).long()}

    # (encoder_runs 2: image a once for both requests)
    expanded = check_images_against_hf(llm, hf, prompts, hf_inputs, encoder_runs=2, atol=1e-3)
    for ids, items in expanded:
        assert [ids[i.offset: i.offset + i.length] for i in items] == [[soft] * 4] * len(items)
        assert all(item.bidirectional for item in items)
    assert cuts  # a step would have ended inside an image: it ended before it

    # chat: an image part renders <start_of_image> through chat_template.json
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    content = [{"type": "text", "text": "Hello"}, {"type": "image", "image": b},
               {"type": "text", "text": "world"}]
    chat = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"} if p["type"] == "image" else p
                                      for p in content]}], add_generation_prompt=True)
    assert rendered.count(boi) == 1
    ids, items = processor.process(rendered, {"image": [b]})
    assert chat[0].outputs[0].token_ids == _hf_generate(
        hf, ids, items[0].data["pixel_values"][None], 8)

    # (the model is one where the image's two-way attention changes the logits)
    ids, items = processor.process(*prompts[0][:1], {"image": [a]})
    pixels = items[0].data["pixel_values"][None]
    with torch.no_grad():
        both = hf(torch.tensor([ids]), pixel_values=pixels,
                  token_type_ids=(torch.tensor([ids]) == soft).long()).logits
        causal = hf(torch.tensor([ids]), pixel_values=pixels).logits
    assert (both - causal).abs().max() > 1e-3


def _newline_tokenizer(path: Path) -> Any:
    """A byte-level BPE tokenizer whose newline runs are tokens of their own, merged (as
    Gemma's vocabulary holds ``"\n"`` .. ``"\n" * 31``), and whose image tokens are
    special."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    raw.train_from_iterator(["user\n\n\n\nLook at this\n\nand that\n\n\nend\n"] * 8, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def _processor(path: Path, tokenizer: Any, **extra: Any) -> Gemma3InputProcessor:
    import transformers

    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, **extra
                                         ).save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>",
                                           "<image_soft_token>"])
    hf_config = SimpleNamespace(boi_token_index=ids[0], eoi_token_index=ids[1],
                                image_token_index=ids[2], mm_tokens_per_image=3,
                                vision_config=SimpleNamespace(image_size=32))
    config = SimpleNamespace(multimodal=SimpleNamespace(limit_mm_per_prompt=4))
    return Gemma3InputProcessor(str(path), hf_config, tokenizer, config)


def test_expansion_is_hf_tokenization_of_the_expanded_text(tmp_path: Path) -> None:
    tokenizer = _newline_tokenizer(tmp_path)
    # (newline runs tokenize as a whole: "\n" then "\n\n" apart is not "\n\n\n")
    assert tokenizer.encode("\n") + tokenizer.encode("\n\n") != tokenizer.encode("\n\n\n")
    processor = _processor(tmp_path, tokenizer)
    image = random_image(32, 32, seed=0)
    full = "\n\n<start_of_image>" + "<image_soft_token>" * 3 + "<end_of_image>\n\n"
    for text in ("user\n<start_of_image>Look at this", "user\n\n<start_of_image>\n\nend",
                 "<start_of_image><start_of_image>\nand that", "<start_of_image>\n",
                 "Look<start_of_image>\n\n\n<start_of_image>end\n"):
        count = text.count("<start_of_image>")
        ids, items = processor.process(tokenizer.encode(text), {"image": [image] * count})
        assert ids == tokenizer.encode(text.replace("<start_of_image>", full)), text
        assert len(items) == count
        for item in items:
            assert ids[item.offset - 1] == processor.boi
            assert ids[item.offset + 3] == processor.eoi
            assert set(ids[item.offset: item.offset + 3]) == {processor.image_token}


def test_bad_images_are_refused(tmp_path: Path) -> None:
    """Placeholder count, kind and limit errors name the field; pan-and-scan is refused at
    start-up; a checkpoint without an image processor config serves text and refuses images,
    naming the file; an image longer than the step budget is refused when it arrives."""
    tokenizer = _newline_tokenizer(tmp_path)
    processor = _processor(tmp_path, tokenizer)
    image = random_image(8, 8, seed=0)
    boi = processor.boi
    with pytest.raises(ValueError, match=r"multi_modal_data.image: 2 images but the prompt has "
                                         r"1 image placeholders"):
        processor.process([5, boi], {"image": [image, image]})
    with pytest.raises(ValueError, match=r"unsupported keys \['video'\]"):
        processor.process([5, boi], {"video": [image]})
    with pytest.raises(ValueError, match="at most 4 per prompt"):
        processor.process([boi] * 5, {"image": [image] * 5})
    with pytest.raises(ValueError, match="do_pan_and_scan = true is not supported"):
        _processor(tmp_path, tokenizer, do_pan_and_scan=True)
    (tmp_path / "preprocessor_config.json").unlink()
    bare = _processor(tmp_path, tokenizer)
    (tmp_path / "preprocessor_config.json").unlink()
    bare = Gemma3InputProcessor(str(tmp_path), bare.hf_config, tokenizer, bare.config)
    assert bare.process([5, 6], {}) == ([5, 6], [])
    with pytest.raises(ValueError, match="multi_modal_data.image: no image processor settings"):
        bare.process([5, boi], {"image": [image]})

    checkpoint = tmp_path / "model"
    save_tiny_gemma3_vl(checkpoint, tokenizer=True, image_processor=True)
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=3)
    boi = json.loads((checkpoint / "config.json").read_text())["boi_token_index"]
    with pytest.raises(ValueError, match=r"an image of 4 tokens .* max_num_batched_tokens=3"):
        llm.generate([{"prompt_token_ids": [5, boi], "multi_modal_data": {"image": image}}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]


def test_bench_multimodal_runs(tmp_path: Path) -> None:
    """``mrv2 bench multimodal`` on the tiny Gemma 3 (CPU): every row reported, the encoder
    timed through the model state."""
    from mrv2.bench.multimodal import bench
    from mrv2.entrypoints.cli import build_parser

    save_tiny_gemma3_vl(tmp_path, tokenizer=True, image_processor=True)
    args = build_parser().parse_args([
        "bench", "multimodal", "--model", str(tmp_path), "--device", "cpu", "--dtype",
        "float32", "--load-format", "auto", "--batch-sizes", "1", "2", "--image-size", "40",
        "--prompt-len", "6", "--new-tokens", "3", "--max-model-len", "128"])
    results = bench(args)
    assert results["encoder_ms_per_image"] > 0
    assert [r["batch"] for r in results["with_image"]] == [1, 2]
    assert all(r["images_per_s"] > 0 and r["tpot_ms"] > 0 for r in results["with_image"])
