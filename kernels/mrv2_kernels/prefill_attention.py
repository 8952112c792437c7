"""Causal prefill attention that reads the step's own keys and values through TMA (Hopper).

:func:`mrv2_kernels.paged_attention.paged_attention` reads every key through the block table,
a row gather per key. In a prefill or mixed step most keys a query sees are the step's own:
they sit in the step's ``key`` / ``value`` tensors (slices of the fused QKV output, rotated
in place by the RoPE kernel), one contiguous row per token. This kernel reads those tiles with
tensor-memory-accelerator descriptors (``triton.tools.tensor_descriptor``: one bulk copy per
tile, no address arithmetic per row, multi-stage pipelined), and only the keys from before the
chunk (earlier chunks of a long prompt, a cached prefix) through the block table.

A program owns one query tile (``BLOCK_M`` tokens) of one request and one query head; the
query heads of a GQA group read the same key tiles, mostly from L2. (Packing the group into
the tile's rows, as the paged kernel does, measured slower: 210 against 341 TFLOP/s, though
that build also ran one program per SM.) Keys of the chunk wholly below the tile's first token
take an unmasked loop; the diagonal tiles a masked one. Each row gets the paged kernel's value,
to fp32 accumulation order. The values of ``key`` / ``value`` must be what the step stores in
the cache (same dtype: the cache's), which the caller guarantees.

Requests with fewer query tokens than one tile (decode rows of a mixed step, short chunks)
stay with the paged kernel, which :func:`~mrv2_kernels.paged_attention.paged_attention` then
launches for them (and for the padding rows).

H200, Qwen3-8B heads (32 over 8), bf16 (BENCHMARKS.md 2026-12-02): 4 x 1,024 causal tokens
341 TFLOP/s against 258 for the paged kernel; a 1,024-token chunk after 3,072 cached tokens
347 against 340. Tiles: 64 x 64, 4 warps, 3 stages (a prototype sweep: 128-row tiles,
128-key tiles, 4-5 stages, pointer loads instead of TMA and Triton's warp specialization were
all slower, 194-325). The kernel needs two programs per SM: its shared memory (115,712 bytes)
sits exactly at that limit, and 16 bytes more (zeroing the masked values of the diagonal tile)
halved it to 223 TFLOP/s; a test compiles it for sm_90 and checks the size.

Off by default, from engine-level A/Bs on the H200 (BENCHMARKS.md, 2026-12-02): a 4,096-token
prompt on Qwen3-8B gains 2% of time to first token (99.1 against 100.9 ms), a 16K-token one
nothing (566 against 571 ms: at 8K-token chunks both kernels run at about the same rate), and
the throughput workload's mixed steps (8,192-token steps of ~14 prompts of 100-1,024 tokens)
lose: 3.44 against 3.40 s on Qwen3-8B, 0.525 against 0.462 s on Qwen3-0.6B, whose 2-head
groups this kernel reads once per query head where the paged kernel reads them once.
``MRV2_TMA_PREFILL=1`` turns it on wherever the inputs allow it (CUDA devices of compute
capability 9.0+; the interpreter too, for tests).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._backend import LOG2E as _LOG2E
from ._backend import M_INIT as _M_INIT
from ._backend import MAX_GRID_YZ, cdiv, pdl, pdl_prologue
from ._backend import online_softmax_step as _online_step

__all__ = ["TMA_PREFILL_ENV_VAR", "prefill_attention_tma", "tma_prefill_min_query",
           "use_tma_prefill"]

#: ``1``: wherever the inputs allow it (a CUDA device of compute capability 9.0+, or the
#: interpreter); anything else, or unset: never (the default, see the module doc).
TMA_PREFILL_ENV_VAR = "MRV2_TMA_PREFILL"



@triton.jit(do_not_specialize=["num_q_tiles", "min_qlen"])
def _tma_prefill_kernel(
    q_desc: tl.tensor_descriptor,
    k_desc: tl.tensor_descriptor,
    v_desc: tl.tensor_descriptor,
    key_cache_ptr: tl.tensor,
    value_cache_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    block_table_ptr: tl.tensor,
    qk_scale: tl.tensor,
    num_q_tiles: tl.tensor,
    min_qlen: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_kb: tl.tensor,
    stride_ks: tl.tensor,
    stride_kh: tl.tensor,
    stride_bt: tl.tensor,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    TILES_LAST: tl.constexpr = False,
) -> None:
    pdl_prologue(PDL)
    # Heaviest query tiles (latest positions) first: better tail balance. TILES_LAST: the grid
    # is (head, request, query tile), so the whole grid starts with every head's and request's
    # last tile (blocks are dispatched in grid order, x fastest); otherwise (query tile, head,
    # request) orders the tiles within each head only.
    if TILES_LAST:
        q_tile = num_q_tiles - 1 - tl.program_id(2)
        head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        q_tile = num_q_tiles - 1 - tl.program_id(0)
        head = tl.program_id(1)
        req = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(qsl_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - q_start
    tile_start = q_tile * BLOCK_M
    if tile_start >= qlen or qlen < min_qlen:  # short requests: the paged kernel's
        return
    ctx_len = seq_len - qlen  # keys before the chunk: in the cache only

    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tile_start + tl.arange(0, BLOCK_M)  # the row's query token, chunk-relative
    # Rows past the request's own tokens compute garbage that is never stored.
    q = q_desc.load([q_start + tile_start, head * HEAD_DIM])
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Keys before the chunk, through the block table: every query of the chunk sees them all.
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_kh
    ctx_mid = (ctx_len // BLOCK_N) * BLOCK_N
    for start in tl.range(0, ctx_mid, BLOCK_N, num_stages=NUM_STAGES):
        n = start + offs_n
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE).to(tl.int64)
        kv_off = (blk[:, None] * stride_kb + (n % KV_BLOCK_SIZE)[:, None] * stride_ks
                  + head_off + offs_d[None, :])
        k = tl.load(key_cache_ptr + kv_off)
        v = tl.load(value_cache_ptr + kv_off)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, tok[:, None] >= 0,
                                     False, DOT_FP32, FP32_PRECISION)
    if ctx_mid < ctx_len:  # the prefix's last, partial tile
        n = ctx_mid + offs_n
        n_ok = n < ctx_len
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = (blk[:, None] * stride_kb + (n % KV_BLOCK_SIZE)[:, None] * stride_ks
                  + head_off + offs_d[None, :])
        k = tl.load(key_cache_ptr + kv_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(value_cache_ptr + kv_off, mask=n_ok[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, n_ok[None, :], True,
                                     DOT_FP32, FP32_PRECISION)

    # The chunk's own keys, chunk-relative index j: query token `tok` sees j <= tok. Tiles
    # wholly below the tile's first token need no mask.
    col = kvh * HEAD_DIM
    mid = (tile_start // BLOCK_N) * BLOCK_N
    for j in tl.range(0, mid, BLOCK_N, num_stages=NUM_STAGES):
        k = k_desc.load([q_start + j, col])
        v = v_desc.load([q_start + j, col])
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, tok[:, None] >= 0,
                                     False, DOT_FP32, FP32_PRECISION)
    hi = tl.minimum(tile_start + BLOCK_M, qlen)
    for j in tl.range(mid, hi, BLOCK_N):
        # Rows past the request's own (the next request's tokens, padding, the descriptor's
        # zero fill past the tensor) are masked out: their key index exceeds every valid
        # token, so their weights are exactly 0 (their values are finite projections; not
        # zeroing them here keeps the kernel at two programs per SM, see the module doc).
        k = k_desc.load([q_start + j, col])
        v = v_desc.load([q_start + j, col])
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        keep = (j + offs_n)[None, :] <= tok[:, None]
        acc, m_i, l_i = _online_step(q, k, v, acc, m_i, l_i, qk_scale, keep, True, DOT_FP32,
                                     FP32_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    q_row = (q_start + tok).to(tl.int64)
    tl.store(out_ptr + q_row[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(tok < qlen)[:, None])


@functools.lru_cache(maxsize=8)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ready(t: torch.Tensor) -> bool:
    """``[T, W]`` with contiguous rows, 16-byte aligned base and row stride (TMA's rules)."""
    return (t.dim() == 2 and t.shape[0] > 0 and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


def use_tma_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`prefill_attention_tma` takes a prefill step with these tensors (query
    ``[T, H, D]``; key / value ``[T, Hk*D]``, as 2-D views): :data:`TMA_PREFILL_ENV_VAR` is
    ``1``, the device has TMA (CUDA, compute capability 9.0+; or the interpreter), the head
    dim is a power of two >= 16 (a TMA block's width; the paged kernel pads the others) and
    the three tensors follow TMA's alignment rules. Metadata only."""
    if os.environ.get(TMA_PREFILL_ENV_VAR, "").strip() != "1":
        return False
    head_dim = query.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    q2 = query.reshape(query.shape[0], -1) if query.dim() == 3 and query.stride(1) == \
        query.shape[2] else query
    if not (_tma_ready(q2) and _tma_ready(key) and _tma_ready(value)):
        return False
    return not query.is_cuda or _has_tma(query.device)


def tma_prefill_min_query(query: torch.Tensor) -> int:
    """Requests with at least this many query tokens go to :func:`prefill_attention_tma`;
    shorter ones (decode rows of a mixed step, short chunks) stay with the paged kernel, whose
    programs hold a whole GQA group (a per-head program would read their keys once per query
    head). One query tile: 64 tokens on the GPU, 16 under the interpreter."""
    return _tiles(query, None, None)[0]


def _tiles(query: torch.Tensor, block_m: int | None, block_n: int | None) -> tuple[int, int]:
    on_gpu = query.is_cuda
    return block_m or (64 if on_gpu else 16), block_n or (64 if on_gpu else 16)


def prefill_attention_tma(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    num_reqs: int,
    out: torch.Tensor,
    min_query_len: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tiles_last: bool = False,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, H, D]`` (a ``[T, H*D]`` view with TMA's alignment)
    whose step keys and values are ``key`` / ``value`` ``[T, Hk*D]`` (already in ``kv_cache``
    too; the earlier keys only there), into ``out`` ``[T, H, D]``, for the requests with at
    least ``min_query_len`` query tokens: their rows get
    :func:`~mrv2_kernels.paged_attention.paged_attention`'s values; other rows (shorter
    requests, padding) are not written. The caller checks :func:`use_tma_prefill` and the
    paged kernel's input rules; tile arguments override the defaults (GPU: 64 x 64 tiles, 4
    warps, 3 stages). ``tiles_last``: the grid's query-tile axis is its slowest (see the
    kernel)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    on_gpu = query.is_cuda
    bm, bn = _tiles(query, block_m, block_n)
    num_q_tiles = cdiv(max_query_len, bm)
    q2 = query.reshape(num_tokens, num_heads * head_dim)
    query_desc = TensorDescriptor(q2, list(q2.shape), [q2.stride(0), 1], [bm, head_dim])
    key_desc = TensorDescriptor(key, list(key.shape), [key.stride(0), 1], [bn, head_dim])
    value_desc = TensorDescriptor(value, list(value.shape), [value.stride(0), 1],
                                  [bn, head_dim])
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    tiles_last = tiles_last and num_q_tiles <= MAX_GRID_YZ  # (else the tiles stay on x)
    grid = ((num_heads, num_reqs, num_q_tiles) if tiles_last
            else (num_q_tiles, num_heads, num_reqs))
    _tma_prefill_kernel[grid](
        query_desc, key_desc, value_desc, key_cache, value_cache, out,
        query_start_loc, seq_lens, block_table, scale * _LOG2E, num_q_tiles, min_query_len,
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_M=bm, BLOCK_N=bn,
        HEAD_DIM=head_dim, KV_BLOCK_SIZE=block_size,
        NUM_STAGES=num_stages or (3 if on_gpu else 1),
        DOT_FP32=(not on_gpu) or query.dtype == torch.float32,
        # fp32 on the GPU: 3xTF32 tensor-core dots, as the paged kernel; interpreter: exact
        FP32_PRECISION="tf32x3" if on_gpu else "ieee",
        num_warps=num_warps or 4, TILES_LAST=tiles_last, **pdl(query),
    )
    return out
