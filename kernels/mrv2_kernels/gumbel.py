"""Gumbel-max sampling with a stateless, counter-based noise hash.

Sampling draws ``argmax_v(logits[n, v] + g(seed_n, pos_n, v))``, which is a sample from
``softmax(logits[n])`` when ``g`` is standard Gumbel noise. The noise is a pure function of
(request seed, absolute position, vocab index), so a seeded request samples the same tokens
whatever batch it is in, on CPU and GPU alike, and speculative decoding can reproduce the
target's noise at any position.

Compatibility contract (do not change without versioning it): all arithmetic is on unsigned
32-bit words, modulo ``2**32``.

``mix32(x)`` (Chris Wellons' "lowbias32" finalizer)::

    x ^= x >> 16;  x *= 0x7FEB352D;  x ^= x >> 15;  x *= 0x846CA68B;  x ^= x >> 16

Row key, from the int64 ``seed`` and ``position`` split into low / high words
(``lo = s & 0xFFFFFFFF``, ``hi = (s >> 32) & 0xFFFFFFFF``, two's complement)::

    key = mix32(mix32(mix32(mix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ pos_lo) ^ pos_hi)

Per vocab index ``v`` (``0 <= v < 2**31``)::

    h = mix32(mix32(key ^ v) + key)
    u = (float32(h >> 9) + 0.5) * 2**-23          # top 23 bits; every step exact in fp32
    g = -log(-log(u))                             # fp32

``u`` lies in ``[2**-24, 1 - 2**-24]`` and is bit-identical between :func:`uniform_hash_ref`
(int64 torch arithmetic masked to 32 bits) and the Triton helpers :func:`hash_row_key` /
:func:`hash_uniform`. ``g`` goes through the platform's fp32 ``log`` (on CUDA the outer
``log`` is the fast approximate one, absolute error ~1e-7) and may differ in the last bits
between backends, so sampled tokens agree except at near-exact ties. (Only 23 bits
are used because ``(h >> 8) + 0.5`` is not representable in fp32 for the largest values, and
would round to ``u == 1``.)

Greedy rows take ``argmax_v logits[n, v]`` through the same kernel. Ties resolve to the
smallest index; an all ``-inf`` row yields index 0.
"""


import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._backend import cdiv, default_block, next_power_of_2, sm_count, use_triton
from .top_k_top_p import order_key, order_keys

__all__ = [
    "divide_rows",
    "gumbel_noise_ref",
    "gumbel_sample",
    "gumbel_sample_cpu",
    "gumbel_sample_ref",
    "gumbel_sample_rows",
    "gumbel_sample_triton",
    "hash_row_key",
    "hash_uniform",
    "mix32_ref",
    "row_key_ref",
    "uniform_hash_ref",
    "uniform_hash_triton",
]

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_SEED_SALT = 0x9E3779B9
_U_SCALE = 2.0**-23


# --------------------------------------------------------------------------- torch reference


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """The ``mix32`` finalizer on int64 tensors holding unsigned 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def _words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(torch.int64)
    return x & _MASK32, (x >> 32) & _MASK32


def row_key_ref(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row hash key (int64 holding a uint32) of int64 ``seeds`` and ``positions``."""
    seed_lo, seed_hi = _words(seeds)
    pos_lo, pos_hi = _words(positions)
    key = mix32_ref(seed_lo ^ _SEED_SALT)
    key = mix32_ref(key ^ seed_hi)
    key = mix32_ref(key ^ pos_lo)
    return mix32_ref(key ^ pos_hi)


def uniform_hash_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise ``u`` of shape ``[N, vocab_size]`` (float32, in ``(0, 1)``).

    ``seeds`` and ``positions`` are ``[N]`` integer tensors; see the module docstring for
    the exact hash.
    """
    key = row_key_ref(seeds, positions).unsqueeze(1)
    v = torch.arange(vocab_size, device=key.device, dtype=torch.int64).unsqueeze(0)
    h = mix32_ref((mix32_ref(key ^ v) + key) & _MASK32)
    return ((h >> 9).to(torch.float32) + 0.5) * _U_SCALE


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of shape ``[N, vocab_size]``, float32."""
    u = uniform_hash_ref(seeds, positions, vocab_size)
    return -torch.log(-torch.log(u))


