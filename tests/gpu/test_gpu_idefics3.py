"""GPU: Idefics3 and SmolVLM with images (the SigLIP-style tower over each image's tiles, the
pixel-shuffle connector, a Llama decoder; the row/column tile layout) through the engine with
CUDA graphs and the Triton kernels: fp32 greedy tokens and prompt log-probabilities are HF's
with graphs on and off, images split across chunked-prefill steps; in bf16 (the checkpoint
saved in bf16; Idefics3's 6-bucket position table, where bf16 repeats buckets as HF does)
every prompt position's log-probability is near HF's bf16 model's, every greedy token is HF's
best or a near tie of it with HF fed the engine's own tokens (``check_greedy_up_to_ties``), and
graphs on and off agree. HF is fed the engine's own tiles (the image processor is
checked against HF's on the CPU), so torchvision's and PIL's resizing can't differ here.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import check_greedy_up_to_ties

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
#: bf16 bounds against HF's bf16 model, two bf16 computations that round apart (on the CPU HF's
#: bf16 model is 1.5 off its own fp32 self at worst, 0.24 on average, on these prompt
#: log-probabilities; the engine's bf16 0.19 / 0.03 off HF's bf16): a greedy token at most this
#: far below HF's best where HF is fed the engine's tokens (the CPU saw 0.125 where they part, an
#: H100 0.281 at SmolVLM's twelfth token: the bound is the prompt positions' own, a choice
#: between two log-probabilities each as far off as a prompt position may be) ...
BF16_TIE = 0.4
#: ... and a prompt log-probability at most this far off (an H100 saw 0.27 at one of 202
#: positions); the mean bound, 0.05, is what a wrong position or layer would break.
BF16_MAX = 0.4
SPECIAL = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           *(f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)))
#: arch -> (config class, vision overrides, scale_factor, image processor, sizes, image_seq_len)
ARCHS: dict[str, tuple[Any, dict[str, Any], int, Any, dict[str, Any], int]] = {
    "idefics3": (transformers.Idefics3Config, {"image_size": 24}, 2, Idefics3ImageProcessorPil,
                 {"size": {"longest_edge": 72}, "max_image_size": {"longest_edge": 24}}, 9),
    "smolvlm": (transformers.SmolVLMConfig, {"image_size": 32}, 4, SmolVLMImageProcessorPil,
                {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}, 4),
}


def _checkpoint(path: Path, arch: str, dtype: torch.dtype) -> tuple[Any, int]:
    """A tiny checkpoint of ``arch`` saved in ``dtype`` (HF's model on CUDA in that dtype) and
    the ``<image>`` id."""
    cls, vision, scale, processor_cls, sizes, seq = ARCHS[arch]
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=SPECIAL)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    image = int(tokenizer.convert_tokens_to_ids("<image>"))
    config = cls(
        text_config={"model_type": "llama", "vocab_size": len(tokenizer) + 8,
                     "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 2048},
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                       "num_attention_heads": 2, "patch_size": 4, **vision},
        scale_factor=scale, image_token_id=image, tie_word_embeddings=arch == "smolvlm",
        pad_token_id=None)
    name = ("SmolVLMForConditionalGeneration" if arch == "smolvlm"
            else "Idefics3ForConditionalGeneration")
    config.architectures = [name]
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    redraw_weights(hf)
    hf = hf.to(dtype)
    hf.save_pretrained(path)
    processor_cls(**sizes).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": seq}))
    return hf.cuda(), image


def _pixels(hf: Any, items: list[Any]) -> dict[str, Any]:
    """HF's image input on CUDA: the engine's tiles of the prompt's images, in order."""
    if not items:
        return {}
    tiles = torch.cat([item.data["pixel_values"] for item in items])
    return {"pixel_values": tiles[None].to("cuda", hf.dtype)}


def _requests(image: int) -> list[dict[str, Any]]:
    a, b = random_image(80, 40, seed=1), random_image(32, 32, seed=2)
    return [
        {"prompt_token_ids": [5, 17, image, 9, 3, image, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [image, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1 + i % 200 for i in range(97)]}]


def _run(path: Path, dtype: str, eager: bool, image: int, hf: Any
         ) -> tuple[list[list[int]], list[list[int]], Any, list[tuple[list[int], Any]]]:
    """The engine's greedy tokens, HF's (same prompts, expanded by the engine), the
    engine's prompt logprobs of the first request with HF's log-softmax beside them, and
    per request its expanded ids with HF's log-softmax over any ids after that prompt."""
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
    requests = _requests(image)
    expected = []
    expanded = []
    for request in requests:
        images = request.get("multi_modal_data", {}).get("image", [])
        ids, items = llm.engine.input_processor.process(request["prompt_token_ids"],
                                                        {"image": images})
        expanded.append((ids, items))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"),
                              attention_mask=torch.ones(1, len(ids), device="cuda"),
                              max_new_tokens=MAX_TOKENS, do_sample=False, **_pixels(hf, items))
        expected.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    lp = llm.generate([requests[0]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)[0].prompt_logprobs
    llm.shutdown()
    ids, items = expanded[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device="cuda"), **_pixels(hf, items)).logits[0]
    want = torch.log_softmax(logits.float(), dim=-1)
    assert lp is not None and len(lp) == len(ids)
    pairs = [(lp[pos][ids[pos]].logprob, float(want[pos - 1, ids[pos]]))
             for pos in range(1, len(ids))]
    return got, expected, pairs, [(ids, _logprobs(hf, items)) for ids, items in expanded]


def _logprobs(hf: Any, items: list[Any]) -> Any:
    """HF's log-softmax over a sequence of token ids, with the image tiles of ``items``."""
    def run(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([seq], device="cuda"), **_pixels(hf, items)).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)
    return run


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_idefics3_images_fp32_graphs(tmp_path: Path, arch: str) -> None:
    hf, image = _checkpoint(tmp_path, arch, torch.float32)
    hf.generation_config.eos_token_id = None
    for eager in (False, True):
        got, expected, pairs, _ = _run(tmp_path, "float32", eager, image, hf)
        assert got == expected, eager
        for mine, theirs in pairs:
            assert mine == pytest.approx(theirs, abs=2e-3)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_idefics3_images_bf16_parity(tmp_path: Path, arch: str) -> None:
    hf, image = _checkpoint(tmp_path, arch, torch.bfloat16)
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
