"""Per-step input preparation and post-sampling update of the persistent state table.

The engine keeps one row per live request in device tensors with ``R`` rows:

- ``token_ids``    ``[R, max_model_len]`` int32: prompt + output tokens of the row's request,
- ``num_computed`` ``[R]`` int32: tokens whose KV is already in the cache,
- ``num_tokens``   ``[R]`` int32: tokens known for the row (prompt + sampled so far),
- ``block_table``  ``[R, max_blocks]`` int32: the request's KV cache block ids.

Each step the CPU sends ``idx_mapping`` ``[B]`` (batch position -> row) and
``query_start_loc`` ``[B + 1]`` (exclusive prefix sum of the tokens scheduled per request;
``query_start_loc[B]`` is the real token count ``n``). Request ``i`` computes the tokens at
positions ``p = num_computed[row] + j`` for ``j < qlen_i``.

:func:`prepare_inputs` builds the step's flat token inputs and per-request metadata from the
table; :func:`post_update` advances the table after sampling, including speculative decoding
steps where the last scheduled tokens of a request were draft tokens and only some of them
were accepted. Both write into caller-provided
buffers and the Triton paths never synchronize with the host. Preconditions (not checked on
the device): rows in ``idx_mapping[:num_reqs]`` are distinct and in range,
``num_computed[row] + qlen_i <= max_model_len`` and every block the tokens touch is in the
row's block table.
"""

import torch
import triton
import triton.language as tl

from ._backend import default_block, next_power_of_2, use_triton
from ._checks import check_1d, check_rows

__all__ = [
    "post_update",
    "post_update_ref",
    "post_update_triton",
    "prepare_inputs",
    "prepare_inputs_ref",
    "prepare_inputs_triton",
]


