"""What a mixed graph's padding costs (GPU machine): builds an engine of ``--model`` (random
weights, the default mixed graphs), then times, back to back on the GPU (CUDA events, median of
``--reps``), the forward + logits of a step of ``T`` tokens run eager and the replay of each
captured mixed graph of ``T' >= T`` tokens up to ``--upto`` x T, for each ``--tokens`` T. It
prints the engine's build time and graph counts first.

Eager here means the runner's own mixed-graph body (``Runner._forward_logits_rows``) over the
dummy batch of a mixed graph of exactly ``T`` tokens (``Runner._mixed_dummy_batch``): the GPU
work of the step without the graph, with its host launches overlapped by the back-to-back runs.
A replay runs over its own capture batch (``T'`` real tokens): the linear layers' work of a
step padded to ``T'``, the attention's a little more (the padding tokens have queries).

Usage: python scripts/mixed_padding.py --model Qwen3-8B --tokens 300 1100 4200
"""

import argparse
import statistics
import time

import torch

from mrv2.bench.measure import resolve_model
from mrv2.config import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2_kernels._backend import cuda_event_ms

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen3-8B")
parser.add_argument("--tokens", type=int, nargs="+", default=[300, 1100, 4200])
parser.add_argument("--upto", type=float, default=1.5, help="graphs up to this many times T")
parser.add_argument("--reps", type=int, default=10)
args = parser.parse_args()

start = time.perf_counter()
engine = LLMEngine(EngineConfig.from_kwargs(model=resolve_model(args.model), load_format="dummy",
                                            dtype="bfloat16", max_model_len=4096))
torch.cuda.synchronize()
build_s = time.perf_counter() - start
runner = engine.runner
graphs = runner.graphs
assert graphs is not None and graphs.mixed_graphs, "no mixed graphs captured"


def gpu_ms(fn: object) -> float:
    """Median milliseconds of ``fn()`` on the GPU, run back to back."""
    times = [cuda_event_ms(fn) for _ in range(args.reps + 2)]  # type: ignore[arg-type]
    return statistics.median(times[2:])


print(f"{args.model}: engine built in {build_s:.1f} s (Triton compiles included), "
      f"{len(graphs.mixed_graphs)} mixed + {len(graphs.graphs)} decode graphs, sizes "
      f"{list(graphs.mixed_graphs)[:4]} ... {list(graphs.mixed_graphs)[-4:]}, "
      f"{runner.num_kv_blocks} KV blocks")
print(f"{'T':>6} {'run':>16} {'tokens':>7} {'ms':>8} {'x eager':>8}")
with torch.inference_mode():
    for tokens in args.tokens:
        num_reqs = min(runner.max_num_reqs, tokens)
        rows = min(tokens, num_reqs * (1 + runner.num_speculative_tokens))
        batch = runner._mixed_dummy_batch(num_reqs, tokens, rows)
        eager = gpu_ms(lambda batch=batch: runner._forward_logits_rows(batch))
        print(f"{tokens:>6} {'eager':>16} {tokens:>7} {eager:>8.3f} {1.0:>8.3f}")
        for size in graphs.mixed_graphs:
            if tokens <= size <= args.upto * tokens:
                mixed = graphs.mixed_graphs[size]  # its own dummy batch in the buffers
                runner._mixed_dummy_batch(mixed.num_reqs, size, mixed.num_rows)
                ms = gpu_ms(lambda size=size: graphs.replay_mixed(size))
                print(f"{tokens:>6} {'graph replay':>16} {size:>7} {ms:>8.3f} {ms / eager:>8.3f}")
engine.shutdown()
