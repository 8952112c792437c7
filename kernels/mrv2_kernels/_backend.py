"""Backend selection shared by every kernel module.

Each op in :mod:`mrv2_kernels` has a plain-torch reference (``*_ref``) and a Triton
implementation (``*_triton``); the public dispatcher picks one with :func:`use_triton`.
Block sizes are ordinary function arguments whose defaults depend on the backend
(:func:`default_block`): small tiles under the CPU interpreter, where every program is
executed by Python, and larger ones on the GPU. Nothing here autotunes.

Integer kernel arguments that change from step to step (row counts, split counts) are listed
in ``do_not_specialize``: Triton otherwise compiles a new variant the first time such a value
is 1 or a multiple of 16, which would stall serving for a compile at an arbitrary step.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["ENV_VAR", "LOG2E", "LOG2E_C", "MAX_GRID_YZ", "M_INIT", "PDL_EARLY_META_ENV_VAR",
           "PDL_EARLY_WEIGHTS_ENV_VAR", "PDL_ENV_VAR", "arrival_counters", "cdiv",
           "cuda_event_ms", "default_block", "flat_query_tile", "last_to_arrive", "next_power_of_2",
           "online_softmax_step", "pdl", "pdl_early_meta", "pdl_early_weights", "pdl_enabled",
           "pdl_release", "pdl_wait", "sm_count", "softmax_rescale", "triton_forced",
           "use_triton"]


_COUNTERS: dict[str, torch.Tensor] = {}


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """At least ``needed`` zeroed int32 arrival counters on ``device`` for a split-K launch
    whose last program to finish each output tile sums the partials and resets that tile's
    counter to zero (so they are zero again between launches; the launches of one stream run
    one after the other, and a PDL launch touches them only after its wait). Shared by every
    such kernel. Allocated outside CUDA-graph capture only (a graph's warm-up forward does
    it); None (reduce another way) if a capture finds none big enough."""
    key = str(device)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def cuda_event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of ``fn()`` on the current CUDA stream between two timing events (waits for
    the second): the one device timer of the benches and the runner's graph probe."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return float(start.elapsed_time(stop))


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The multiprocessor count of CUDA ``device`` (the current one when it names no index),
    read once per device: the kernels' split and warp plans ask on every launch."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers, for launch grids and plans. (``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: ~5-6 µs a call from
    Python against ~0.1 µs here, and the kernel wrappers call them on every launch of an eager
    step.)"""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ``>= n`` for ``n >= 1`` (0 for 0), as
    ``triton.next_power_of_2`` but a plain function (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


#: log2(e): the attention kernels run their online softmax in base 2 (scores scaled by it);
#: ``LOG2E_C`` for kernels.
LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)
#: Finite "minus infinity" for the attention kernels' running maxima (rows that see no key stay
#: NaN-free); a constexpr because compiled kernels may only read constexpr globals.
M_INIT = tl.constexpr(-1.0e30)
#: The most blocks a CUDA grid's y or z axis holds (x: 2**31 - 1): grids that put a tile axis
#: there (the attention kernels' ``tiles_last``) keep it on x past this.
MAX_GRID_YZ = 65535


#: Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when this module was
#: imported, as the tests' conftest sets it): a constexpr the kernels can branch on.
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
#: float8 e4m3 (``fn``: no infinities), the fp8 of the weight GEMMs and of fp8 KV caches, and
#: its largest finite value (what they saturate to); ``FP8_MAX_C`` for kernels.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit
def round_e4m3(v: tl.tensor) -> tl.tensor:
    """Triton helper: ``v`` (fp32, ``|v| <= 448``) rounded to the nearest e4m3 value (ties to
    even), in fp32 arithmetic: the spacing is ``2^(e - 3)`` for ``|v|`` in ``[2^e, 2^(e+1))``,
    ``2^-9`` below ``2^-6`` (subnormals); ``v / spacing`` is exact and adding and removing
    ``1.5 * 2^23`` rounds it to an integer; a negative ``v`` that rounds to zero keeps its sign
    (-0, as a cast does). The result converts to fp8 exactly, also under the interpreter, whose
    own fp32 -> fp8 conversion rounds wrongly (a carry out of the mantissa is dropped,
    subnormals are truncated)."""
    exp = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exp = tl.maximum(exp, 121)  # 2^-6: the smallest normal e4m3
    spacing = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    y = v / spacing
    y = (y + 12582912.0) - 12582912.0
    r = y * spacing
    return tl.where(v < 0, -tl.abs(r), r)


