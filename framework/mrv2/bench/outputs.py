"""``mrv2 bench outputs``: the host cost of streamed requests' outputs as their answers grow,
``RequestOutputKind.CUMULATIVE`` against ``DELTA`` (what ``mrv2 serve`` asks for).

A tiny random model on the CPU (its forward is not what is measured) decodes ``--requests``
streamed requests of ``--tokens`` tokens each, ignoring EOS, once per output kind, in one
process. Timed each step: the engine making the step's outputs (``TrackedRequest.output``),
and their trip to the server's process as ``mrv2 serve`` makes it (``DeltaEncoder.encode`` in
the engine's process, the pipe's pickling both ways, ``OutputAccumulator.apply`` in the
server's). Reported per quarter of the answers' length: microseconds a step for all requests,
and per request (what grows with the length for cumulative outputs). The ratio
of the two kinds in one run is what means something on a CPU; on the H200 host the same
Python runs at about the same speed, beside a decode step of a few milliseconds.
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

from mrv2.config import EngineConfig
from mrv2.contract.params import RequestOutputKind, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.output_deltas import DeltaEncoder, OutputAccumulator
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.sampling_outputs import TrackedRequest

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)


def build_engine(requests: int, tokens: int) -> LLMEngine:
    """A tiny random Llama with a byte-level tokenizer, on the CPU, room for every request."""
    from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

    path = Path(tempfile.mkdtemp(prefix="mrv2-bench-outputs-"))
    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320,
                         max_position_embeddings=tokens + 64)
    make_tiny_tokenizer(path)
    block = 16
    blocks = requests * ((tokens + 64) // block + 2)
    return LLMEngine(EngineConfig.from_kwargs(
        model=str(path), device="cpu", dtype="float32", block_size=block,
        max_model_len=tokens + 64, num_gpu_blocks_override=blocks, max_num_seqs=requests))


def run_kind(engine: LLMEngine, kind: RequestOutputKind, requests: int, tokens: int,
             logprobs: bool) -> list[tuple[int, float, float, float]]:
    """Per step: (tokens per request so far, step seconds, seconds making outputs, seconds
    carrying them to the server's process)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            logprobs=1 if logprobs else None, output_kind=kind)
    for i in range(requests):
        engine.add_request([5 + i % 7, 6, 7, 8], params, stream=True)
    encoder, accumulator = DeltaEncoder(), OutputAccumulator()
    made = [0.0]
    make = TrackedRequest.output

    def timed(tracked: TrackedRequest) -> RequestOutput:
        start = time.perf_counter()
        out = make(tracked)
        made[0] += time.perf_counter() - start
        return out

    TrackedRequest.output = timed  # type: ignore[method-assign,assignment]
    rows: list[tuple[int, float, float, float]] = []
    done = 0
    try:
        while engine.has_unfinished():
            made[0] = 0.0
            start = time.perf_counter()
            outs = engine.step()
            stepped = time.perf_counter()
            deltas = pickle.loads(pickle.dumps([encoder.encode(o) for o in outs]))
            for delta in deltas:
                accumulator.apply(delta)
            carried = time.perf_counter() - stepped
            if outs:
                done += 1
                rows.append((done, stepped - start, made[0], carried))
    finally:
        TrackedRequest.output = make  # type: ignore[method-assign]
    return rows


def bench(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(args.requests, args.tokens)
    results: dict[str, Any] = {"requests": args.requests, "tokens": args.tokens,
                               "logprobs": args.logprobs, "kinds": {}}
    for kind in KINDS:
        run_kind(engine, kind, args.requests, min(64, args.tokens), args.logprobs)  # warm
        rows = run_kind(engine, kind, args.requests, args.tokens, args.logprobs)
        quarters = []
        for q in range(4):
            part = [r for r in rows if q * args.tokens // 4 < r[0] <= (q + 1) * args.tokens // 4]
            n = max(1, len(part))
            length = sum(r[0] for r in part) / n
            make = sum(r[2] for r in part) / n * 1e6
            carry = sum(r[3] for r in part) / n * 1e6
            quarters.append({
                "mean_tokens": round(length), "step_ms": round(sum(r[1] for r in part) / n
                                                               * 1e3, 3),
                "make_us": round(make, 1), "carry_us": round(carry, 1),
                "us_per_request": round((make + carry) / args.requests, 2)})
        results["kinds"][kind.name] = {
            "quarters": quarters,
            "total_output_s": round(sum(r[2] + r[3] for r in rows), 3),
            "total_step_s": round(sum(r[1] for r in rows), 3)}
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"{results['requests']} streamed requests of {results['tokens']} tokens"
          f"{' with logprobs=1' if results['logprobs'] else ''}, tiny model on the CPU; host "
          "time a step making the outputs (make) and carrying them to the server's process "
          "(carry), by quarter of the answers' length")
    print(f"{'kind':<11} {'tokens':>7} {'step ms':>8} {'make us':>9} {'carry us':>9} "
          f"{'us/request':>10}")
    for name, kind in results["kinds"].items():
        for q in kind["quarters"]:
            print(f"{name:<11} {q['mean_tokens']:>7} {q['step_ms']:>8.3f} {q['make_us']:>9.1f} "
                  f"{q['carry_us']:>9.1f} {q['us_per_request']:>10.2f}")
    for name, kind in results["kinds"].items():
        print(f"{name}: outputs {kind['total_output_s']} s of {kind['total_step_s']} s of steps")


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench outputs``."""
    p = sub.add_parser("outputs", help="streamed outputs' host cost: cumulative vs delta")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=2048, help="answer length of each request")
    p.add_argument("--logprobs", action="store_true", help="ask for logprobs=1 too")
    p.add_argument("--json", default=None, help="also save the results here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run and print the table."""
    results = bench(args)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0
