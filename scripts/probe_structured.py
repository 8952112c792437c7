"""What structured outputs cost a batch: many JSON-schema requests at once, their masks filled
during the step's forward (the default) or each request waiting for its token in flight
(``late_token_masks`` off: every other step), against the same requests unconstrained.

Per mode: the batch's wall time, output tokens, engine steps, tokens a request-step (1.0: the
request sampled every step it was running), and the host time spent filling masks (llguidance)
and, with late masks, waiting inside the step for the token in flight. The unconstrained run
gives every request the token count it had constrained (``ignore_eos``), so the two runs
produce the same number of tokens.

Usage (GPU machine): ``python scripts/probe_structured.py --tokenizer DIR [--model Qwen3-0.6B]
[--requests 64] [--speculative-config JSON]``; DIR holds a Hugging Face tokenizer (the model's
vocabulary is used for the masks' width, so a smaller tokenizer stands in for a model's own).
The table prints last.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from mrv2.bench.measure import report, resolve_model
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams, StructuredOutputsParams
from mrv2.engine import engine as engine_module
from mrv2.engine.engine import LLMEngine

#: "plain": a JSON-schema request of a common shape (llguidance: ~4 us a mask on one core of
#: the CPU sandbox, 49K vocabulary); "bounded": the same with string lengths and an item
#: count, whose counted repetitions make masks ~15x dearer (~50 us median, ~400 us p90).
SCHEMAS = {
    "plain": {"type": "object", "additionalProperties": False,
              "required": ["name", "tags", "score"],
              "properties": {"name": {"type": "string"},
                             "tags": {"type": "array", "items": {"type": "string"}},
                             "score": {"type": "integer"}}},
    "bounded": {"type": "object", "additionalProperties": False,
                "required": ["name", "tags", "score"],
                "properties": {"name": {"type": "string", "maxLength": 40},
                               "tags": {"type": "array",
                                        "items": {"type": "string", "maxLength": 16},
                                        "minItems": 12, "maxItems": 12},
                               "score": {"type": "integer", "minimum": 0, "maximum": 1000}}},
}


class Timers:
    """Host seconds in the engine's mask filling (patched in for the probe: one row a
    request, or with drafts one a logits row)."""

    def __init__(self) -> None:
        self.fill = 0.0
        self.calls = 0
        self.original = engine_module.fill_bitmasks
        self.original_drafts = engine_module.fill_draft_bitmasks

    def __call__(self, guides: Any, out: Any) -> None:
        t0 = time.perf_counter()
        self.original(guides, out)
        self.fill += time.perf_counter() - t0
        self.calls += 1

    def drafts(self, guides: Any, drafts: Any, out: Any) -> None:
        t0 = time.perf_counter()
        self.original_drafts(guides, drafts, out)
        self.fill += time.perf_counter() - t0
        self.calls += 1


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
        ) -> tuple[float, int, int, list[int], float]:
    """(seconds, output tokens, steps, tokens per request, request-steps running)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done: dict[str, Any] = {}
    steps = 0
    running = 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        running += engine.scheduler.num_unfinished
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    counts = [len(done[i].outputs[0].token_ids) for i in ids]
    return seconds, sum(counts), steps, counts, running


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen3-0.6B", help="bundled config name or checkpoint")
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    ap.add_argument("--requests", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--schemas", nargs="+", choices=sorted(SCHEMAS), default=["plain", "bounded"])
    ap.add_argument("--speculative-config", default=None,
                    help='speculative decoding, as JSON: {"method": "ngram", '
                         '"num_speculative_tokens": 3} (constrained requests verify drafts)')
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cpu = not torch.cuda.is_available()
    config = EngineConfig.from_kwargs(
        model=resolve_model(args.model), tokenizer=args.tokenizer, load_format="dummy",
        dtype="float32" if cpu else "bfloat16", device="cpu" if cpu else "auto",
        max_model_len=2048, max_num_seqs=max(args.requests),
        **({"speculative_config": json.loads(args.speculative_config)}
           if args.speculative_config else {}))
    engine = LLMEngine(config)
    assert engine.tokenizer is not None
    timers = Timers()
    engine_module.fill_bitmasks = timers  # type: ignore[assignment]
    engine_module.fill_draft_bitmasks = timers.drafts  # type: ignore[assignment]
    rows: list[dict[str, Any]] = []
    for schema, n in [(schema, n) for schema in args.schemas for n in args.requests]:
        spec = StructuredOutputsParams(json=SCHEMAS[schema], disable_any_whitespace=True)
        prompts = [engine.tokenizer.encode(f"Describe item {i} as JSON.") for i in range(n)]
        guided = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                                 structured_outputs=spec) for i in range(n)]
        run(engine, prompts[:2], guided[:2])  # the grammar compiled, the tokenizer built
        counts: list[int] = []
        for mode in ("late", "wait", "free"):
            engine.scheduler.late_token_masks = mode != "wait"
            timers.fill, timers.calls = 0.0, 0
            params = guided if mode != "free" else [
                SamplingParams(temperature=0.8, seed=i, max_tokens=c, ignore_eos=True)
                for i, c in enumerate(counts)]
            seconds, tokens, steps, per_request, running = run(engine, prompts, params)
            if mode == "late":
                counts = per_request
            rows.append({
                "schema": schema, "requests": n, "mode": mode, "seconds": round(seconds, 3),
                "tokens": tokens, "tok_s": round(tokens / seconds),
                "steps": steps, "ms_per_step": round(1e3 * seconds / steps, 3),
                "tokens_per_request_step": round(tokens / running, 3),
                "fill_ms_per_step": round(1e3 * timers.fill / max(timers.calls, 1), 3),
            })
        engine.scheduler.late_token_masks = True
    report(rows, args.json)
    print(f"{'schema':>8} {'requests':>8} {'mode':>5} {'tok/s':>8} {'steps':>6} {'ms/step':>8} "
          f"{'tok/req-step':>12} {'fill ms':>8}")
    for r in rows:
        print(f"{r['schema']:>8} {r['requests']:>8} {r['mode']:>5} {r['tok_s']:>8} {r['steps']:>6} "
              f"{r['ms_per_step']:>8} {r['tokens_per_request_step']:>12} "
              f"{r['fill_ms_per_step']:>8}")


if __name__ == "__main__":
    main()
