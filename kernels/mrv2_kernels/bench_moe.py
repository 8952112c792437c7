"""A Qwen3-30B-A3B MoE layer: the Triton fused MoE against the torch reference, on CUDA.

    python -m mrv2_kernels.bench_moe [--tokens 1 8 64 ...] [--profile] [--sweep] [--json PATH]

The layer: ``H = 2048``, ``I = 768``, ``E = 128`` experts, ``K = 8`` per token, bf16; routings
are softmax top-k of random logits. For each token count ``T`` it prints the distinct experts
hit, µs per layer for :func:`fused_moe_triton` and :func:`fused_moe_ref` (medians of CUDA-event
timings), the bandwidth floor (the hit experts' weights, ``3*H*I`` bf16 each, plus reading
``x`` and writing the output, at the device-to-device copy bandwidth measured on 1 GiB, read
and write counted), the fraction of that floor the kernel reaches, and TFLOP/s
(``2 * T * K * 3 * H * I`` flops).

Up to :data:`GRAPH_MAX_TOKENS` tokens (decode) the Triton layer runs inside a CUDA graph, as
the decode step does, so launch overheads are not counted, over :data:`COPIES` distinct
routings and inputs per replay so the experts' weights come from HBM rather than L2; larger
batches run eagerly, three calls back to back per timing (the host's launches overlap the
device's work). The reference (which reads the routing back to the host) runs eagerly.
``--sweep`` also times a few tile choices per ``T`` and prints them, the best last.

``--fp8 [--layer glm-4.5-air]`` times the FP8 path (block-quantized experts as the engine
holds them: per-row scales, ``block = (1, 128)``, quantized from the bf16 weights) against the
bf16 one on the same inputs, both as above, with the FP8 byte floor (the hit experts'
``3*H*I`` fp8 bytes plus their fp32 scales, ``x`` and the output in bf16) and the FP8
speed-up; the short table comes last. With ``--sweep`` it times FP8 tiles and places of the
activation quantization (``fuse_x_quant``, ``act_quant``) instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mrv2_kernels._backend import cuda_event_ms
from mrv2_kernels.fused_moe import fused_moe_ref, fused_moe_triton, moe_tiles
from mrv2_kernels.fused_moe_fp8 import expand_scales_per_row, quantize_experts_fp8

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DTYPE = torch.bfloat16
TOKENS = [1, 8, 64, 256, 2048, 8192]
#: Largest batch timed inside a CUDA graph, and the routings per graph replay.
GRAPH_MAX_TOKENS = 256
COPIES = 8


@dataclass
class Row:
    """One token count's results (µs; the floor in µs at the measured copy bandwidth)."""

    tokens: int
    experts_hit: float
    triton_us: float
    ref_us: float
    floor_us: float
    tiles: str

    @property
    def floor_fraction(self) -> float:
        return self.floor_us / self.triton_us if self.triton_us > 0 else 0.0

    @property
    def tflops(self) -> float:
        return layer_flops(self.tokens) / (self.triton_us * 1e6) if self.triton_us > 0 else 0.0


def layer_flops(tokens: int, top_k: int = TOP_K, hidden: int = HIDDEN,
                inter: int = INTER) -> int:
    """Multiply-adds times two of the gate/up and down products of ``tokens`` tokens."""
    return 2 * tokens * top_k * 3 * hidden * inter


def layer_bytes(tokens: int, experts_hit: float, hidden: int = HIDDEN, inter: int = INTER,
                itemsize: int = 2) -> float:
    """Bytes a layer must move at least: the hit experts' ``w13`` and ``w2`` once, ``x`` read
    and the output written once."""
    return experts_hit * 3 * hidden * inter * itemsize + 2 * tokens * hidden * itemsize


def floor_us(tokens: int, experts_hit: float, bandwidth: float) -> float:
    """The bandwidth floor in µs at ``bandwidth`` bytes per second."""
    return layer_bytes(tokens, experts_hit) / bandwidth * 1e6


def experts_hit(topk_ids: torch.Tensor, num_experts: int = EXPERTS) -> int:
    """Distinct experts in ``topk_ids`` (reads back to the host)."""
    hits = torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device)
    hits[topk_ids.reshape(-1).long()] = 1
    return int(hits.sum().item())


