"""``mrv2 bench multimodal``: requests with an image, for a vision-language model.

For each batch size, ``batch`` requests are sent together. Each carries its own random
``--image-size`` square image (distinct pixels, so no encoder-cache or prefix-cache hit)
between two halves of ``--prompt-len`` random text tokens, and asks for ``--new-tokens``
greedy tokens. The bench reports:

- TTFT, the time to the first output;
- images/s, the batch over the time until every request had its first token;
- TPOT, the time per output token after that;
- the vision encoder's time per image (device events around the model's ``embed_images``, one
  image, median of 10);
- the text-only TPOT of the same model at the same batch sizes.

With ``--text-model`` it also gives the TPOT of a text model, the comparison the VL model's
decode should match. The placeholder tokens come from the config: Gemma 3's
``boi_token_index`` (``<start_of_image>``), Gemma 4's ``image_token_id`` (with a
``boi_token_id``), else Qwen-VL's ``vision_start_token_id``,
``image_token_id``, ``vision_end_token_id``. Bundled configs: ``Qwen2.5-VL-7B``,
``Qwen3-VL-8B``, ``gemma-3-4b-it``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from mrv2.bench.latency import measure
from mrv2.bench.measure import release_engine_memory, report, resolve_model
from mrv2.config import EngineConfig
from mrv2.contract.params import RequestOutputKind, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.testing import random_image


def image_prompt(engine: LLMEngine, prompt_len: int, seed: int) -> list[int]:
    """``prompt_len`` random text tokens (below the placeholder ids) with the image
    placeholder in the middle."""
    config = engine.runner.hf_config
    rng = random.Random(seed)
    if getattr(config, "boi_token_index", None) is not None:  # Gemma 3
        marks = [int(config.boi_token_index)]
        special = [*marks, int(config.eoi_token_index), int(config.image_token_index)]
    elif getattr(config, "boi_token_id", None) is not None:  # Gemma 4: the image token
        marks = [int(config.image_token_id)]
        special = [*marks, int(config.boi_token_id), int(config.eoi_token_id)]
    else:  # Qwen-VL
        marks = [int(config.vision_start_token_id), int(config.image_token_id),
                 int(config.vision_end_token_id)]
        special = marks
    high = min(10_000, engine.runner.vocab_size, *special) - 1  # text ids below the marks
    text = [rng.randint(0, high) for _ in range(prompt_len)]
    return text[: prompt_len // 2] + marks + text[prompt_len // 2:]


def measure_images(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int,
                   image_size: int, seed: int) -> dict[str, float]:
    """TTFT, images/s and TPOT of ``batch`` requests with one image each."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # (as the server's)
    for i in range(batch):
        ids, items = engine.process_multimodal(
            image_prompt(engine, prompt_len, seed * 10_000 + i),
            {"image": random_image(image_size, image_size, seed * 10_000 + i)})
        engine.add_request(ids, params, stream=True, mm_items=items)
    start = time.perf_counter()
    first: float | None = None
    started: set[str] = set()
    all_started: float | None = None
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        if outs and first is None:
            first = now
        started.update(o.request_id for o in outs)
        if all_started is None and len(started) == batch:
            all_started = now
    end = time.perf_counter()
    assert first is not None and all_started is not None
    return {"batch": batch, "ttft_ms": round((first - start) * 1e3, 2),
            "images_per_s": round(batch / (all_started - start), 2),
            "tpot_ms": round((end - all_started) * 1e3 / (new_tokens - 1), 3)}


def encoder_ms_per_image(engine: LLMEngine, image_size: int, repeats: int = 10) -> float:
    """Median time of one image through the model state's encoder (``embed_item``: the
    pixels' copy to the device and the vision tower; device events on CUDA)."""
    _, items = engine.process_multimodal(image_prompt(engine, 2, 0),
                                         {"image": random_image(image_size, image_size, 0)})
    state: Any = engine.runner.model_state
    device = engine.runner.device
    times = []
    with torch.inference_mode():
        state.embed_item(items[0])  # warm up
        for _ in range(repeats):
            if device.type == "cuda":
                begin, done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
                state.embed_item(items[0])
                done.record()
                done.synchronize()
                times.append(begin.elapsed_time(done))
            else:
                t0 = time.perf_counter()
                state.embed_item(items[0])
                times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the image and text-only measurements (and ``--text-model``'s)."""
    kwargs = {"load_format": args.load_format, "dtype": args.dtype, "device": args.device,
              "max_model_len": args.max_model_len, "max_num_seqs": max(args.batch_sizes)}
    engine = LLMEngine(EngineConfig.from_kwargs(model=resolve_model(args.model), **kwargs))
    results: dict[str, Any] = {"model": args.model, "image_size": args.image_size,
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    measure_images(engine, 1, args.prompt_len, 8, args.image_size, seed=1)  # warm up
    results["encoder_ms_per_image"] = encoder_ms_per_image(engine, args.image_size)
    results["with_image"] = [measure_images(engine, b, args.prompt_len, args.new_tokens,
                                            args.image_size, seed=2 + i)
                             for i, b in enumerate(args.batch_sizes)]
    results["text_only"] = [measure(engine, b, args.prompt_len, args.new_tokens, seed=20 + i)
                            for i, b in enumerate(args.batch_sizes)]
    del engine
    release_engine_memory()
    if args.text_model:
        text = LLMEngine(EngineConfig.from_kwargs(model=resolve_model(args.text_model),
                                                  **kwargs))
        measure(text, 1, 16, 8, seed=1)  # warm up
        results["text_model"] = {"model": args.text_model, "rows": [
            measure(text, b, args.prompt_len, args.new_tokens, seed=20 + i)
            for i, b in enumerate(args.batch_sizes)]}
    return results


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench multimodal``."""
    p = sub.add_parser("multimodal", help="requests with an image (vision-language models)")
    p.add_argument("--model", default="Qwen2.5-VL-7B",
                   help="checkpoint dir or bundled config name (default Qwen2.5-VL-7B)")
    p.add_argument("--text-model", default=None,
                   help="also time this text model's decode, for comparison (Qwen2.5-VL-7B's "
                   "text model: the bundled Qwen2.5-7B)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--prompt-len", type=int, default=64, help="text tokens around the image")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json", default=None, help="write the results here too")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run and print the results (JSON last)."""
    report(bench(args), args.json)
    return 0