@triton.jit(do_not_specialize=["num_reqs", "num_batch", "num_tokens_pad", "num_block_cols"])
def _prepare_inputs_kernel(
    idx_mapping_ptr: tl.tensor,
    query_start_loc_ptr: tl.tensor,
    num_reqs: int,
    num_batch: int,
    num_tokens_pad: int,
    token_ids_ptr: tl.tensor,
    token_ids_stride: int,
    num_computed_ptr: tl.tensor,
    block_table_ptr: tl.tensor,
    block_table_stride: int,
    block_size: int,
    input_ids_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    slot_mapping_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    block_table_out_ptr: tl.tensor,
    block_table_out_stride: int,
    num_block_cols: int,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> None:
    # Programs [0, num_reqs): one real request each, looping over its tokens in tiles.
    # Programs [num_reqs, num_batch): padded batch entries. Program num_batch: padding tokens.
    pid = tl.program_id(0)
    t_offs = tl.arange(0, BLOCK_T)
    c_offs = tl.arange(0, BLOCK_C)
    if pid < num_reqs:
        row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
        start = tl.load(query_start_loc_ptr + pid).to(tl.int32)
        end = tl.load(query_start_loc_ptr + pid + 1).to(tl.int32)
        computed = tl.load(num_computed_ptr + row).to(tl.int32)
        tok_row_ptr = token_ids_ptr + row * token_ids_stride
        bt_row_ptr = block_table_ptr + row * block_table_stride
        for t0 in range(start, end, BLOCK_T):
            t = t0 + t_offs
            mask = t < end
            pos = computed + (t - start)
            tok = tl.load(tok_row_ptr + pos, mask=mask, other=0)
            block = tl.load(bt_row_ptr + pos // block_size, mask=mask, other=0)
            slot = block.to(tl.int64) * block_size + (pos % block_size).to(tl.int64)
            tl.store(input_ids_ptr + t, tok.to(tl.int32), mask=mask)
            tl.store(positions_ptr + t, pos.to(tl.int64), mask=mask)
            tl.store(slot_mapping_ptr + t, slot, mask=mask)
        tl.store(seq_lens_ptr + pid, computed + (end - start))
        out_row_ptr = block_table_out_ptr + pid.to(tl.int64) * block_table_out_stride
        for c0 in range(0, num_block_cols, BLOCK_C):
            c = c0 + c_offs
            cmask = c < num_block_cols
            blocks = tl.load(bt_row_ptr + c, mask=cmask, other=0)
            tl.store(out_row_ptr + c, blocks.to(tl.int32), mask=cmask)
    elif pid < num_batch:
        tl.store(seq_lens_ptr + pid, 0)
        out_row_ptr = block_table_out_ptr + pid.to(tl.int64) * block_table_out_stride
        for c0 in range(0, num_block_cols, BLOCK_C):
            c = c0 + c_offs
            tl.store(out_row_ptr + c, tl.zeros([BLOCK_C], tl.int32), mask=c < num_block_cols)
    else:
        n = tl.load(query_start_loc_ptr + num_reqs).to(tl.int32)
        for t0 in range(n, num_tokens_pad, BLOCK_T):
            t = t0 + t_offs
            mask = t < num_tokens_pad
            tl.store(input_ids_ptr + t, tl.zeros([BLOCK_T], tl.int32), mask=mask)
            tl.store(positions_ptr + t, tl.zeros([BLOCK_T], tl.int64), mask=mask)
            tl.store(slot_mapping_ptr + t, tl.full([BLOCK_T], -1, tl.int64), mask=mask)


@triton.jit
def _post_update_kernel(
    idx_mapping_ptr: tl.tensor,
    query_start_loc_ptr: tl.tensor,
    sampled_ptr: tl.tensor,
    sampled_stride: int,
    num_sampled_ptr: tl.tensor,
    num_drafts_ptr: tl.tensor,
    token_ids_ptr: tl.tensor,
    token_ids_stride: int,
    max_model_len: int,
    num_computed_ptr: tl.tensor,
    num_tokens_ptr: tl.tensor,
    S: int,
    BLOCK_S: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    qlen = tl.load(query_start_loc_ptr + pid + 1) - tl.load(query_start_loc_ptr + pid)
    if qlen == 0:  # a CUDA graph's padding request: its row entry is stale, touch nothing
        return
    n = tl.load(num_sampled_ptr + pid).to(tl.int32)
    drafts = tl.load(num_drafts_ptr + pid).to(tl.int32)
    base = tl.load(num_computed_ptr + row).to(tl.int32) + qlen.to(tl.int32) - drafts
    tl.store(num_computed_ptr + row, base + tl.maximum(n - 1, 0))
    j = tl.arange(0, BLOCK_S)
    pos = base + j
    write = (j < n) & (j < S) & (pos < max_model_len)
    tokens = tl.load(sampled_ptr + pid.to(tl.int64) * sampled_stride + j, mask=write, other=0)
    tl.store(token_ids_ptr + row * token_ids_stride + pos, tokens.to(tl.int32), mask=write)
    tl.store(num_tokens_ptr + row, tl.minimum(base + n, max_model_len), mask=n > 0)


def _check_prepare_args(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    outs: tuple[torch.Tensor, ...],
    num_block_cols: int,
) -> None:
    input_ids, positions, slot_mapping, seq_lens, block_table_out = outs
    check_1d("idx_mapping", idx_mapping, num_reqs)
    check_1d("query_start_loc", query_start_loc, num_reqs + 1)
    check_rows("token_ids", token_ids)
    check_rows("block_table", block_table)
    check_rows("block_table_out", block_table_out)
    num_tokens_pad = input_ids.shape[0]
    for name, t in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
    ):
        if t.shape != (num_tokens_pad,) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with shape ({num_tokens_pad},)")
    num_batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or not seq_lens.is_contiguous() or num_batch < num_reqs:
        raise ValueError(f"seq_lens must be contiguous 1-D with >= {num_reqs} entries")
    if block_table_out.shape[0] != num_batch:
        raise ValueError("block_table_out must have one row per seq_lens entry")
    if not 0 <= num_block_cols <= min(block_table.shape[1], block_table_out.shape[1]):
        raise ValueError(f"num_block_cols={num_block_cols} exceeds the block table width")


def prepare_inputs_ref(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table_out: torch.Tensor,
    num_block_cols: int,
) -> None:
    """Plain-torch specification of :func:`prepare_inputs` (same arguments, same effect)."""
    outs = (input_ids, positions, slot_mapping, seq_lens, block_table_out)
    _check_prepare_args(
        idx_mapping, query_start_loc, num_reqs, token_ids, block_table, outs, num_block_cols
    )
    dev = input_ids.device
    num_tokens_pad = input_ids.shape[0]
    cols = num_block_cols
    seq_lens.zero_()
    block_table_out[:, :cols] = 0
    if num_reqs == 0:
        input_ids.zero_()
        positions.zero_()
        slot_mapping.fill_(-1)
        return
    qsl = query_start_loc[: num_reqs + 1].to(device=dev, dtype=torch.int64)
    rows = idx_mapping[:num_reqs].to(device=dev, dtype=torch.int64)
    computed = num_computed[rows].to(torch.int64)
    qlens = qsl[1:] - qsl[:-1]
    tok = torch.arange(num_tokens_pad, device=dev, dtype=torch.int64)
    # Request of each token: qsl[i] <= t < qsl[i + 1] (zero-length requests own no token).
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp_(max=num_reqs - 1)
    valid = tok < qsl[num_reqs]
    pos = torch.where(valid, computed[req] + tok - qsl[req], 0)
    tok_rows = rows[req]
    ids = token_ids[tok_rows, pos].to(torch.int64)
    blocks = block_table[tok_rows, torch.div(pos, block_size, rounding_mode="floor")]
    slots = blocks.to(torch.int64) * block_size + pos % block_size
    input_ids.copy_(torch.where(valid, ids, 0))
    positions.copy_(pos)
    slot_mapping.copy_(torch.where(valid, slots, -1))
    seq_lens[:num_reqs] = (computed + qlens).to(seq_lens.dtype)
    block_table_out[:num_reqs, :cols] = block_table[rows, :cols].to(block_table_out.dtype)


def prepare_inputs_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table_out: torch.Tensor,
    num_block_cols: int,
    block_t: int | None = None,
    block_c: int | None = None,
) -> None:
    """Triton implementation of :func:`prepare_inputs`: one launch of ``B_pad + 1`` programs.

    Program ``i < num_reqs`` handles request ``i`` (its tokens in ``block_t`` tiles, its
    ``seq_lens`` entry and block-table row in ``block_c`` tiles), programs up to ``B_pad``
    zero the padded batch entries, and the last one fills the padding tokens
    ``[query_start_loc[num_reqs], T)``, read on the device. No host synchronization.
    """
    outs = (input_ids, positions, slot_mapping, seq_lens, block_table_out)
    _check_prepare_args(
        idx_mapping, query_start_loc, num_reqs, token_ids, block_table, outs, num_block_cols
    )
    num_batch = seq_lens.shape[0]
    bt = default_block(input_ids, cuda=256, cpu=32, block=block_t)
    bc = default_block(input_ids, cuda=256, cpu=16, block=block_c)
    _prepare_inputs_kernel[(num_batch + 1,)](
        idx_mapping,
        query_start_loc,
        num_reqs,
        num_batch,
        input_ids.shape[0],
        token_ids,
        token_ids.stride(0),
        num_computed,
        block_table,
        block_table.stride(0),
        block_size,
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        block_table_out,
        block_table_out.stride(0),
        num_block_cols,
        BLOCK_T=bt,
        BLOCK_C=bc,
    )


def prepare_inputs(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table_out: torch.Tensor,
    num_block_cols: int,
) -> None:
    """Build one step's inputs from the state table, in place.

    Args:
        idx_mapping: ``[>= B]`` int, batch position -> state-table row (``B = num_reqs``).
        query_start_loc: ``[>= B + 1]`` int, exclusive prefix sum of scheduled token counts.
        num_reqs: number of real requests ``B``.
        token_ids: ``[R, max_model_len]`` int32 table (rows must be contiguous).
        num_computed: ``[R]`` int32, tokens already in the KV cache.
        block_table: ``[R, max_blocks]`` int32 KV block ids.
        block_size: KV cache block size in tokens.
        input_ids: out ``[T]`` int32, ``token_ids[row, p]``; padding ``0``.
        positions: out ``[T]`` int64, ``p``; padding ``0``.
        slot_mapping: out ``[T]`` int64,
            ``block_table[row, p // block_size] * block_size + p % block_size``; padding ``-1``.
        seq_lens: out ``[B_pad]`` int32, ``num_computed[row] + qlen``; entries ``>= B``: ``0``.
        block_table_out: out ``[B_pad, W]`` int32; columns ``< num_block_cols`` of row ``i``
            get ``block_table[idx_mapping[i]]`` (``0`` for padded rows); the rest is untouched.
        num_block_cols: how many block-table columns to copy.

    Token ``t < query_start_loc[B]`` belongs to request ``i`` with
    ``query_start_loc[i] <= t < query_start_loc[i + 1]`` and has position
    ``p = num_computed[idx_mapping[i]] + t - query_start_loc[i]``; tokens past that are
    padding. Runs :func:`prepare_inputs_triton` when :func:`use_triton` says so, else
    :func:`prepare_inputs_ref`.
    """
    impl = prepare_inputs_triton if use_triton(input_ids) else prepare_inputs_ref
    impl(
        idx_mapping,
        query_start_loc,
        num_reqs,
        token_ids,
        num_computed,
        block_table,
        block_size,
        input_ids,
        positions,
        slot_mapping,
        seq_lens,
        block_table_out,
        num_block_cols,
    )


def _check_update_args(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_drafts: torch.Tensor,
    token_ids: torch.Tensor,
) -> None:
    check_1d("idx_mapping", idx_mapping, num_reqs)
    check_1d("query_start_loc", query_start_loc, num_reqs + 1)
    check_1d("num_sampled", num_sampled, num_reqs)
    check_1d("num_drafts", num_drafts, num_reqs)
    check_rows("sampled", sampled, num_reqs, 1)
    check_rows("token_ids", token_ids)


def post_update_ref(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_drafts: torch.Tensor,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
) -> None:
    """Plain-torch specification of :func:`post_update` (same arguments, same effect)."""
    _check_update_args(
        idx_mapping, query_start_loc, num_reqs, sampled, num_sampled, num_drafts, token_ids
    )
    if num_reqs == 0:
        return
    dev = num_computed.device
    max_model_len, width = token_ids.shape[1], sampled.shape[1]
    qsl = query_start_loc[: num_reqs + 1].to(device=dev, dtype=torch.int64)
    qlen = qsl[1:] - qsl[:-1]
    real = qlen > 0  # empty queries (a CUDA graph's padding requests) change nothing
    rows = idx_mapping[:num_reqs].to(device=dev, dtype=torch.int64)[real]
    n = num_sampled[:num_reqs].to(device=dev, dtype=torch.int64)[real]
    drafts = num_drafts[:num_reqs].to(device=dev, dtype=torch.int64)[real]
    base = num_computed[rows].to(torch.int64) + qlen[real] - drafts
    num_computed[rows] = (base + (n - 1).clamp(min=0)).to(num_computed.dtype)
    j = torch.arange(width, device=dev, dtype=torch.int64)
    pos = base[:, None] + j[None, :]  # [B, S]
    write = (j[None, :] < n[:, None]) & (pos < max_model_len)
    wrows = rows[:, None].expand(-1, width)[write]
    token_ids[wrows, pos[write]] = sampled[:num_reqs].to(dev)[real][write].to(token_ids.dtype)
    has = n > 0
    num_tokens[rows[has]] = (base + n).clamp(max=max_model_len)[has].to(num_tokens.dtype)


def post_update_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_drafts: torch.Tensor,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
) -> None:
    """Triton implementation of :func:`post_update`: one program per request.

    Each program handles its request's up to ``S`` sampled tokens as one vector of
    ``next_power_of_2(S)`` lanes; ``num_reqs`` only sizes the grid (no recompiles).
    """
    _check_update_args(
        idx_mapping, query_start_loc, num_reqs, sampled, num_sampled, num_drafts, token_ids
    )
    if num_reqs == 0:
        return
    width = sampled.shape[1]
    _post_update_kernel[(num_reqs,)](
        idx_mapping,
        query_start_loc,
        sampled,
        sampled.stride(0),
        num_sampled,
        num_drafts,
        token_ids,
        token_ids.stride(0),
        token_ids.shape[1],
        num_computed,
        num_tokens,
        width,
        BLOCK_S=next_power_of_2(width),
    )


