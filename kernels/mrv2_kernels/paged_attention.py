"""Paged causal attention over a block-table KV cache (Triton); reference in paged_attention_ref,
the kernels in :mod:`mrv2_kernels.paged_attention_kernels`, this module their launcher.

KV cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 keys, 1 values).
Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are the last
``qlen_i`` positions of a sequence of ``seq_lens[i]`` tokens, so query ``j`` sits at position
``seq_lens[i] - qlen_i + j`` and attends to keys ``0..`` that position.

One kernel family, two configurations chosen on the host from CPU-known bounds only
(:mod:`mrv2_kernels.paged_attention_plan`):

* prefill / mixed: a program per (query tile, kv head, request). The query heads of a GQA group
  and ``BLOCK_Q`` query tokens are packed into the ``BLOCK_M = BLOCK_Q * GROUP_P2`` rows of one
  ``tl.dot`` tile, so every KV tile is read once per kv head and query tile. Keys are visited in
  ``BLOCK_N`` tiles through the block table (any block size); tiles wholly below the causal
  diagonal take an unmasked fast loop, the rest a masked one.
* small queries (decode, uniform or spec-decode sized): the same kernel with one query tile per
  request and the key range cut into ``num_splits`` chunks ("flash decoding"): programs per
  (kv head x split, request) write partial (max, sum, acc) in fp32, and a second kernel combines
  them per (token, head). Each request's range is cut evenly by its own ``seq_len`` on the
  device, so ``num_splits`` can come from a loose CPU bound and still balance. (Combining in
  the last-arriving split program instead, with an atomic counter, was tried twice: a serial
  walk over the splits took 15 us per layer on the H200 against 5.7 + 2.7 us for the two
  kernels; a vectorized one (all of a token's splits in one load) was no faster than the two
  PDL-launched kernels in CUDA graphs (batch 1, 256 keys: 7.0 against 6.5 us) and left decode
  TPOT unchanged, BENCHMARKS.md 2026-12-01.)

Any head_dim: the kernels' tiles are :func:`~mrv2_kernels.paged_attention_plan.head_tile`
wide (the next power of two, at least 16); a head_dim that is not a power of two (80, 96,
160: Phi-3-mini, Pythia-2.8B, StableLM-2-12B...) is masked to its real width in every load
and store, as vLLM's Triton attention pads its head size. Power-of-2 head dims >= 16 compile
without those masks. The fused RoPE (``rope=``) and the TMA prefill take power-of-2 head dims
only: for others the RoPE kernel runs first (with its cache write) and the paged kernel
attends.

With raw q/k/v (``rope=``) and a prefill plan, where :func:`~mrv2_kernels.prefill_attention.
use_tma_prefill` allows it (``MRV2_TMA_PREFILL=1``, a Hopper GPU), requests of a query tile or
more attend in :mod:`mrv2_kernels.prefill_attention` (the step's keys through TMA) and this
kernel skips them.

No host syncs: grids come from ``num_reqs``, ``max_query_len`` and ``max_seq_len``; programs
past a request's real work exit early. A prefill plan's programs walk the step's query tiles
(``flat_grid``; by default unless prompts of about one length make the (tile, request) grid
no larger: :func:`prefill_flat_grid`; ``MRV2_ATTN_FLAT_GRID=0`` / ``1`` forces either), each
finding its request
in ``query_start_loc`` (one vector load): ``T // block_q + num_reqs`` programs per kv head
rather than ``ceil(max_query_len / block_q) * num_reqs``, most of which exit at once in a mixed
step, and a grid that does not depend on ``max_query_len``: a CUDA graph of mixed steps at a
padded token count bakes ``max_query_len = T`` and launches no more programs than the step
needs. (H200, 2026-12-02: a mixed step of 16 prompts and 128 decodes 248 against 253 us on
Qwen3-0.6B heads, 390 against 388 on Qwen3-8B heads; the throughput workload equal.)
The flat grid is one axis whose order each program finds on the device, so a CUDA graph
serves both: in a step of short sequences its heaviest (latest) query tiles first across the
whole grid (the tile axis slowest: blocks are dispatched in grid order), in a step whose
longest sequence's keys (every kv head's) overflow the L2 cache one kv head after another
(:func:`flat_tiles_last_keys`; ``tiles_last`` and :data:`TILES_LAST_ENV_VAR` force either).
A prefill plan's one-token requests (a mixed step's decoding requests) may attend first in a
launch of their own, in the decode plan's tiles, the prefill launch skipping them
(``one_token_apart``; rule and measurements at :data:`ONE_TOKEN_APART_MIN_BLOCK_M`): in a query
tile a decoding request has one real token (one row in 32 of Qwen3-8B's 128 x 32 tiles). That
launch has no splits, so a few long-context decoding requests beside a long prompt chunk no
longer overlap it. (As a branch of the prefill kernel instead, the 8B prefill rate fell 252 ->
156 TFLOP/s.)
Accumulation is fp32 (online softmax in base 2). The cache may be fp8 (e4m3,
``kv_cache_dtype="fp8"``, stored as :func:`~mrv2_kernels.kv_cache.to_cache_dtype` does):
the key and value tiles become fp16 after the load, and the dots run in fp16 (e4m3 -> fp16
is one ``cvt`` a pair, e4m3 -> bf16 goes through fp32: on the H200 the workload's decode
attention took 1,903 against 2,146 us; the query is clamped to fp16's range). The TMA prefill
path is not taken then (it reads the step's keys from the step's tensors, not the cache).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ._backend import LOG2E as _LOG2E
from ._backend import (
    MAX_GRID_YZ,
    next_power_of_2,
    pdl,
    pdl_early_meta,
)
from .kv_cache import FP8_KV_DTYPE
from .paged_attention_kernels import _combine_splits_kernel, _paged_attn_kernel
from .paged_attention_plan import (
    AttentionPlan,
    FusedRope,
    attention_plan,
    fused_rope_launch,
    head_tile,
)
from .paged_attention_ref import _check_inputs, _check_local, paged_attention_ref
from .prefill_attention import prefill_attention_tma, tma_prefill_min_query

#: ``0``: prefill plans launch one program per (query tile bound, request) instead of over the
#: step's query tiles only (``paged_attention``'s ``flat_grid``); ``1``: always over the step's
#: query tiles; unset: :func:`prefill_flat_grid`'s rule.
FLAT_GRID_ENV_VAR = "MRV2_ATTN_FLAT_GRID"

#: Prefill grids with the query-tile axis slowest (``paged_attention``'s ``tiles_last``):
#: ``1`` every one (the paged kernel's flat grid and (tile, request) grid, the TMA kernel's);
#: ``0`` none; unset: the paged kernel's flat grid only, the default prefill path, in steps
#: whose keys fit the L2 cache (:func:`flat_tiles_last_keys`; H100,
#: 2026-12-06: 4 x 1,024 causal tokens 248 -> 292 TFLOP/s on Qwen3-8B heads, 204 -> 240 on
#: Qwen3-0.6B's, the throughput workload's mixed step 362 -> 339 us on Qwen3-8B's and equal
#: on 0.6B's; the (tile, request) grid's mixed step lost 273 -> 307 us on 0.6B's, the TMA
#: kernel on 8B heads 344 -> 335 TFLOP/s).
TILES_LAST_ENV_VAR = "MRV2_ATTN_TILES_LAST"


def prefill_tiles_last(tiles_last: bool | None, flat: bool) -> bool:
    """Whether a prefill grid (``flat``: the paged kernel's flat one, whose default is in fact
    per step: :func:`flat_tiles_last_keys`; else the (tile, request) grid or the TMA
    kernel's) has its tile axis slowest: ``tiles_last`` where given, else
    :data:`TILES_LAST_ENV_VAR`'s rule."""
    if tiles_last is not None:
        return tiles_last
    setting = os.environ.get(TILES_LAST_ENV_VAR, "").strip()
    return setting == "1" if setting in ("0", "1") else flat
def prefill_flat_grid(flat_grid: bool | None, grid_tiles: int, flat_tiles: int,
                      num_reqs: int) -> bool:
    """Whether a prefill plan launches the flat grid (``flat_tiles`` programs a kv head) rather
    than the (tile, request) grid (``grid_tiles``: query tiles of the longest query times
    requests): ``flat_grid`` where given, else :data:`FLAT_GRID_ENV_VAR`'s, else the flat
    grid unless the other launches no more programs over several requests: a batch of
    prompts of about one length (4 x 1,024 causal tokens on Qwen3-8B heads, H100 2026-12-07:
    the (tile, request) grid, tiles slowest, 111.9 us against the flat grid's 123.9-127.1; on
    Qwen3-0.6B heads 72.9 against 73.6-73.9), where its programs need no request search. A
    mixed step, or one captured in a CUDA graph (``max_query_len`` baked at the token count),
    launches the flat grid: there the other's programs are mostly empty."""
    if flat_grid is not None:
        return flat_grid
    setting = os.environ.get(FLAT_GRID_ENV_VAR, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return num_reqs < 2 or grid_tiles > flat_tiles


#: The flat grid's order where neither ``tiles_last`` nor :data:`TILES_LAST_ENV_VAR` sets it:
#: its query tiles slowest in a step whose longest sequence's keys, every kv head's, fit in
#: this fraction of the L2 cache; the kv-head axis slowest past that (H100, 2026-12-07: one
#: Qwen3-0.6B prompt's TTFT, tiles slowest against heads slowest: 4,000 tokens 14.7 against
#: 16.0 ms, 8,000 tokens 37.7 against 39.5, 16,000 tokens 119.4 against 117.0, 32,000 tokens
#: 412 against 398: every head's keys at once overflow the L2 cache, 8 kv heads x 512 bytes a
#: key is 32 MB at 8,000 keys and 64 MB at 16,000, the L2 50 MB).
TILES_LAST_L2_FRACTION = 1.0


@functools.lru_cache(maxsize=8)
def _l2_bytes(device: torch.device) -> int:
    """The L2 cache's bytes of a CUDA device (50 MiB, an H100's or H200's, elsewhere)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return 50 << 20


def flat_tiles_last_keys(tiles_last: bool | None, kv_cache: torch.Tensor) -> int:
    """The flat grid's order rule (the kernel's ``_flat_tile``): its query tiles slowest in a
    step whose longest sequence has at most this many keys, else its kv heads slowest.
    ``tiles_last`` (else :data:`TILES_LAST_ENV_VAR`) forces either order; by default, the
    keys whose every kv head's K and V fill :data:`TILES_LAST_L2_FRACTION` of the L2 cache."""
    if tiles_last is None:
        setting = os.environ.get(TILES_LAST_ENV_VAR, "").strip()
        tiles_last = setting == "1" if setting in ("0", "1") else None
    if tiles_last is not None:
        return 2**31 - 1 if tiles_last else -1
    per_key = 2 * kv_cache.shape[-2] * kv_cache.shape[-1] * kv_cache.element_size()
    return int(_l2_bytes(kv_cache.device) * TILES_LAST_L2_FRACTION) // per_key


#: Prefill plans of this many warps or more compile with at most the registers that keep two
#: programs on an SM (128 at 8 warps): Qwen3-8B's tiles (128 x 32, 8 warps) need 128 with the
#: flat grid's fixed order and 139 with its order picked per step (ptxas for sm_90; 0 bytes
#: spilled under the cap), and 139 halves the programs resident: 4 x 1,024 causal tokens
#: 194 against 116 us on an H100 (2026-12-07).
PREFILL_MAX_REGS_WARPS = 8


#: Head tiles wider than this get no register cap: a 128-row tile's fp32 accumulator alone
#: fills 128 registers a thread at 8 warps from 256 columns (Gemma's heads, or a padded 160),
#: and ptxas refuses the cap ("Insufficient registers", sm_90).
PREFILL_MAX_REGS_HEAD_TILE = 128


def prefill_register_cap(plan: AttentionPlan, on_gpu: bool, head_dim: int) -> dict[str, int]:
    """The paged kernel's launch options for ``plan`` and heads of ``head_dim``: on CUDA, a
    prefill plan of :data:`PREFILL_MAX_REGS_WARPS` warps or more keeps two programs on an SM
    (64K registers: ``maxnreg``) where its head tile is at most
    :data:`PREFILL_MAX_REGS_HEAD_TILE` wide; nothing otherwise (the interpreter takes no such
    option)."""
    if (not on_gpu or plan.small_q or plan.num_warps < PREFILL_MAX_REGS_WARPS
            or head_tile(head_dim) > PREFILL_MAX_REGS_HEAD_TILE):
        return {}
    return {"maxnreg": 65536 // (2 * 32 * plan.num_warps)}


#: A prefill plan's one-token requests (a mixed step's decoding requests) get a launch of their
#: own in the decode plan's tiles (``paged_attention``'s ``one_token_apart``) where its tiles
#: have at least :data:`ONE_TOKEN_APART_MIN_BLOCK_M` rows; ``1``: for every prefill plan, ``0``:
#: never (they take a query tile each).
ONE_TOKEN_ENV_VAR = "MRV2_ATTN_ONE_TOKEN_APART"
#: Tile rows from which one-token requests attend apart by default: 128-row tiles (Qwen3-8B's
#: 4-head groups) gave a mixed step 384 -> 321 us; 64-row ones (Qwen3-0.6B) 247 us either way,
#: where the extra launch would only cost host time in eager steps (H200, BENCHMARKS.md
#: 2026-12-02, thirteenth session).
ONE_TOKEN_APART_MIN_BLOCK_M = 128

# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_reqs: int,
    uniform_decode: bool = False,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    rope: FusedRope | None = None,
    flat_grid: bool | None = None,
    one_token_apart: bool | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
    tiles_last: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``query`` ``[T, H, D]`` over ``kv_cache``; see the module doc.

    ``sliding_window``: a query at position ``p`` sees keys ``p - sliding_window + 1 .. p``
    only; its programs start at the first key tile their first row sees (decode reads the
    window, not the context), mask every tile, and never take the TMA prefill path.
    ``logit_softcap``: scores ``cap * tanh(score / cap)`` before the softmax (Gemma 2; not on
    the TMA path either). ``sinks`` ``[H]``: each head's attention sink (gpt-oss), a score
    that joins every row's softmax with a value of zero (not on the TMA path).
    ``attention_chunk`` ``C``: chunked local attention (Llama 4's ``attention_chunk_size``), a
    query at position ``p`` sees keys ``(p // C) * C .. p`` only; a compile-time constant of
    the kernel (``CHUNK``; 0, the default, compiles the plain kernel). Programs start at the
    key tile of their first row's chunk (decode splits cut the chunk, not the context); a
    query tile across a chunk boundary masks the tiles before its last row's chunk; not on
    the TMA path, nor with ``sliding_window`` (a ValueError naming both).

    With ``rope``, ``query`` is raw (not yet normalized or rotated) and this call also stores
    the step's key and value in the cache (see :class:`FusedRope`).

    ``max_query_len``, ``max_seq_len`` and ``num_reqs`` are CPU-known upper bounds: only they
    size the grids, device tensors are never read on the host. ``uniform_decode`` says every
    request has the same small query length (decode, or decode plus draft tokens); it selects
    the split-KV configuration, as does ``max_query_len * group <= 16`` by itself.

    Rows of tokens past ``query_start_loc[num_reqs]`` come out as zeros, as do queries with no
    key to attend to (whether ``out`` is given or not). ``block_m``/``block_n``/``num_splits``/
    ``num_warps``/``num_stages`` override the per-device defaults of :func:`attention_plan`
    (``num_splits`` only applies to the small-query configuration). ``flat_grid`` (default:
    on unless :data:`FLAT_GRID_ENV_VAR` is ``0``): a prefill plan's programs over the step's
    query tiles only (see the module doc). ``one_token_apart`` (default: :data:`ONE_TOKEN_ENV_VAR`'s
    rule): a prefill plan's requests of one query token attend in a launch of their own
    first, in the decode plan's tiles (one query row per kv head's group instead of a query
    tile in which one token is real). ``tiles_last`` (default: :func:`prefill_tiles_last`'s
    rule, for the flat grid :func:`flat_tiles_last_keys`' per step): a prefill plan's grid
    has its query-tile axis slowest, so the whole grid starts with the heaviest tiles (the
    kernel's ``TILES_LAST``; the TMA kernel's too: blocks are dispatched in grid order, x
    fastest). Returns
    ``out`` (allocated when ``None``), query dtype.
    """
    num_heads, num_kv_heads, head_dim, block_size = _check_inputs(query, kv_cache)
    head_dim_p2 = head_tile(head_dim)
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_table.dtype in (torch.int32, torch.int64), "block_table must be integer"
    assert kv_cache.dtype in (query.dtype, FP8_KV_DTYPE), (
        f"kv_cache dtype {kv_cache.dtype} must be the query's {query.dtype} or {FP8_KV_DTYPE}"
    )
    assert out is None or (
        out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1
    ), "out must match the query's shape and dtype"
    assert num_reqs < 65536, "num_reqs is a grid dimension: at most 65535 requests per launch"
    _check_local(sliding_window, attention_chunk)
    num_tokens = query.shape[0]
    group = num_heads // num_kv_heads
    on_gpu = query.is_cuda
    dot_fp32 = (not on_gpu) or query.dtype == torch.float32
    # With chunks a query tile reads about its chunk's keys, not the context: what the decode
    # splits cut (their count's bound)
    key_span = max_seq_len if attention_chunk is None else min(
        max_seq_len, attention_chunk + max_query_len)
    plan = attention_plan(
        query,
        kv_cache,
        max_query_len=max_query_len,
        max_seq_len=key_span,
        num_reqs=num_reqs,
        uniform_decode=uniform_decode,
        block_m=block_m,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    qsl = query_start_loc
    query, rope, rope_args, step_kv = fused_rope_launch(query, kv_cache, plan, rope, qsl,
                                                        num_heads, num_kv_heads, head_dim)
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        return torch.zeros_like(query) if out is None else out.zero_()
    splits = plan.num_splits
    num_q_tiles = plan.num_q_tiles

    if out is None:
        # Every row gets written: by its query's program (or the combine kernel), or zeroed
        # as a padding token.
        out = torch.empty_like(query)
    long_qlen = 0
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != query.device):
        raise ValueError(f"sinks must be [{num_heads}] (one per query head) on the query's "
                         f"device, got {tuple(sinks.shape)} on {sinks.device}")
    if (step_kv is not None and sliding_window is None and attention_chunk is None
            and logit_softcap is None and sinks is None
            and max_query_len >= (tile := tma_prefill_min_query(query))):
        # Prefill on Hopper: requests of a query tile or more read the step's own keys through
        # TMA, in their own kernel; the paged kernel below takes the rest (and the padding).
        long_qlen = tile
        prefill_attention_tma(query, *step_kv, kv_cache, qsl, seq_lens, block_table, scale,
                              max_query_len=max_query_len, num_reqs=num_reqs, out=out,
                              min_query_len=long_qlen,
                              tiles_last=prefill_tiles_last(tiles_last, False))
    if splits > 1:
        part_m = torch.empty(
            (num_tokens, num_heads, splits), dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=query.device
        )
    else:
        part_m = part_l = part_acc = out  # unused

    key_cache, value_cache = kv_cache[0], kv_cache[1]
    flat_tiles, grid_tiles = num_tokens // plan.block_q + num_reqs, num_q_tiles * num_reqs
    flat = not plan.small_q and prefill_flat_grid(flat_grid, grid_tiles, flat_tiles, num_reqs)
    if one_token_apart is None:
        setting = os.environ.get(ONE_TOKEN_ENV_VAR)
        one_token_apart = (plan.block_m >= ONE_TOKEN_APART_MIN_BLOCK_M if setting is None
                           else setting != "0")
    apart = not plan.small_q and num_reqs > 1 and rope is None and one_token_apart
    def launch(grid: tuple[int, int, int], p: AttentionPlan, flags: dict[str, Any],
               q_tiles: int | None = None) -> None:
        """``_paged_attn_kernel`` over ``grid`` with plan ``p``'s tiles and splits
        (``q_tiles``: the flat grid's tile count, for ``p.num_q_tiles``)."""
        _paged_attn_kernel[grid](
            query, key_cache, value_cache, out, part_m, part_l, part_acc, qsl, seq_lens,
            block_table, scale * _LOG2E, p.num_q_tiles if q_tiles is None else q_tiles,
            num_heads, query.stride(0),
            query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0),
            key_cache.stride(1), key_cache.stride(2), block_table.stride(0), p.num_splits,
            num_tokens, *rope_args, flags.pop("long_qlen", 0), num_reqs, sliding_window or 0,
            GROUP=group, GROUP_P2=next_power_of_2(group), BLOCK_Q=p.block_q, BLOCK_M=p.block_m,
            BLOCK_N=p.block_n, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2,
            KV_BLOCK_SIZE=block_size,
            USE_SPLITS=p.num_splits > 1, DOT_FP32=dot_fp32,
            # fp32 models on GPU: 3xTF32 tensor-core dots (about fp32 accurate); interpreter:
            # exact.
            FP32_PRECISION="tf32x3" if on_gpu else "ieee", num_warps=p.num_warps,
            num_stages=p.num_stages, EARLY_META=pdl_early_meta(query),
            SLIDING=sliding_window is not None,
            **({} if attention_chunk is None else {"CHUNK": int(attention_chunk)}),
            CAP=0.0 if logit_softcap is None else float(logit_softcap) / scale,
            **({} if sinks is None else {"sinks_ptr": sinks, "SINKS": True}),
            **flags, **pdl(query), **prefill_register_cap(p, on_gpu, head_dim),
        )

    if apart:
        # One-token requests (decoding requests in a mixed step) first, in the decode plan's
        # tiles, without splits: [1 query tile, kv head, request] programs; the others exit.
        one = attention_plan(query, kv_cache, max_query_len=1, max_seq_len=max_seq_len,
                             num_reqs=num_reqs, uniform_decode=True, num_splits=1)
        launch((1, num_kv_heads, num_reqs), one, {"ZERO_PAD": False, "ROPE": False,
                                                  "QK_NORM": False, "ONE_TOKEN": 1})
    if flat:  # one axis: its order is picked on the device (the kernel's _flat_tile)
        grid = (flat_tiles * num_kv_heads * splits, 1, 1)
    else:
        grid = (num_q_tiles, num_kv_heads * splits, num_reqs)
    # (the (tile, request) grid over prompts of about one length: its tiles slowest while the
    # step's keys fit the L2 cache, as the flat grid's rule; else TILES_LAST_ENV_VAR's rule)
    order = (tiles_last if tiles_last is not None or grid_tiles > flat_tiles
             else key_span <= flat_tiles_last_keys(None, kv_cache))
    # (CUDA's grid y and z hold at most 65,535 blocks, x 2**31 - 1: a step of ~1M tokens in
    # small tiles keeps its tile axis on x)
    last = (not flat and not plan.small_q and prefill_tiles_last(order, flat)
            and grid[0] <= MAX_GRID_YZ)
    if last:  # the tile axis slowest (see the kernel's TILES_LAST)
        grid = (grid[1], grid[2], grid[0])
    launch(grid, plan, {
        "long_qlen": long_qlen,
        "ZERO_PAD": splits == 1,  # with splits the combine kernel zeroes the padding rows
        "ROPE": rope is not None,
        "QK_NORM": rope is not None and rope.qk_norm is not None,
        "SKIP_LONG": long_qlen > 0,
        "FLAT": flat,
        "REQ_BLOCK": 256 if on_gpu else 16,  # requests per load of the flat grid's search
        "ONE_TOKEN": 2 if apart else 0,
        "TILES_LAST": last,
        "tiles_last_keys": flat_tiles_last_keys(tiles_last, kv_cache) if flat else 0,
    }, flat_tiles if flat else None)
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            qsl,
            num_reqs,
            num_heads,
            out.stride(0),
            out.stride(1),
            splits,
            SPLITS_P2=next_power_of_2(splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2,
            num_warps=4 if on_gpu else 1,
            **pdl(query),
        )
    return out


__all__ = ["FLAT_GRID_ENV_VAR", "ONE_TOKEN_APART_MIN_BLOCK_M", "ONE_TOKEN_ENV_VAR",
           "PREFILL_MAX_REGS_HEAD_TILE", "TILES_LAST_ENV_VAR", "TILES_LAST_L2_FRACTION",
           "AttentionPlan", "FusedRope", "attention_plan", "flat_tiles_last_keys", "head_tile",
           "paged_attention", "paged_attention_ref", "prefill_flat_grid", "prefill_register_cap",
           "prefill_tiles_last"]
