"""What the CUDA graphs cost at start-up (GPU machine): for each ``--caps`` value of
``max_mixed_graph_tokens`` (``default``: the engine's own), builds an engine of ``--model``
(random weights) and prints the seconds to build it, the graphs captured, the KV blocks and the
GPU memory reserved after it.

Usage: python scripts/graph_startup.py [--model Qwen3-0.6B] [--caps 0 512 default]
"""

import argparse
import logging
import time

import torch

from mrv2.bench.measure import release_engine_memory, resolve_model
from mrv2.config import EngineConfig
from mrv2.engine.engine import LLMEngine

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen3-0.6B")
parser.add_argument("--caps", nargs="+", default=["0", "512", "default"])
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the measured cut's line
for cap in args.caps:
    extra = {} if cap == "default" else {"max_mixed_graph_tokens": int(cap)}
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format="dummy", dtype="bfloat16",
        max_model_len=4096, **extra))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    graphs = engine.runner.graphs
    assert graphs is not None
    print(f"{args.model} max_mixed_graph_tokens={cap}: start-up {seconds:.1f} s, "
          f"{len(graphs.mixed_graphs)} mixed + {len(graphs.graphs)} decode graphs, "
          f"{engine.runner.num_kv_blocks} KV blocks, "
          f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved", flush=True)
    engine.shutdown()
    del engine, graphs
    release_engine_memory()