def post_update(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_drafts: torch.Tensor,
    token_ids: torch.Tensor,
    num_computed: torch.Tensor,
    num_tokens: torch.Tensor,
) -> None:
    """Advance the state table after sampling (and speculative verification), in place.

    Args:
        idx_mapping: ``[>= B]`` int, batch position -> state-table row (``B = num_reqs``).
        query_start_loc: ``[>= B + 1]`` int, exclusive prefix sum of scheduled token counts.
        num_reqs: number of real requests ``B``.
        sampled: ``[>= B, S]`` int64 (rows contiguous), the tokens request ``i`` produced.
        num_sampled: ``[>= B]`` int32, ``n_i``: ``0`` when the request produced no token this
            step (a mid-prompt chunk), else ``1 +`` its accepted draft tokens (``<= d_i + 1``
            and ``<= S``).
        num_drafts: ``[>= B]`` int32, ``d_i``: the last ``d_i`` of the request's ``qlen``
            scheduled tokens were speculative draft tokens (``0`` without speculation).
        token_ids: ``[R, max_model_len]`` int32 table (rows contiguous).
        num_computed: ``[R]`` int32, tokens in the KV cache.
        num_tokens: ``[R]`` int32, tokens known for the row.

    For each request ``i < num_reqs`` with ``row = idx_mapping[i]`` and
    ``qlen = query_start_loc[i + 1] - query_start_loc[i]``: the tokens before the drafts are
    computed, ``base = num_computed[row] + qlen - d_i``; the accepted drafts are computed too,
    ``num_computed[row] = base + max(n_i - 1, 0)`` (the KV of rejected drafts stays in the
    cache as garbage past that count and is overwritten later); the sampled tokens follow the
    verified prefix, ``token_ids[row, base + j] = sampled[i, j]`` for ``j < n_i`` where
    ``base + j < max_model_len``; and when ``n_i > 0``,
    ``num_tokens[row] = min(base + n_i, max_model_len)``. Rejected draft tokens left in
    ``token_ids`` past ``num_tokens`` are stale. With ``d_i = 0`` and ``n_i`` in ``{0, 1}``
    this is the plain decode/prefill update. A request with an empty query (``qlen == 0``: a
    padding request of a CUDA graph replayed at a larger size, whose ``idx_mapping`` entry is
    stale) changes nothing. Dispatches like :func:`prepare_inputs` (on ``num_computed``).
    """
    impl = post_update_triton if use_triton(num_computed) else post_update_ref
    impl(
        idx_mapping,
        query_start_loc,
        num_reqs,
        sampled,
        num_sampled,
        num_drafts,
        token_ids,
        num_computed,
        num_tokens,
    )