def gumbel_sample_ref(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    out: torch.Tensor,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> None:
    """Plain-torch specification of :func:`gumbel_sample` (same arguments, same effect)."""
    _check_args(logits, seeds, positions, greedy, out, temperature, threshold)
    x = logits.to(torch.float32)
    if temperature is not None:
        x = x / torch.where(greedy.view(-1) != 0, 1.0, temperature.float()).view(-1, 1)
    x = _cut(x, threshold)
    noise = gumbel_noise_ref(seeds, positions, x.shape[1])
    x = torch.where(greedy.view(-1, 1) != 0, x, x + noise)
    out.copy_(torch.argmax(x, dim=1))


def gumbel_sample_cpu(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    out: torch.Tensor,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> None:
    """The torch path of :func:`gumbel_sample` (CPU): :func:`gumbel_sample_ref`'s tokens, with
    the noise (and the temperature) computed for the non-greedy rows only. Reads ``greedy``
    on the host (a sync on a GPU)."""
    _check_args(logits, seeds, positions, greedy, out, temperature, threshold)
    sampled = (greedy.view(-1) == 0).nonzero().view(-1)
    if sampled.numel() == 0 and threshold is None:  # the argmax is the same in any dtype
        torch.argmax(logits, dim=1, out=out)
        return
    x = logits.to(torch.float32)
    tokens = torch.argmax(_cut(x, threshold), dim=1)  # the greedy rows' (never scaled)
    if sampled.numel() == 0:
        out.copy_(tokens)
        return
    xs = x.index_select(0, sampled)
    if temperature is not None:
        xs = xs / temperature.float().index_select(0, sampled).view(-1, 1)
    xs = _cut(xs, None if threshold is None else threshold.index_select(0, sampled))
    xs += gumbel_noise_ref(seeds.index_select(0, sampled), positions.index_select(0, sampled),
                           xs.shape[1])
    tokens.index_copy_(0, sampled, torch.argmax(xs, dim=1))
    out.copy_(tokens)


# --------------------------------------------------------------------------- Triton


@triton.jit
def _mix32(x: tl.tensor) -> tl.tensor:
    x ^= x >> 16
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def hash_row_key(seed: tl.tensor, position: tl.tensor) -> tl.tensor:
    """Triton helper: uint32 row key of int64 ``seed`` and ``position`` (see module doc)."""
    seed = seed.to(tl.int64)
    position = position.to(tl.int64)
    key = _mix32(seed.to(tl.uint32) ^ tl.full([], 0x9E3779B9, tl.uint32))
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32(key ^ position.to(tl.uint32))
    return _mix32(key ^ (position >> 32).to(tl.uint32))


@triton.jit
def hash_uniform(key: tl.tensor, vocab_idx: tl.tensor) -> tl.tensor:
    """Triton helper: fp32 uniform ``u`` in (0, 1) for a row key and int vocab indices."""
    h = _mix32(_mix32(key ^ vocab_idx.to(tl.uint32)) + key)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _chunk_argmax(
    row_ptr: tl.tensor,
    key: tl.tensor,
    temperature: tl.tensor,
    cut: tl.tensor,
    start: tl.tensor,
    end: tl.tensor,
    BLOCK_V: tl.constexpr,
    NOISE: tl.constexpr,
    FAST_LOG: tl.constexpr,
    SCALE: tl.constexpr,
    CUT: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    # Running (max, smallest index of the max) of logits (+ Gumbel noise) over [start, end).
    # Each lane keeps its own (max, index): its indices only grow, so a strict ``>`` keeps a
    # lane's first maximum, and one reduction at the end takes the smallest index among the
    # lanes holding the row's maximum. A lane that never beats -inf keeps index 0, so an
    # all -inf range reports 0. (A reduction per tile took 7% longer: 61.6 against 57.2 µs
    # for 128 rows of 151,936, H200.)
    offs = tl.arange(0, BLOCK_V)
    lane_val = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(start, end, BLOCK_V):
        v = v0 + offs
        mask = v < end
        x = tl.load(row_ptr + v, mask=mask, other=float("-inf")).to(tl.float32)
        if SCALE:  # IEEE division, bit-identical to torch's ``logits / temperature``
            x = tl.div_rn(x, temperature)
        if CUT:  # top-k / top-p: keep the values whose order key reaches the row's threshold
            x = tl.where(order_key(x).to(tl.int64) >= cut, x, float("-inf"))
        if NOISE:
            # The inner log needs full precision (u near 1 makes the largest noise values);
            # the outer one only needs small absolute error, which the fast log gives.
            e = -tl.log(hash_uniform(key, v))
            if FAST_LOG:  # noqa: SIM108 (constexpr branch: only one side is compiled)
                x = x - libdevice.fast_logf(e)
            else:
                x = x - tl.log(e)
        better = x > lane_val
        lane_idx = tl.where(better, v, lane_idx)
        lane_val = tl.where(better, x, lane_val)
    best_val = tl.max(lane_val, axis=0)
    best_idx = tl.min(tl.where(lane_val == best_val, lane_idx, 2147483647), axis=0)
    return best_val, best_idx


@triton.jit(do_not_specialize=["chunk", "num_splits"])
def _gumbel_sample_kernel(
    logits_ptr: tl.tensor,
    logits_stride: int,
    vocab_size: int,
    seeds_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    greedy_ptr: tl.tensor,
    temperature_ptr: tl.tensor,
    cut_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_val_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    chunk: int,
    num_splits: int,
    rows_ptr: tl.tensor,
    greedy_eps: float,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
    FAST_LOG: tl.constexpr,
    TEMPERATURE: tl.constexpr,
    CUT: tl.constexpr,
    ROWS: tl.constexpr = False,
) -> None:
    # Program (row, split) scans vocab [split * chunk, (split + 1) * chunk). Without SPLIT
    # (one split) it writes the token; with SPLIT it writes a partial (max, index).
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab_size)
    row_ptr = logits_ptr + row * logits_stride
    cut = tl.full([], 0, tl.int64)
    if CUT:
        cut = tl.load(cut_ptr + row)
    if ROWS:  # per-request tables: the row's request, its temperature (greedy below eps)
        req = tl.load(rows_ptr + row).to(tl.int64)
        temperature = tl.load(temperature_ptr + req).to(tl.float32)
        greedy = temperature < greedy_eps
    else:
        req = row
        temperature = tl.full([], 1.0, tl.float32)
        if TEMPERATURE:
            temperature = tl.load(temperature_ptr + row).to(tl.float32)
        greedy = tl.load(greedy_ptr + row) != 0
    if greedy:
        best_val, best_idx = _chunk_argmax(row_ptr, 0, 1.0, cut, start, end, BLOCK_V, False,
                                           False, False, CUT)
    else:
        key = hash_row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + row))
        best_val, best_idx = _chunk_argmax(row_ptr, key, temperature, cut, start, end, BLOCK_V,
                                           True, FAST_LOG, TEMPERATURE, CUT)
    if SPLIT:
        tl.store(part_val_ptr + row * num_splits + split, best_val)
        tl.store(part_idx_ptr + row * num_splits + split, best_idx)
    else:
        tl.store(out_ptr + row, best_idx.to(tl.int64))


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_reduce_kernel(
    part_val_ptr: tl.tensor,
    part_idx_ptr: tl.tensor,
    num_splits: int,
    out_ptr: tl.tensor,
    BLOCK_S: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    mask = s < num_splits
    vals = tl.load(part_val_ptr + row * num_splits + s, mask=mask, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + row * num_splits + s, mask=mask, other=0)
    best = tl.max(vals, axis=0)
    # Every split's index is global and all-(-inf) splits report 0, so the smallest index
    # among the maxima is the smallest index of the row's maximum (0 for an all -inf row).
    idx = tl.min(tl.where(mask & (vals == best), idxs, 2147483647), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit
def _uniform_hash_kernel(
    seeds_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    out_ptr: tl.tensor,
    out_stride: int,
    vocab_size: int,
    BLOCK_V: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key = hash_row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
    tl.store(out_ptr + row * out_stride + v, hash_uniform(key, v), mask=v < vocab_size)


@triton.jit
def _divide_rows_kernel(
    x_ptr: tl.tensor,
    x_stride: int,
    out_ptr: tl.tensor,
    out_stride: int,
    vocab: int,
    div_ptr: tl.tensor,
    BLOCK_V: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = v < vocab
    d = tl.load(div_ptr + row).to(tl.float32)
    x = tl.load(x_ptr + row * x_stride + v, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * out_stride + v, tl.div_rn(x, d), mask=mask)


def _check_args(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    out: torch.Tensor,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> None:
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be 2-D with contiguous rows, got {tuple(logits.shape)}")
    n = logits.shape[0]
    named = [("seeds", seeds), ("positions", positions), ("greedy", greedy), ("out", out)]
    if temperature is not None:
        named.append(("temperature", temperature))
    if threshold is not None:
        named.append(("threshold", threshold))
    for name, t in named:
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")


def gumbel_sample_triton(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    out: torch.Tensor,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    block_v: int | None = None,
    num_splits: int | None = None,
) -> None:
    """Triton implementation of :func:`gumbel_sample`.

    The vocabulary of each row is cut into ``num_splits`` chunks (default: 1 on CPU; on GPU
    enough to give every SM at least two programs and no program more than 8 tiles, at most
    one chunk per ``block_v`` tile: a long serial walk per program left HBM idle);
    program (row, chunk) walks its chunk in ``block_v`` tiles keeping a running (max, index).
    With more than one chunk, a second tiny kernel reduces the per-chunk partials, which live
    in a scratch buffer from the caching allocator. Greedy rows skip the noise. The result
    does not depend on ``block_v`` or ``num_splits``.
    """
    _check_args(logits, seeds, positions, greedy, out, temperature, threshold)
    _launch(logits, seeds, positions, greedy, out, temperature, threshold, block_v, num_splits)


def _launch(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
            greedy: torch.Tensor, out: torch.Tensor, temperature: torch.Tensor | None,
            threshold: torch.Tensor | None, block_v: int | None, num_splits: int | None,
            rows: torch.Tensor | None = None, greedy_eps: float = 0.0) -> None:
    """:func:`gumbel_sample_triton`'s launch; with ``rows``, ``seeds`` and ``temperature``
    are per-request tables (:func:`gumbel_sample_rows`) and ``greedy`` is unused."""
    n, vocab = logits.shape
    if n == 0:
        return
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    block = default_block(logits, cuda=2048, cpu=128, block=block_v)
    tiles = cdiv(vocab, block)
    if num_splits is None:  # GPU: >= 2 programs per SM, and at most 8 tiles per program
        num_splits = (max(cdiv(2 * sm_count(logits.device), n), cdiv(tiles, 8))
                      if logits.is_cuda else 1)
    chunk = cdiv(tiles, max(1, min(num_splits, tiles))) * block
    splits = cdiv(vocab, chunk)
    if greedy.dtype == torch.bool:
        greedy = greedy.view(torch.uint8)
    fast_log = bool(logits.is_cuda) and torch.version.hip is None
    part_val = part_idx = out
    if splits > 1:
        part_val = torch.empty((n, splits), dtype=torch.float32, device=logits.device)
        part_idx = torch.empty((n, splits), dtype=torch.int32, device=logits.device)
    _gumbel_sample_kernel[(n, splits)](
        logits,
        logits.stride(0),
        vocab,
        seeds,
        positions,
        greedy,
        temperature if temperature is not None else seeds,
        threshold if threshold is not None else seeds,
        out,
        part_val,
        part_idx,
        chunk,
        splits,
        rows if rows is not None else seeds,
        float(greedy_eps),
        BLOCK_V=block,
        SPLIT=splits > 1,
        FAST_LOG=fast_log,
        TEMPERATURE=temperature is not None,
        CUT=threshold is not None,
        ROWS=rows is not None,
        num_warps=8 if block >= 2048 else 4,
    )
    if splits > 1:
        _argmax_reduce_kernel[(n,)](
            part_val, part_idx, splits, out, BLOCK_S=next_power_of_2(splits)
        )


def gumbel_sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    out: torch.Tensor,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
) -> None:
    """Sample one token per row with the Gumbel-max trick, into ``out``.

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16, ``-inf``-masked and temperature-scaled unless
            ``temperature`` is given; rows may be strided (the last dimension must be
            contiguous).
        seeds: ``[N]`` int64 request seeds.
        positions: ``[N]`` int64 absolute positions of the tokens being sampled.
        greedy: ``[N]`` bool (or int, nonzero = greedy): take the plain argmax.
        out: ``[N]`` int64 output token ids.
        temperature: optional ``[N]`` float32: non-greedy rows are divided by it first
            (IEEE division, bit-identical to ``logits.float() / temperature``), which saves
            the caller a full-vocabulary temperature pass.
        threshold: optional ``[N]`` int64 order keys (``mrv2_kernels.top_k_top_p.order_keys``
            of the fp32 values, as ``top_k_top_p_keys`` returns them): after the division,
            values whose key is below the row's become ``-inf``. With the keys of a top-k /
            top-p filter that is the filter, without writing the filtered logits.

    Non-greedy rows get ``argmax_v(logits[n, v] + g(seeds[n], positions[n], v))`` with the
    noise of the module docstring; ties go to the smallest index. Runs
    :func:`gumbel_sample_triton` when :func:`use_triton` says so, else
    :func:`gumbel_sample_cpu` (the reference's tokens).
    """
    impl = gumbel_sample_triton if use_triton(logits) else gumbel_sample_cpu
    impl(logits, seeds, positions, greedy, out, temperature, threshold)


def gumbel_sample_rows(
    logits: torch.Tensor,
    rows: torch.Tensor,
    seed_table: torch.Tensor,
    temperature_table: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    greedy_eps: float,
    threshold: torch.Tensor | None = None,
) -> None:
    """:func:`gumbel_sample` with each row's seed and temperature read from per-request
    tables: row ``n`` belongs to request row ``rows[n]`` (``[N]`` int), samples with seed
    ``seed_table[rows[n]]`` and, unless its temperature ``temperature_table[rows[n]]`` is
    below ``greedy_eps`` (then the plain argmax), divides by that temperature. The tokens of
    ``gumbel_sample(logits, seed_table[rows], positions, t < greedy_eps, out, t, threshold)``
    with ``t = temperature_table[rows]``, without those gathers, the comparison and their
    launches: on the GPU the sampling kernel reads the tables itself (a decode step's
    sampling tail, batch 1: five small kernels fewer)."""
    n = logits.shape[0] if logits.dim() == 2 else -1
    if rows.shape != (n,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be [{n}] int32/int64 (one per logits row), got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    if seed_table.dim() != 1 or temperature_table.dim() != 1:
        raise ValueError("seed_table and temperature_table must be 1-D (one entry a request "
                         f"row), got {tuple(seed_table.shape)} and "
                         f"{tuple(temperature_table.shape)}")
    if not use_triton(logits):
        temperature = temperature_table[rows.long()]
        gumbel_sample_cpu(logits, seed_table[rows.long()], positions,
                          temperature < greedy_eps, out, temperature, threshold)
        return
    _check_args(logits, positions, positions, positions, out, None, threshold)
    _launch(logits, seed_table, positions, positions, out, temperature_table, threshold,
            None, None, rows=rows, greedy_eps=greedy_eps)


def _cut(x: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """``x`` (fp32) with the values whose order key is below the row's threshold at -inf."""
    if threshold is None:
        return x
    keep = order_keys(x).to(torch.int64) >= threshold.view(-1, 1)
    return x.masked_fill(~keep, float("-inf"))


def uniform_hash_triton(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    block_v: int | None = None,
) -> None:
    """Write the uniform noise ``u`` for ``[N]`` seeds/positions into float32 ``out[N, V]``.

    The Triton counterpart of :func:`uniform_hash_ref` (bit-identical); for tests and tools.
    """
    if out.dim() != 2 or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError("out must be 2-D with contiguous rows")
    n, vocab = out.shape
    if seeds.shape != (n,) or positions.shape != (n,):
        raise ValueError(f"seeds and positions must have shape ({n},)")
    if n == 0 or vocab == 0:
        return
    block = default_block(out, cuda=1024, cpu=128, block=block_v)
    grid = (n, cdiv(vocab, block))
    _uniform_hash_kernel[grid](seeds, positions, out, out.stride(0), vocab, BLOCK_V=block)


def divide_rows(
    logits: torch.Tensor, divisor: torch.Tensor, block_v: int | None = None
) -> torch.Tensor:
    """``logits.float() / divisor[:, None]`` as a new float32 tensor, bit for bit (IEEE
    division), in one pass: the temperature stage of the samplers that filter the scaled
    logits (top-k / top-p, min-p) before :func:`gumbel_sample`.

    ``logits`` ``[N, V]`` with contiguous rows (any float dtype, read as float32); ``divisor``
    ``[N]``. On the GPU a Triton kernel (torch's broadcast division of bf16 by a float32
    column ran at ~1.4 TB/s: 166 µs for 256 x 151,936 on the H200); elsewhere torch.
    """
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be 2-D with contiguous rows, got {tuple(logits.shape)}")
    n, vocab = logits.shape
    if divisor.shape != (n,):
        raise ValueError(f"divisor must have shape ({n},), got {tuple(divisor.shape)}")
    if not use_triton(logits):
        return logits.float() / divisor.float()[:, None]
    out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    if n == 0 or vocab == 0:
        return out
    block = default_block(logits, cuda=2048, cpu=128, block=block_v)
    _divide_rows_kernel[(n, cdiv(vocab, block))](
        logits, logits.stride(0), out, out.stride(0), vocab, divisor, BLOCK_V=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return out