@triton.jit
def kv_store_cast(x: tl.tensor, cache_ptr: tl.tensor) -> tl.tensor:
    """Triton helper: ``x`` as the element type of the KV cache ``cache_ptr`` points into. An
    fp8 (e4m3) cache gets ``x`` saturated to :data:`FP8_MAX` and rounded to nearest even
    (per-tensor scale 1.0), what :func:`mrv2_kernels.kv_cache.to_cache_dtype` does in torch,
    bit for bit; any other cache a plain cast."""
    dtype: tl.constexpr = cache_ptr.dtype.element_ty
    if dtype == tl.float8e4nv:
        y = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX_C), FP8_MAX_C)
        if INTERPRETER:  # its own conversion rounds wrongly: round first (then it is exact)
            y = round_e4m3(y)
        return y.to(dtype)  # on the GPU cvt.rn.satfinite: to nearest even
    else:
        return x.to(dtype)


@triton.jit
def softmax_rescale(s: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, qk_scale: tl.tensor,
                    keep: tl.tensor, MASKED: tl.constexpr) -> Any:
    """Triton helper: the online-softmax update of a tile of raw scores ``s`` ``[BLOCK_M,
    BLOCK_N]`` in base 2 (``qk_scale`` includes :data:`LOG2E`; ``keep`` masks when
    ``MASKED``): returns ``(p, alpha, m, l)``, the tile's probabilities against the new running
    max ``m``, the factor that rescales what was accumulated so far, and the new running sum.
    Shared by :func:`online_softmax_step` and the MLA kernel, which differ in how they
    accumulate ``p``'s value product."""
    s = s * qk_scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def online_softmax_step(q: tl.tensor, k: tl.tensor, v: tl.tensor, acc: tl.tensor,
                        m_i: tl.tensor, l_i: tl.tensor, qk_scale: tl.tensor, keep: tl.tensor,
                        MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
                        FP32_PRECISION: tl.constexpr, CAP: tl.constexpr = 0.0) -> Any:
    """Triton helper: one online-softmax step of the paged and the TMA prefill attention over
    a key tile, in base 2 (``qk_scale`` includes :data:`LOG2E`). ``keep`` ``[BLOCK_M,
    BLOCK_N]`` (or broadcastable) says which scores count when ``MASKED``. Returns ``(acc,
    m, l)``; the value product accumulates into the rescaled ``acc`` inside the dot (on the
    H200 that beat adding a separate product: prefill 249 -> 254 TFLOP/s on Qwen3-8B heads,
    the throughput workload's decode attention 2,054 -> 2,018 µs, BENCHMARKS.md 2026-12-02).
    ``CAP`` > 0: logit soft-capping (Gemma 2), ``cap * tanh(score / cap)`` of the scaled scores,
    given as ``cap / scale`` (the raw dot's units: ``CAP * tanh(qk / CAP)``)."""
    if DOT_FP32:
        qk = tl.dot(q, tl.trans(k), input_precision=FP32_PRECISION)
    else:
        qk = tl.dot(q, tl.trans(k))
    if CAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow
        qk = CAP * (1.0 - 2.0 / (tl.exp(2.0 * qk / CAP) + 1.0))
    p, alpha, m_new, l_i = softmax_rescale(qk, m_i, l_i, qk_scale, keep, MASKED)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v, acc, input_precision=FP32_PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i

