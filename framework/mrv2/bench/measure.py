"""What a benchmark measures beside wall time: bytes a run must move (the byte floor), the
roofline (each step the longer of its bytes and its linear layers' FLOPs), GPU-busy fraction."""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mrv2.layers.embedding import LMHead, VocabEmbedding
from mrv2.layers.moe import COUNT_READS_ENV, FusedMoE
from mrv2.model_loader.build import text_config_of
from mrv2.runner.runner import Runner
from mrv2_kernels._backend import cuda_event_ms

CONFIGS = Path(__file__).parent / "configs"


def resolve_model(model: str) -> str:
    """A checkpoint directory, the name of a bundled architecture config (``Qwen3-0.6B``), or
    the default model's name (``SmolLM2-135M-Instruct``: its real checkpoint, prepared once)."""
    from mrv2.model_loader.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    bundled = CONFIGS / model
    if (bundled / "config.json").is_file():
        return str(bundled)
    if Path(model).is_dir():
        return model
    if model == DEFAULT_MODEL_NAME:
        return str(ensure_default_model())
    known = ", ".join(sorted([DEFAULT_MODEL_NAME, *(p.name for p in CONFIGS.iterdir())]))
    raise ValueError(f"{model!r} is neither a directory nor a bundled config ({known})")


def int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (argparse's error names the
    flag; ``why`` says what needs the bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, got {value}")
        return value
    return parse


def report(results: dict[str, Any] | list[Any], json_path: str | None) -> None:
    """Print ``results`` as JSON (last, so the end of a log holds them); save a copy if asked."""
    text = json.dumps(results, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), repeats)


