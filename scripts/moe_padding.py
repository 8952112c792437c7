"""What a CUDA graph's padding rows cost the routed experts (GPU machine): a Qwen3-30B-A3B MoE
layer (``mrv2_kernels.bench_moe``'s shapes) over ``T`` rows of which the first ``R`` are real,
with the padding rows routed at random (a graph's padding rows hold whatever the buffers held,
so they route anywhere), timed inside a CUDA graph over 8 distinct routings per replay (the
experts' weights from HBM): all ``T`` rows computed (the layer before ``valid_tokens``) against
the padding left out (``valid_tokens = R``, on the device). Prints µs per layer and the
distinct experts each reads.

Usage: python scripts/moe_padding.py [--cases 8:5 16:9 64:57 768:520]
"""

import argparse
import statistics

import torch

from mrv2_kernels._backend import cuda_event_ms
from mrv2_kernels.bench_moe import DTYPE, EXPERTS, HIDDEN, INTER, TOP_K
from mrv2_kernels.fused_moe import fused_moe_triton

parser = argparse.ArgumentParser()
parser.add_argument("--cases", nargs="+", default=["1:1", "8:5", "16:9", "64:57", "768:520"],
                    help="T:R, rows and real rows")
parser.add_argument("--reps", type=int, default=20)
args = parser.parse_args()
COPIES = 8
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=g) / HIDDEN**0.5).to(DTYPE)
w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=g) / INTER**0.5).to(DTYPE)


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Median µs per layer of a replay (``COPIES`` layers)."""
    times = [cuda_event_ms(graph.replay) * 1000 / COPIES for _ in range(args.reps + 3)]
    return statistics.median(times[3:])


print(f"{'T':>5} {'real':>5} {'experts all':>12} {'experts real':>13} {'all rows µs':>12} "
      f"{'padding out µs':>15} {'ratio':>6}")
for case in args.cases:
    rows, real = (int(v) for v in case.split(":"))
    xs = [torch.randn(rows, HIDDEN, device=dev, generator=g).to(DTYPE) for _ in range(COPIES)]
    routes = [torch.randn(rows, EXPERTS, device=dev, generator=g).softmax(-1).topk(TOP_K)
              for _ in range(COPIES)]
    ws = [r.values.float() for r in routes]
    ids = [r.indices.to(torch.int32) for r in routes]
    valid = torch.tensor([real], dtype=torch.int32, device=dev)
    hits_all = statistics.mean(float(i.unique().numel()) for i in ids)
    hits_real = statistics.mean(float(i[:real].unique().numel()) for i in ids)
    result = []
    for limit in (None, valid):
        def layers(limit: torch.Tensor | None = limit, xs: list[torch.Tensor] = xs,
                   ws: list[torch.Tensor] = ws, ids: list[torch.Tensor] = ids) -> None:
            for c in range(COPIES):
                fused_moe_triton(xs[c], w13, w2, ws[c], ids[c], valid_tokens=limit)

        layers()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        result.append(replay_us(graph))
    print(f"{rows:>5} {real:>5} {hits_all:>12.1f} {hits_real:>13.1f} {result[0]:>12.1f} "
          f"{result[1]:>15.1f} {result[1] / result[0]:>6.2f}")