@triton.jit
def flat_query_tile(qsl_ptr: tl.tensor, num_reqs: tl.tensor, t: tl.tensor,
                    BLOCK_Q: tl.constexpr, REQ_BLOCK: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """Triton helper of the attention kernels' flat grids (programs over a step's query tiles,
    not query-tile bound x requests): ``(request, query tile)`` of flat tile index ``t``.
    Request ``i``'s tiles are numbered from ``start_i = query_start_loc[i] // BLOCK_Q + i``,
    strictly increasing in ``i`` (a gap of at most one tile after each request), so the request
    is the last ``i`` with ``start_i <= t``: counted over ``REQ_BLOCK`` requests per load (one
    memory round trip for up to ``REQ_BLOCK`` requests, where a binary search would chain
    ~log2 of them). Tiles past a request's queries are the caller's to skip."""
    count = tl.full([], 0, tl.int32)
    start = tl.full([], 0, tl.int32)
    for c in range(0, num_reqs, REQ_BLOCK):
        i = c + tl.arange(0, REQ_BLOCK)
        ok = i < num_reqs
        first = tl.load(qsl_ptr + i, mask=ok, other=0) // BLOCK_Q + i
        seen = ok & (first <= t)
        count += tl.sum(seen.to(tl.int32), axis=0)
        start = tl.maximum(start, tl.max(tl.where(seen, first, 0), axis=0))
    return count - 1, t - start



#: Environment variable that forces the Triton path for CPU tensors (``MRV2_KERNELS=triton``),
#: which only works together with ``TRITON_INTERPRET=1``.
ENV_VAR = "MRV2_KERNELS"


def triton_forced() -> bool:
    """Return True when ``MRV2_KERNELS=triton`` asks for Triton kernels on CPU tensors."""
    return os.environ.get(ENV_VAR, "").strip().lower() == "triton"


def use_triton(t: torch.Tensor) -> bool:
    """Return True when the op on ``t`` should run the Triton kernel.

    That is the case for CUDA tensors, and for CPU tensors when ``MRV2_KERNELS=triton``
    (Triton's interpreter, ``TRITON_INTERPRET=1``, then executes the kernel). Reads only
    tensor metadata and the environment: never synchronizes with the device.
    """
    return bool(t.is_cuda) or triton_forced()


def default_block(t: torch.Tensor, cuda: int, cpu: int, block: int | None = None) -> int:
    """Pick a tile size: ``block`` if given, else ``cuda`` for CUDA tensors and ``cpu`` otherwise.

    The result must be a power of two (Triton's ``tl.arange`` requirement); a ValueError
    says so otherwise.
    """
    value = block if block is not None else (cuda if t.is_cuda else cpu)
    if value <= 0 or value & (value - 1):
        raise ValueError(f"block size must be a positive power of two, got {value}")
    return value


#: ``MRV2_PDL=0`` turns programmatic dependent launch off (on by default where supported).
PDL_ENV_VAR = "MRV2_PDL"
#: Environment variable: ``1`` / ``0`` turns early weight loads (:func:`pdl_early_weights`)
#: on / off in every kernel that supports them, overriding each kernel's default. Measured on
#: the H200 (BENCHMARKS.md, 2026-12-01): in the norm + GEMV kernel of batch-1/2 decode they
#: pay (on by default: Qwen3-0.6B's per-product device time 4.42 -> 3.59 µs for norm + qkv,
#: 2.64 -> 1.85 µs for o_proj, in a graph); in the skinny split-K kernel (then of batch
#: 3-16) they cost (off by default: batch-8 decode step 1.236 -> 1.377 ms; its first tile is
#: loaded outside its pipelined loop).
PDL_EARLY_WEIGHTS_ENV_VAR = "MRV2_PDL_EARLY_WEIGHTS"
#: Environment variable: ``1`` turns early metadata loads (:func:`pdl_early_meta`) on in the
#: kernels that support them (the rotary and paged-attention kernels), ``0`` off. Built
#: 2026-12-01 without a GPU to measure it: off by default until an H200 A/B says otherwise.
PDL_EARLY_META_ENV_VAR = "MRV2_PDL_EARLY_META"


@functools.lru_cache(maxsize=8)
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """True when kernels on ``t``'s device use programmatic dependent launch: a CUDA device of
    compute capability 9.0 or more (Hopper: ``griddepcontrol``) and ``MRV2_PDL`` not ``0``."""
    if not t.is_cuda or os.environ.get(PDL_ENV_VAR, "1").strip() == "0":
        return False
    return _pdl_capable(t.device)


def pdl(t: torch.Tensor) -> dict[str, Any]:
    """Launch keywords of a kernel that takes a ``PDL: tl.constexpr`` and starts with
    :func:`pdl_prologue`: ``{"PDL": True, "launch_pdl": True}`` where :func:`pdl_enabled`,
    else ``{"PDL": False}``.

    With programmatic dependent launch a kernel is launched while the previous one in the
    stream still runs (``launch_pdl``); each of its programs first waits for that kernel's
    completion and memory (``gdc_wait``), so nothing it reads or writes can race, and then
    lets the next kernel launch (``gdc_launch_dependents``). What overlaps is the launch and
    the programs' start-up, which at batch 1 is a large share of each small decode kernel.
    A kernel launched the ordinary way after one of these waits for it to finish, as usual;
    inside CUDA graphs the launches become programmatic edges."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(t) else {"PDL": False}


def pdl_early_weights(t: torch.Tensor, default: bool = False) -> bool:
    """Whether a PDL kernel on ``t``'s device loads its weights before ``gdc_wait``
    (:func:`pdl_release` first, then the weight loads, then :func:`pdl_wait`): the weights are
    parameters no kernel writes, so their loads may overlap the previous kernel's tail. Needs
    :func:`pdl_enabled`; then ``MRV2_PDL_EARLY_WEIGHTS`` (``1`` / ``0``) if set, else the
    calling kernel's ``default``."""
    return _pdl_option(t, PDL_EARLY_WEIGHTS_ENV_VAR, default)


def pdl_early_meta(t: torch.Tensor, default: bool = False) -> bool:
    """Whether a PDL kernel on ``t``'s device loads the step's metadata (positions, slots,
    ``query_start_loc``, ``seq_lens``) and constant tables (cos/sin) before ``gdc_wait``.

    Safe by a rule of the whole chain: **no kernel launched with PDL writes step metadata**.
    Only the step's input-preparation kernels (and plain torch ops) write it, and they launch
    the ordinary way, so they have completed before any PDL kernel after them can start (a
    PDL kernel may start while its predecessor, and that one's predecessor if it released
    early, still run: never while a non-PDL kernel before them does). Needs
    :func:`pdl_enabled`; then ``MRV2_PDL_EARLY_META`` (``1`` / ``0``) if set, else
    ``default``."""
    return _pdl_option(t, PDL_EARLY_META_ENV_VAR, default)


def _pdl_option(t: torch.Tensor, env_var: str, default: bool) -> bool:
    """An option of PDL kernels: off without :func:`pdl_enabled`; else ``env_var`` (``1`` /
    ``0``) if set, else ``default``."""
    if not pdl_enabled(t):
        return False
    env = os.environ.get(env_var, "").strip()
    return env == "1" if env in ("0", "1") else default


@triton.jit
def last_to_arrive(counter_ptr: tl.tensor, num_arrivals: tl.tensor) -> tl.tensor:
    """A split-K program's arrival at its output tile's counter (one of
    :func:`arrival_counters`), once it has stored its fp32 partial: True in the last of the
    tile's ``num_arrivals`` programs, which then sees every partial (read them with
    ``cache_modifier=".cg"``) and has reset the counter to zero for the next launch."""
    tl.debug_barrier()  # every thread's partial is stored before the release
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == num_arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def pdl_release(PDL: tl.constexpr) -> None:
    """Let the next kernel launch (its own programs still wait for this one's completion
    before they touch anything this one writes)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr) -> None:
    """Wait for the previous kernel's completion and memory. Every program runs it before
    any load of activations, store or early exit."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_prologue(PDL: tl.constexpr) -> None:
    """First statement of a kernel launched with :func:`pdl`: wait for the previous kernel's
    completion and memory, then let the next kernel launch. Every program runs it before any
    load, store or early exit (a program that skipped the wait could let the grid finish
    before its predecessor and break the chain for the kernel after it)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