def format_table(rows: list[Row], bandwidth: float) -> str:
    """The results as a fixed-width table, the copy bandwidth on top."""
    lines = [
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (1 GiB device-to-device, read + write)",
        f"{'T':>6} {'experts':>8} {'triton µs':>10} {'ref µs':>10} {'floor µs':>9} "
        f"{'of floor':>8} {'TFLOP/s':>8}  tiles",
    ]
    for r in rows:
        lines.append(
            f"{r.tokens:>6d} {r.experts_hit:>8.1f} {r.triton_us:>10.1f} {r.ref_us:>10.1f} "
            f"{r.floor_us:>9.1f} {r.floor_fraction:>8.2f} {r.tflops:>8.1f}  {r.tiles}"
        )
    return "\n".join(lines)


def _median_events(fn: Callable[[], object], iters: int, per_call: int = 1) -> float:
    """Median µs of ``fn()`` (divided by ``per_call``) over ``iters`` CUDA-event timings."""
    return statistics.median(cuda_event_ms(fn) * 1e3 / per_call for _ in range(iters))


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting the read and the write."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    us = _median_events(lambda: dst.copy_(src), 20)
    return 2 * n / (us * 1e-6)


def _routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return weights, ids.to(torch.int32)


def _time_layer(run_all: Callable[[], None], tokens: int, copies: int) -> float:
    """µs per layer call of ``run_all`` (``copies`` calls): CUDA-graph replays up to
    :data:`GRAPH_MAX_TOKENS` tokens, else eager calls back to back."""
    run_all()  # compile and warm up
    torch.cuda.synchronize()
    if tokens <= GRAPH_MAX_TOKENS:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        graph.replay()
        return _median_events(graph.replay, 50, copies)
    reps = 3  # back to back, so the host's launches overlap the device's work

    def run_reps() -> None:
        for _ in range(reps):
            run_all()

    return _median_events(run_reps, 10 if tokens <= 2048 else 5, reps)


