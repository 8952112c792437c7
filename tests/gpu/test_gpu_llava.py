"""GPU: LLaVA and LLaVA-NeXT with images (a CLIP tower and the projector in front of a Llama
decoder; NeXT: anyres tiles, unpadding, ``image_newline``) through the engine with CUDA graphs
and the Triton kernels: fp32 greedy tokens and prompt log-probabilities are HF's with graphs
on and off, images split across chunked-prefill steps; in bf16 (the checkpoint saved in bf16)
every prompt position's log-probability is near HF's bf16 model's, every greedy token is HF's
best or a near tie of it with HF fed the engine's own tokens (``check_greedy_up_to_ties``),
and graphs on and off agree.

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
from mrv2.testing_engine import check_greedy_up_to_ties

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
#: bf16 bounds against HF's bf16 model, two bf16 computations that round apart: a greedy token
#: at most this far below HF's best where HF is fed the engine's tokens (engine and HF's
#: ``generate`` part at a near tie: on the CPU at the third token of a NeXT prompt, 0.06 apart;
#: on an H100 likewise; the bound is the prompt positions' own, as in the Idefics3 test) ...
BF16_TIE = 0.4
#: ... and a prompt log-probability at most this far off; the mean bound, 0.05, is what a wrong
#: position or layer would break (Idefics3's bf16 test saw 0.27 at worst on an H100).
BF16_MAX = 0.4


PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]


def _checkpoint(path: Path, dtype: torch.dtype, anyres: bool = False) -> tuple[Any, Any, int]:
    """A tiny LLaVA-1.5 (``anyres``: LLaVA-NeXT) saved in ``dtype`` (HF's model on CUDA in
    that dtype), its image processor, and the ``<image>`` id."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=("<image>",))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    image = int(tokenizer.convert_tokens_to_ids("<image>"))
    kind = transformers.LlavaNextConfig if anyres else transformers.LlavaConfig
    extra: dict[str, Any] = {"image_grid_pinpoints": PINPOINTS} if anyres else {}
    config = kind(
        text_config={"model_type": "llama", "vocab_size": 320, "hidden_size": 128,
                     "intermediate_size": 256, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 1024},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": 3,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 4},
        image_token_index=image, vision_feature_layer=-2, tie_word_embeddings=False, **extra)
    name = "LlavaNextForConditionalGeneration" if anyres else "LlavaForConditionalGeneration"
    config.architectures = [name]
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    redraw_weights(hf)
    hf = hf.to(dtype)
    hf.save_pretrained(path)
    processor: Any = (transformers.LlavaNextImageProcessor if anyres
                      else transformers.CLIPImageProcessor)(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, **extra)
    processor.save_pretrained(path)
    return hf.cuda(), processor, image


def _pixels(hf: Any, processor: Any, images: list[Any]) -> dict[str, Any]:
    """HF's image inputs on CUDA (NeXT: with ``image_sizes``)."""
    if not images:
        return {}
    out = processor(images=images, return_tensors="pt")
    kwargs = {"pixel_values": out["pixel_values"].to("cuda", hf.dtype)}
    if "image_sizes" in out:
        kwargs["image_sizes"] = out["image_sizes"].to("cuda")
    return kwargs


def _hf_greedy(hf: Any, processor: Any, ids: list[int], images: list[Any]) -> list[int]:
    kwargs = _pixels(hf, processor, images)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids], device="cuda"),
                          attention_mask=torch.ones(1, len(ids), device="cuda"),
                          max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return [int(t) for t in out[0, len(ids):]]


def _requests(image: int) -> list[dict[str, Any]]:
    a, b = random_image(80, 40, seed=1), random_image(32, 32, seed=2)
    return [
        {"prompt_token_ids": [5, 17, image, 9, 3, image, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [image, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1 + i % 200 for i in range(97)]}]


def _run(path: Path, dtype: str, eager: bool, image: int, hf: Any, processor: Any
         ) -> tuple[list[list[int]], list[list[int]], Any, list[tuple[list[int], Any]]]:
    """The engine's greedy tokens, HF's (same prompts, expanded by the engine), the
    engine's prompt logprobs of the first request with HF's log-softmax beside them, and
    per request its expanded ids with HF's log-softmax over any ids after that prompt."""
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
    requests = _requests(image)
    expected = []
    refs = []
    for request in requests:
        images = request.get("multi_modal_data", {}).get("image", [])
        ids, _ = llm.engine.input_processor.process(request["prompt_token_ids"],
                                                    {"image": images})
        expected.append(_hf_greedy(hf, processor, ids, images))
        refs.append((ids, _logprobs(hf, processor, images)))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    first = requests[0]
    ids, _ = llm.engine.input_processor.process(first["prompt_token_ids"],
                                                first["multi_modal_data"])
    lp = llm.generate([first], SamplingParams(max_tokens=1, prompt_logprobs=0),
                      use_tqdm=False)[0].prompt_logprobs
    llm.shutdown()
    pixels = _pixels(hf, processor, first["multi_modal_data"]["image"])
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device="cuda"), **pixels).logits[0]
    want = torch.log_softmax(logits.float(), dim=-1)
    assert lp is not None and len(lp) == len(ids)
    pairs = [(lp[pos][ids[pos]].logprob, float(want[pos - 1, ids[pos]]))
             for pos in range(1, len(ids))]
    return got, expected, pairs, refs


def _logprobs(hf: Any, processor: Any, images: list[Any]) -> Any:
    """HF's log-softmax over a sequence of token ids, with ``images`` in it."""
    def run(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([seq], device="cuda"),
                        **_pixels(hf, processor, images)).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)
    return run


@pytest.mark.parametrize("anyres", [False, True], ids=["llava", "llava_next"])
def test_llava_images_fp32_graphs(tmp_path: Path, anyres: bool) -> None:
    hf, processor, image = _checkpoint(tmp_path, torch.float32, anyres)
    hf.generation_config.eos_token_id = None
    for eager in (False, True):
        got, expected, pairs, _ = _run(tmp_path, "float32", eager, image, hf, processor)
        assert got == expected, eager
        for mine, theirs in pairs:
            assert mine == pytest.approx(theirs, abs=2e-3)


@pytest.mark.parametrize("anyres", [False, True], ids=["llava", "llava_next"])
def test_llava_images_bf16_parity(tmp_path: Path, anyres: bool) -> None:
    hf, processor, image = _checkpoint(tmp_path, torch.bfloat16, anyres)
    hf.generation_config.eos_token_id = None
    runs = {}
    for eager in (False, True):
        got, _, pairs, refs = _run(tmp_path, "bfloat16", eager, image, hf, processor)
        runs[eager] = got
        for tokens, (ids, logprobs) in zip(got, refs, strict=True):
            check_greedy_up_to_ties(tokens, ids, logprobs, tol=BF16_TIE)
        err = max(abs(mine - theirs) for mine, theirs in pairs)
        mean = sum(abs(mine - theirs) for mine, theirs in pairs) / len(pairs)
        assert err < BF16_MAX and mean < 0.05, (eager, err, mean)
    assert [g[:4] for g in runs[False]] == [g[:4] for g in runs[True]]