def _median_seconds(fn: Any, repeats: int) -> float:
    """Median device seconds of ``fn()`` over ``repeats`` runs, each between CUDA events."""
    times = sorted(cuda_event_ms(fn) / 1e3 for _ in range(repeats))
    return times[len(times) // 2]


def gemm_rate(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """Dense bf16 GEMM rate in FLOP/s (an ``n`` x ``n`` x ``n`` product, median of
    ``repeats``): the compute side of :func:`roofline_seconds`, as :func:`copy_bandwidth` is
    its memory side. NaN off CUDA."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    out = a @ b
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b, out=out), repeats)


def media_encoder_params(runner: Runner) -> list[torch.nn.Parameter]:
    """The parameters of the model's media encoders (``CausalLM.media_encoders``: vision /
    audio towers and projectors), which run on media items, never in a text step."""
    modules = [getattr(runner.model, name, None)
               for name in getattr(runner.model, "media_encoders", ())]
    return [p for m in modules if isinstance(m, torch.nn.Module) for p in m.parameters()]


def linear_flops(runner: Runner) -> tuple[int, int]:
    """``(per token, per logits row)``: FLOPs of the linear layers, 2 x the weights each
    multiplies. Embedding lookups cost none; the LM head costs per logits row (a tied head
    too); a token multiplies ``num_experts_per_tok`` of each routed-expert layer's experts.
    Attention's own products (queries x keys, scores x values) are not counted, nor norms,
    nor the media encoders (:func:`media_encoder_params`)."""
    modules = list(runner.model.modules())
    experts = expert_layers(runner)
    skip = {id(p) for layer in experts for p in layer.parameters()}
    skip |= {id(p) for p in media_encoder_params(runner)}
    skip |= {id(m.weight) for m in modules if isinstance(m, VocabEmbedding | LMHead)}
    per_token = sum(p.numel() for p in runner.model.parameters()
                    if id(p) not in skip and p.dim() >= 2)
    top_k = int(getattr(text_config_of(runner.hf_config), "num_experts_per_tok", 0) or 0)
    per_token += sum(sum(p.numel() for p in layer.parameters()) * top_k // layer.num_experts
                     for layer in experts)
    per_row = sum(m.weight.numel() for m in modules if isinstance(m, LMHead))
    return 2 * per_token, 2 * per_row


#: Bench variants with quantized linear weights (random: ``--load-format dummy``), by the
#: engine keyword that sets them. The byte floor counts their own bytes (packed integers,
#: scales and zero points; fp8 and its scales).
QUANT_VARIANTS: dict[str, dict[str, Any]] = {
    "gptq_w4": {"quantization": "gptq"}, "awq_w4": {"quantization": "awq"},
    "fp8_w8": {"quantization": "fp8"}}
#: Bench variants of the parallel layout (with ``--tensor-parallel-size`` > 1): MoE layers
#: split by whole experts instead of columns.
PARALLEL_VARIANTS: dict[str, dict[str, Any]] = {
    "expert_parallel": {"enable_expert_parallel": True}}


def expert_layers(runner: Runner) -> list[FusedMoE]:
    """The model's routed-expert layers (none for a dense model)."""
    return [m for m in runner.model.modules() if isinstance(m, FusedMoE)]


def _lookup_tables(runner: Runner) -> list[torch.Tensor]:
    """The token-embedding tables a step reads only a row of per token: those that are not
    also an LM head's weight (a tied head reads the whole table every step)."""
    modules = list(runner.model.modules())
    heads = {id(m.weight) for m in modules if isinstance(m, LMHead)}
    return [m.weight for m in modules
            if isinstance(m, VocabEmbedding) and id(m.weight) not in heads]


def weight_bytes(runner: Runner) -> int:
    """Bytes of every parameter a step reads whatever its tokens: all of them but the routed
    experts' (see :func:`expert_read_bytes`), the untied embedding tables' (a row per token:
    :func:`embedding_bytes_per_token`) and the media encoders' (run per image, not per step:
    :func:`media_encoder_params`)."""
    skip = {id(p) for layer in expert_layers(runner) for p in layer.parameters()}
    skip |= {id(table) for table in _lookup_tables(runner)}
    skip |= {id(p) for p in media_encoder_params(runner)}
    return sum(p.numel() * p.element_size() for p in runner.model.parameters()
               if id(p) not in skip)


def embedding_bytes_per_token(runner: Runner) -> int:
    """Bytes a step reads for each of its tokens from the untied embedding tables: one row
    of each (a tied table counts whole in :func:`weight_bytes`, the LM head reads it)."""
    return sum(table.shape[-1] * table.element_size() for table in _lookup_tables(runner))


def expert_reads(runner: Runner) -> list[int]:
    """Each expert layer's count of distinct experts read so far (``FusedMoE.expert_reads``,
    kept when the model was built with ``MRV2_COUNT_EXPERT_READS=1``; -1 where it was not).
    Reads the device counters: call outside timed regions."""
    return [-1 if not layer.count_reads else
            0 if layer.expert_reads is None else int(layer.expert_reads)
            for layer in expert_layers(runner)]


def expert_read_bytes(runner: Runner, before: list[int], after: list[int]) -> int:
    """Routed-expert weight bytes read between two :func:`expert_reads` snapshots: per layer,
    distinct experts per step, summed over steps, times one expert's bytes."""
    layers = expert_layers(runner)
    if any(b < 0 for b in before):
        raise ValueError(f"expert reads are not counted: build the model with "
                         f"{COUNT_READS_ENV}=1")
    return sum((a - b) * layer.expert_bytes()
               for layer, a, b in zip(layers, after, before, strict=True))


def kv_bytes_per_token(runner: Runner) -> int:
    """KV-cache bytes a step reads for each token of its sequences: one token across all
    layers (whatever each layer's cache layout); with block tables of their own for sliding
    or chunked layers (:mod:`mrv2.runner.kv_tables`) table 0's layers' own bytes (its
    full-attention layers': the windows' reads, bounded, left out; a page a wider sliding
    layer shares is not all read by the global layer in it)."""
    kv = runner.kv
    dtype = kv.dtype(runner.dtype)
    return sum(kv.specs[layer].bytes_per_block(1, dtype)
               for layer, table in enumerate(kv.layout.layer_tables) if table == 0)


def state_bytes_per_request(runner: Runner) -> int:
    """Per-request state bytes across all layers (linear attention's recurrent and
    convolution states: :mod:`mrv2.contract.request_state`); a step reads and writes them
    for each of its requests. 0 for a model without."""
    return int(getattr(runner.model_state, "request_state_row_bytes", 0))


@dataclass
class StepLog:
    """Per-step counts and (on CUDA) events around each step's device work."""

    steps: list[tuple[int, int, int]] = field(default_factory=list)
    """(num_reqs, num_tokens, sum of seq_lens) of each step."""
    events: list[tuple[Any, Any]] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    """Host seconds inside ``Runner.execute`` (building and launching) of each step."""
    wait_s: float = 0.0
    """Host time spent waiting in ``AsyncStepOutput.result()``."""
    kinds: list[str] = field(default_factory=list)
    """Each step's kind: ``decode`` (every request the same query length: one token, or one
    plus its drafts) or ``mixed`` (prefill chunks in it), then ``_graph`` or ``_eager``: how
    its forward ran."""

    @property
    def cpu_execute_s(self) -> float:
        """Host time spent in ``Runner.execute`` over all steps."""
        return sum(self.host_s)


def instrument(engine: Any) -> StepLog:
    """Wrap ``engine.runner.execute`` to log counts and device events of every step."""
    log = StepLog()
    runner = engine.runner
    original = runner.execute
    cuda = runner.device.type == "cuda"

    plans: list[Any] = []
    build = runner.builder.build

    def build_and_keep(*args: Any, **kwargs: Any) -> Any:
        plans.append(build(*args, **kwargs))
        return plans[-1]

    runner.builder.build = build_and_keep

    def execute(scheduled: Any) -> Any:
        requests = engine._flight.requests
        seq = sum(requests[r].request.num_computed_tokens for r in scheduled.num_scheduled_tokens)
        log.steps.append((len(scheduled.num_scheduled_tokens),
                          scheduled.total_num_scheduled_tokens, seq))
        begin = time.perf_counter()
        log.wall.append(begin)
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        plans.clear()
        out = original(scheduled)
        if plans:
            kind = "decode" if plans[-1].batch.uniform_decode else "mixed"
            graph = plans[-1].replay_query_len or plans[-1].replay_tokens
            log.kinds.append(kind + ("_graph" if graph else "_eager"))
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            log.events.append((start, end))
        log.host_s.append(time.perf_counter() - begin)
        result = out.result

        def timed_result() -> Any:
            waited = time.perf_counter()
            value = result()
            log.wait_s += time.perf_counter() - waited
            return value

        out.result = timed_result
        return out

    runner.execute = execute
    return log


def time_host_parts(parts: dict[str, tuple[Any, str]], phases: dict[str, float]
                    ) -> Callable[[], None]:
    """Wrap each ``owner.attr`` of ``parts`` (name -> (owner, attribute)) so that its calls add
    their host seconds to ``phases[name]`` (a part nested in another counts in both); returns
    a function that puts the originals back."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in parts.values()]

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            begin = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - begin
        return wrapper

    for name, (owner, attr) in parts.items():
        setattr(owner, attr, timed(name, getattr(owner, attr)))

    def restore() -> None:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    return restore


def release_engine_memory() -> None:
    """After ``del engine``: collect its reference cycles and return its KV cache to the device,
    so the next variant's engine can size its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_bytes(log: StepLog, runner: Runner) -> list[int]:
    """Each step's bytes but the routed experts': all other weights (of an untied embedding
    table a row per token), the KV of every sequence it extends, and each request's state
    (a linear-attention model's: :func:`state_bytes_per_request`) read and written."""
    weights, per_token = weight_bytes(runner), kv_bytes_per_token(runner)
    per_input, per_req = embedding_bytes_per_token(runner), 2 * state_bytes_per_request(runner)
    return [weights + tokens * per_input + seq * per_token + reqs * per_req
            for reqs, tokens, seq in log.steps]


def floor_seconds(log: StepLog, runner: Runner, bandwidth: float, expert_bytes: int = 0) -> float:
    """The byte floor: every step reads its :func:`step_bytes`; ``expert_bytes``: the routed
    experts the steps actually read (:func:`expert_read_bytes`)."""
    return (sum(step_bytes(log, runner)) + expert_bytes) / bandwidth


def roofline_seconds(log: StepLog, runner: Runner, bandwidth: float, flop_rate: float,
                     expert_bytes: int = 0) -> float:
    """The roofline: each step takes the longer of its bytes (:func:`step_bytes`) at
    ``bandwidth`` and its linear layers' FLOPs (:func:`linear_flops`, a logits row per
    request) at ``flop_rate``; the routed experts' bytes are added for the whole run. A
    prefill step is compute-bound, so the byte floor alone under-counts it."""
    flops_token, flops_row = linear_flops(runner)
    return sum(max(nbytes / bandwidth, (tokens * flops_token + reqs * flops_row) / flop_rate)
               for nbytes, (reqs, tokens, _) in zip(step_bytes(log, runner), log.steps,
                                                    strict=True)) + expert_bytes / bandwidth


def busy_fraction(log: StepLog, decode_only: bool = True) -> float:
    """Device time inside steps over wall time of the steady decode steps (middle half). A
    step's wall time runs from its start event to the next step's (the last one's: to its
    end event), so the steps between chosen ones (prefill chunks) count in neither."""
    if not log.events:
        return float("nan")
    torch.cuda.synchronize()
    idx = [i for i, (reqs, tokens, _) in enumerate(log.steps)
           if not decode_only or reqs == tokens]
    idx = idx[len(idx) // 4 : 3 * len(idx) // 4]
    if len(idx) < 2:
        return float("nan")
    events = log.events
    busy = sum(events[i][0].elapsed_time(events[i][1]) for i in idx)
    span = sum(events[i][0].elapsed_time(events[i + 1][0] if i + 1 < len(events)
                                         else events[i][1]) for i in idx)
    return busy / span if span > 0 else float("nan")


def breakdown(log: StepLog, end: float) -> dict[str, dict[str, float]]:
    """Where the run's time went, per step kind (:attr:`StepLog.kinds`): steps, tokens,
    wall seconds (from each step's start to the next one's, the last one to ``end``: the
    ``time.perf_counter()`` at the run's end), host seconds inside ``Runner.execute``, and on
    CUDA the device seconds between events around each step's work and their share of the
    wall (``gpu_busy``)."""
    cuda = bool(log.events)
    if cuda:
        torch.cuda.synchronize()
    starts = [*log.wall[1:], end]
    out: dict[str, dict[str, float]] = {}
    for i, kind in enumerate(log.kinds):
        row = out.setdefault(kind, {"steps": 0, "tokens": 0, "wall_s": 0.0, "host_s": 0.0})
        row["steps"] += 1
        row["tokens"] += log.steps[i][1]
        row["wall_s"] += starts[i] - log.wall[i]
        row["host_s"] += log.host_s[i]
        if cuda:
            start, stop = log.events[i]
            row["device_s"] = row.get("device_s", 0.0) + start.elapsed_time(stop) / 1e3
    for row in out.values():
        row["host_ms_per_step"] = row["host_s"] * 1e3 / row["steps"]
        if cuda:
            row["gpu_busy"] = row["device_s"] / row["wall_s"] if row["wall_s"] > 0 else 0.0
        for key in ("wall_s", "host_s", "device_s", "host_ms_per_step", "gpu_busy"):
            if key in row:
                row[key] = round(row[key], 4)
    return out


def kernel_increments(intervals: list[tuple[str, float, float]]
                      ) -> tuple[dict[str, tuple[int, float]], float, float]:
    """Where a stretch of GPU time goes when kernels overlap (programmatic dependent launch
    starts a kernel before the one ahead of it ends, so kernel durations overlap and their sum
    says little): ``({name: (calls, increment)}, idle, span)`` over ``(name, start, end)``
    intervals on one stream. A kernel's increment is how far it moves the end of the GPU's
    work so far (its end past the latest end before it, 0 when it ends inside the work
    before); ``idle`` is the time no kernel ran (a start past the latest end: the host was
    late); increments and idle add up to ``span``, the first start to the last end."""
    out: dict[str, tuple[int, float]] = {}
    if not intervals:
        return out, 0.0, 0.0
    ordered = sorted(intervals, key=lambda kernel: kernel[1])
    frontier = ordered[0][1]
    idle = 0.0
    for name, start, end in ordered:
        if start > frontier:
            idle += start - frontier
            frontier = start
        calls, total = out.get(name, (0, 0.0))
        out[name] = (calls + 1, total + max(0.0, end - frontier))
        frontier = max(frontier, end)
    return out, idle, frontier - ordered[0][1]