def bench_tokens(tokens: int, w13: torch.Tensor, w2: torch.Tensor, bandwidth: float,
                 tiles: dict[str, Any] | None = None, with_ref: bool = True) -> Row:
    """Time one token count (``tiles``: keyword overrides for :func:`fused_moe_triton`)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    graphed = tokens <= GRAPH_MAX_TOKENS
    copies = COPIES if graphed else 1
    inputs = []
    for _ in range(copies):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE, generator=gen)
        inputs.append((x, *_routing(tokens, gen)))
    hit = statistics.mean(experts_hit(ids) for _, _, ids in inputs)
    kw = tiles or {}

    def run_all() -> None:
        for x, weights, ids in inputs:
            fused_moe_triton(x, w13, w2, weights, ids, **kw)

    ours = _time_layer(run_all, tokens, copies)
    ref = 0.0
    if with_ref:
        x, weights, ids = inputs[0]
        fused_moe_ref(x, w13, w2, weights, ids)
        ref = _median_events(lambda: fused_moe_ref(x, w13, w2, weights, ids),
                             10 if tokens <= 2048 else 3)
    plan = moe_tiles(tokens, TOP_K, EXPERTS, HIDDEN, INTER, w13.device)._asdict()
    plan.update(kw)
    desc = "m{block_m} n{block_n1}/{block_n2} k{block_k1}/{block_k2} g{group_m} " \
        "w{num_warps} s{num_stages}".format(**plan) + (" fc" if plan["fused_combine"] else "")
    return Row(tokens, hit, ours, ref, floor_us(tokens, hit, bandwidth), desc)


def profile_tokens(tokens: int, w13: torch.Tensor, w2: torch.Tensor, iters: int = 20) -> str:
    """Per-kernel device µs of one Triton layer call (torch.profiler, eager launches)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE, generator=gen)
    weights, ids = _routing(tokens, gen)
    fused_moe_triton(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fused_moe_triton(x, w13, w2, weights, ids)
        torch.cuda.synchronize()
    lines = [f"T={tokens}: device µs per call"]
    total = 0.0
    for event in prof.key_averages():
        us = event.device_time_total / iters
        if us <= 0:
            continue
        total += us
        lines.append(f"  {us:9.1f}  {event.count // iters:3d}x  {event.key[:70]}")
    lines.append(f"  {total:9.1f}  total")
    return "\n".join(lines)


def _sweep_tiles(tokens: int) -> list[dict[str, Any]]:
    """A few tile choices around the default plan for ``tokens``."""
    if tokens * TOP_K / EXPERTS <= 16:
        grid = itertools.product([16], [16, 32, 64], [128, 256], [16, 32, 64], [4], [3, 4])
    elif tokens * TOP_K / EXPERTS <= 64:
        grid = itertools.product([16, 32, 64], [32, 64], [64, 128], [64, 128], [4], [4])
    else:
        grid = itertools.product([64, 128], [64, 128], [64], [128, 256], [4, 8], [3, 4])
    out = []
    for bm, bn1, bk, bn2, warps, stages in grid:
        out.append({"block_m": bm, "block_n1": bn1, "block_k1": bk, "block_n2": bn2,
                    "block_k2": bk, "num_warps": warps, "num_stages": stages})
    return out


# ------------------------------------------------------------------------------------ FP8


@dataclass(frozen=True)
class Layer:
    """A MoE layer's routed experts."""

    hidden: int
    inter: int
    experts: int
    top_k: int


LAYERS = {
    "qwen3-30b-a3b": Layer(HIDDEN, INTER, EXPERTS, TOP_K),
    "glm-4.5-air": Layer(4096, 1408, 128, 8),  # GLM-4.5-Air(-FP8)'s routed experts
}
FP8_BLOCK = (1, 128)  # the engine's per-row scales


def fp8_layer_bytes(tokens: int, experts_hit: float, layer: Layer,
                    block: tuple[int, int] = FP8_BLOCK) -> float:
    """Bytes an FP8 layer must move at least: the hit experts' fp8 ``w13`` and ``w2`` and
    their fp32 scales once, ``x`` read and the output written once (bf16)."""
    bn, bk = block
    h, i = layer.hidden, layer.inter
    scales = -(-2 * i // bn) * -(-h // bk) + -(-h // bn) * -(-i // bk)
    return experts_hit * (3 * h * i + 4 * scales) + 2 * tokens * h * 2


@dataclass
class Fp8Row:
    """One token count of ``--fp8`` (µs; the FP8 floor at the measured copy bandwidth)."""

    tokens: int
    experts_hit: float
    bf16_us: float
    fp8_us: float
    floor_us: float
    flops: float
    tiles: str

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us if self.fp8_us > 0 else 0.0

    @property
    def floor_fraction(self) -> float:
        return self.floor_us / self.fp8_us if self.fp8_us > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.flops / (self.fp8_us * 1e6) if self.fp8_us > 0 else 0.0


def format_fp8_table(rows: list[Fp8Row], bandwidth: float, layer: str) -> str:
    """The ``--fp8`` results as a fixed-width table, the layer and bandwidth on top."""
    lines = [
        f"{layer}, FP8 block (1, 128) vs bf16; copy bandwidth {bandwidth / 1e9:.0f} GB/s",
        f"{'T':>6} {'experts':>8} {'bf16 µs':>9} {'fp8 µs':>9} {'speedup':>8} "
        f"{'fp8 floor':>9} {'of floor':>8} {'TFLOP/s':>8}  tiles",
    ]
    for r in rows:
        lines.append(
            f"{r.tokens:>6d} {r.experts_hit:>8.1f} {r.bf16_us:>9.1f} {r.fp8_us:>9.1f} "
            f"{r.speedup:>8.2f} {r.floor_us:>9.1f} {r.floor_fraction:>8.2f} {r.tflops:>8.1f}"
            f"  {r.tiles}"
        )
    return "\n".join(lines)


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, Any]:
    """The experts as the engine holds a block-FP8 checkpoint: each of gate, up and down
    quantized in 128x128 blocks, the scales expanded per row (``fused_moe``'s keywords plus
    the fp8 ``w13``/``w2``)."""
    inter = w2.shape[2]

    def per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_experts_fp8(w, (128, 128))
        return q, expand_scales_per_row(scale, w.shape[1], 128)

    (gq, gs), (uq, us), (dq, ds) = per_row(w13[:, :inter]), per_row(w13[:, inter:]), per_row(w2)
    return {"w13": torch.cat([gq, uq], dim=1), "w2": dq, "w13_scale": torch.cat([gs, us], 1),
            "w2_scale": ds, "block": FP8_BLOCK}


def _tile_desc(plan: dict[str, Any]) -> str:
    desc = "m{block_m} n{block_n1}/{block_n2} k{block_k1}/{block_k2} g{group_m} " \
        "w{num_warps} s{num_stages}".format(**plan)
    desc += " fc" if plan["fused_combine"] else ""
    return desc + (" qx" if plan["fuse_x_quant"] else "") + f" act:{plan['act_quant']}"


def bench_fp8_tokens(tokens: int, layer: Layer, w13: torch.Tensor, w2: torch.Tensor,
                     fp8: dict[str, Any], bandwidth: float,
                     tiles: dict[str, Any] | None = None, with_bf16: bool = True) -> Fp8Row:
    """Time the FP8 layer (``tiles``: overrides) and the bf16 one on the same inputs."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    copies = COPIES if tokens <= GRAPH_MAX_TOKENS else 1
    inputs = []
    for _ in range(copies):
        x = torch.randn(tokens, layer.hidden, device="cuda", dtype=DTYPE, generator=gen)
        logits = torch.randn(tokens, layer.experts, device="cuda", generator=gen)
        weights, ids = logits.softmax(-1).topk(layer.top_k, dim=-1)
        inputs.append((x, weights, ids.to(torch.int32)))
    hit = statistics.mean(experts_hit(ids, layer.experts) for _, _, ids in inputs)
    kw = tiles or {}
    scales = {k: fp8[k] for k in ("w13_scale", "w2_scale", "block")}

    def run_fp8() -> None:
        for x, weights, ids in inputs:
            fused_moe_triton(x, fp8["w13"], fp8["w2"], weights, ids, **scales, **kw)

    def run_bf16() -> None:
        for x, weights, ids in inputs:
            fused_moe_triton(x, w13, w2, weights, ids)

    ours = _time_layer(run_fp8, tokens, copies)
    bf16 = _time_layer(run_bf16, tokens, copies) if with_bf16 else 0.0
    plan = moe_tiles(tokens, layer.top_k, layer.experts, layer.hidden, layer.inter,
                     w13.device, FP8_BLOCK)._asdict()
    plan.update(kw)
    floor = fp8_layer_bytes(tokens, hit, layer) / bandwidth * 1e6
    flops = layer_flops(tokens, layer.top_k, layer.hidden, layer.inter)
    return Fp8Row(tokens, hit, bf16, ours, floor, flops, _tile_desc(plan))


def _fp8_sweep_tiles(tokens: int, layer: Layer) -> list[dict[str, Any]]:
    """FP8 tile choices and quantization places around the default plan for ``tokens``."""
    out: list[dict[str, Any]] = []
    if tokens * layer.top_k / layer.experts <= 16:
        places = [(True, "down"), (False, "down"), (False, "kernel"), (True, "kernel")]
        for bn1, bn2, (fuse, act) in itertools.product([32, 64], [64, 128], places):
            out.append({"block_m": 16, "block_n1": bn1, "block_k1": 128, "block_n2": bn2,
                        "block_k2": 128, "num_warps": 4, "num_stages": 4,
                        "fuse_x_quant": fuse, "act_quant": act})
        for bn2 in (64, 128):
            out.append({"block_m": 16, "block_n1": 128, "block_k1": 128, "block_n2": bn2,
                        "block_k2": 128, "num_warps": 4, "num_stages": 4,
                        "fuse_x_quant": False, "act_quant": "epilogue"})
        return out
    for bm, (bn1, act), warps, stages in itertools.product(
            [64, 128], [(128, "epilogue"), (64, "kernel")], [4, 8], [3, 4]):
        out.append({"block_m": bm, "block_n1": bn1, "block_k1": 128, "block_n2": 128,
                    "block_k2": 128, "group_m": 8, "num_warps": warps, "num_stages": stages,
                    "fuse_x_quant": False, "act_quant": act})
    return out


def main_fp8(args: argparse.Namespace, bandwidth: float) -> None:
    """``--fp8``: the FP8 layer against the bf16 one, per token count (and ``--sweep``)."""
    layer = LAYERS[args.layer]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(layer.experts, 2 * layer.inter, layer.hidden, device="cuda",
                      dtype=DTYPE, generator=gen) / layer.hidden**0.5
    w2 = torch.randn(layer.experts, layer.hidden, layer.inter, device="cuda", dtype=DTYPE,
                     generator=gen) / layer.inter**0.5
    fp8 = fp8_experts(w13, w2)
    rows, best = [], []
    for tokens in args.tokens:
        rows.append(bench_fp8_tokens(tokens, layer, w13, w2, fp8, bandwidth))
        print(format_fp8_table(rows[-1:], bandwidth, args.layer).splitlines()[-1], flush=True)
        if args.sweep:
            results = []
            for tiles in _fp8_sweep_tiles(tokens, layer):
                try:
                    results.append(bench_fp8_tokens(tokens, layer, w13, w2, fp8, bandwidth,
                                                    tiles, False))
                except Exception as exc:  # noqa: BLE001 (out of resources: skip the tile)
                    print(f"  skip {tiles}: {type(exc).__name__}", flush=True)
                    continue
                print(f"  {results[-1].fp8_us:8.1f} µs  {results[-1].tiles}", flush=True)
            if results:
                best.append(min(results, key=lambda r: r.fp8_us))
                print(f"  best {best[-1].fp8_us:.1f} µs: {best[-1].tiles}", flush=True)
    if best:
        print("\nbest FP8 tiles of the sweep (bf16 column: the default-tile run above):")
        bf16_us = {r.tokens: r.bf16_us for r in rows}
        for b in best:
            b.bf16_us = bf16_us[b.tokens]
        print(format_fp8_table(best, bandwidth, args.layer))
    print()
    print(format_fp8_table(rows, bandwidth, args.layer))
    if args.json:
        payload = {
            "layer": {**asdict(layer), "name": args.layer, "dtype": str(DTYPE),
                      "fp8_block": list(FP8_BLOCK)},
            "device": torch.cuda.get_device_name(),
            "copy_bandwidth_gbs": bandwidth / 1e9,
            "rows": [{**asdict(r), "speedup": r.speedup, "floor_fraction": r.floor_fraction,
                      "tflops": r.tflops} for r in rows],
            "sweep_best": [{**asdict(r), "floor_fraction": r.floor_fraction,
                            "tflops": r.tflops} for r in best],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--sweep", action="store_true", help="also time other tile choices")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="also print each kernel's device time per T (torch.profiler)")
    parser.add_argument("--fp8", action="store_true",
                        help="time FP8 block-quantized experts against bf16")
    parser.add_argument("--layer", choices=sorted(LAYERS), default="qwen3-30b-a3b",
                        help="the layer of --fp8 (the bf16 table is Qwen3-30B-A3B's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA device")
    bandwidth = copy_bandwidth()
    if args.fp8:
        main_fp8(args, bandwidth)
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=DTYPE,
                      generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=DTYPE,
                     generator=gen) / INTER**0.5
    rows, best = [], []
    for tokens in args.tokens:
        rows.append(bench_tokens(tokens, w13, w2, bandwidth))
        print(format_table(rows[-1:], bandwidth).splitlines()[-1], flush=True)
        if args.profile:
            print(profile_tokens(tokens, w13, w2), flush=True)
        if args.sweep:
            results = []
            for tiles in _sweep_tiles(tokens):
                try:
                    results.append(bench_tokens(tokens, w13, w2, bandwidth, tiles, False))
                except Exception as exc:  # noqa: BLE001 (out of resources: skip the tile)
                    print(f"  skip {tiles}: {type(exc).__name__}", flush=True)
                    continue
                print(f"  {results[-1].triton_us:8.1f} µs  {results[-1].tiles}", flush=True)
            if results:
                best.append(min(results, key=lambda r: r.triton_us))
                print(f"  best {best[-1].triton_us:.1f} µs: {best[-1].tiles}", flush=True)
    print()
    print(format_table(rows, bandwidth))
    if best:
        print("\nbest tiles of the sweep:")
        print(format_table(best, bandwidth))
    if args.json:
        payload = {
            "layer": {"hidden": HIDDEN, "inter": INTER, "experts": EXPERTS, "top_k": TOP_K,
                      "dtype": str(DTYPE)},
            "device": torch.cuda.get_device_name(),
            "copy_bandwidth_gbs": bandwidth / 1e9,
            "rows": [{**asdict(r), "floor_fraction": r.floor_fraction, "tflops": r.tflops}
                     for r in rows],
            "sweep_best": [{**asdict(r), "floor_fraction": r.floor_fraction,
                            "tflops": r.tflops} for r in best],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
