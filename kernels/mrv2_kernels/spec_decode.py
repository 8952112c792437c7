"""Speculative decoding on the device: n-gram draft proposal and strict verification.

**Proposal** (:func:`ngram_propose`, the n-gram or "prompt lookup" speculator): a request's
next tokens often repeat something already in its context (code, quotes, lists, the prompt
itself). For a request whose known tokens are ``seq = token_ids[row, :T]``, every earlier end
``e`` in ``[1, T - 1]`` is a candidate: its match length ``len(e)`` is the largest
``l <= min(max_n, e)`` with ``seq[e - l:e] == seq[T - l:T]`` (the ``l`` tokens before ``e``
equal the last ``l`` tokens of the sequence). The candidate with the largest
``(len(e), e)`` among those with ``len(e) >= min_n`` wins: the longest match, then the most
recent. The ``k`` drafts are the tokens that followed it, ``seq[e + (j mod (T - e))]``: when
they run into the end of the sequence they continue the period ``T - e`` (a sequence that
repeats with that period keeps repeating). Without a match every draft is ``seq[T - 1]`` and
the request reports ``num_found = 0`` (the caller then schedules no drafts for it). The drafts
are written into the state table right after the known tokens, ``token_ids[row, T + j]``
(clipped at the table width), which is where the next step's input preparation reads the
query tokens from; ``num_tokens`` is not advanced: the drafts are not known tokens yet.

**Verification** (:func:`strict_rejection`): the target model computes logits for the last
verified token and for each draft of a request, and samples one token from each row as if
decoding normally. Draft ``j`` is accepted while every earlier draft was and the target's own
sample for the row before it equals it; the output is the accepted drafts followed by the
target's sample at the first mismatch (or the bonus sample after the last draft when all are
accepted), that is ``target[r0 .. r0 + m]``. Since every emitted token is the target's own
sample given exactly the tokens before it, the output equals non-speculative decoding token
for token (for greedy sampling, and for seeded sampling whose randomness depends only on the
request and position); drafts only change how many tokens one step yields.

**Writing drafts** (:func:`write_drafts`): a model-based drafter stores each request's draft at
its position in the state table, only for the requests that drafted. A masked store per request
rather than an indexed assignment: in a CUDA graph the padding requests' rows are stale and may
name a live request's row, which an indexed assignment of "the old value" would race with.

The ops write into caller-provided buffers, run one Triton program per request and never
synchronize with the host; per-step counts are grid sizes or values read on the device, so
they never trigger a recompile. Each comes as ``op_ref`` (plain torch: the specification),
``op_triton`` and ``op`` (dispatch with :func:`use_triton`).
"""

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, use_triton
from ._checks import check_1d, check_rows

__all__ = [
    "ngram_propose",
    "ngram_propose_ref",
    "ngram_propose_triton",
    "strict_rejection",
    "strict_rejection_ref",
    "strict_rejection_triton",
    "write_drafts",
    "write_drafts_ref",
    "write_drafts_triton",
]


# --------------------------------------------------------------------------------------------
# strict_rejection
# --------------------------------------------------------------------------------------------


@triton.jit
def request_logits_rows(cu_num_logits_ptr: tl.tensor, b: tl.tensor, S: int
                        ) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """``(r0, count, num_drafts)`` of request ``b``: its first logits row, its row count, and
    the drafts it verifies (``count - 1``, at most ``S - 1``: the output row's width)."""
    r0 = tl.load(cu_num_logits_ptr + b).to(tl.int64)
    count = tl.load(cu_num_logits_ptr + b + 1).to(tl.int64) - r0
    return r0, count, tl.minimum(tl.maximum(count - 1, 0), S - 1)


@triton.jit
def _strict_rejection_kernel(
    target_ptr: tl.tensor,
    cu_num_logits_ptr: tl.tensor,
    input_ids_ptr: tl.tensor,
    logits_indices_ptr: tl.tensor,
    out_ptr: tl.tensor,
    out_stride: int,
    num_out_ptr: tl.tensor,
    S: int,
    BLOCK_S: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    r0, count, num_drafts = request_logits_rows(cu_num_logits_ptr, b, S)
    j = tl.arange(0, BLOCK_S)
    is_draft = j < num_drafts
    # Every load is issued before any result is needed: three dependent round trips in all.
    tgt = tl.load(target_ptr + r0 + j, mask=(j <= num_drafts) & (count > 0), other=-1)
    tok_idx = tl.load(logits_indices_ptr + r0 + j, mask=is_draft, other=0).to(tl.int64)
    draft = tl.load(input_ids_ptr + tok_idx + 1, mask=is_draft, other=0).to(tl.int64)
    mismatch = is_draft & (tgt != draft)
    accepted = tl.min(tl.where(mismatch, j.to(tl.int64), num_drafts), 0)
    keep = (j <= accepted) & (count > 0)
    tl.store(out_ptr + b.to(tl.int64) * out_stride + j, tl.where(keep, tgt, -1), mask=j < S)
    tl.store(num_out_ptr + b, tl.where(count > 0, accepted + 1, 0).to(tl.int32))


def check_rejection_args(
    target: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
) -> None:
    """The shapes every rejection op takes (strict and probabilistic): ``target`` 1-D,
    ``cu_num_logits`` ``[>= num_reqs + 1]``, ``out`` ``[>= num_reqs, >= 1]``..."""
    check_1d("target", target, 0)
    check_1d("cu_num_logits", cu_num_logits, num_reqs + 1)
    check_1d("input_ids", input_ids, 0)
    check_1d("logits_indices", logits_indices, 0)
    check_1d("num_out", num_out, num_reqs)
    check_rows("out", out, num_reqs, 1)


def strict_rejection_ref(
    target: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
) -> None:
    """Plain-torch specification of :func:`strict_rejection` (same arguments, same effect)."""
    check_rejection_args(target, cu_num_logits, input_ids, logits_indices, num_reqs, out, num_out)
    if num_reqs == 0:
        return
    dev, width = out.device, out.shape[1]
    cu = cu_num_logits[: num_reqs + 1].to(device=dev, dtype=torch.int64)
    r0, count = cu[:-1], cu[1:] - cu[:-1]
    num_drafts = (count - 1).clamp(min=0, max=width - 1)
    j = torch.arange(width, device=dev, dtype=torch.int64)
    has_row = (j[None, :] <= num_drafts[:, None]) & (count[:, None] > 0)  # [B, S]
    is_draft = j[None, :] < num_drafts[:, None]
    rows = torch.where(has_row, r0[:, None] + j[None, :], 0)
    tgt = target.to(dev)[rows] if target.numel() else torch.full_like(rows, -1)
    draft = torch.zeros_like(tgt)
    if is_draft.any():  # (index 0 of empty tensors otherwise)
        tok_idx = logits_indices.to(dev)[torch.where(is_draft, rows, 0)].to(torch.int64)
        draft = input_ids.to(dev)[torch.where(is_draft, tok_idx + 1, 0)].to(torch.int64)
    mismatch = is_draft & (tgt != draft)
    accepted = torch.where(mismatch, j[None, :], num_drafts[:, None]).amin(dim=1)
    keep = (j[None, :] <= accepted[:, None]) & (count[:, None] > 0)
    out[:num_reqs] = torch.where(keep, tgt, -1).to(out.dtype)
    num_out[:num_reqs] = torch.where(count > 0, accepted + 1, 0).to(num_out.dtype)


def strict_rejection_triton(
    target: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
) -> None:
    """Triton implementation of :func:`strict_rejection`: one program per request.

    A program checks its request's drafts as one vector of ``next_power_of_2(S)`` lanes;
    ``num_reqs`` only sizes the grid.
    """
    check_rejection_args(target, cu_num_logits, input_ids, logits_indices, num_reqs, out, num_out)
    if num_reqs == 0:
        return
    width = out.shape[1]
    _strict_rejection_kernel[(num_reqs,)](
        target,
        cu_num_logits,
        input_ids,
        logits_indices,
        out,
        out.stride(0),
        num_out,
        width,
        BLOCK_S=next_power_of_2(width),
    )


def strict_rejection(
    target: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
) -> None:
    """Verify each request's drafts against the target model's samples, in place.

    Args:
        target: ``[>= N]`` int64, the target model's sampled token for each logits row.
        cu_num_logits: ``[>= B + 1]`` int32, exclusive prefix sum of logits rows per request:
            request ``b`` owns rows ``r0 = cu_num_logits[b]`` to ``r1 = cu_num_logits[b + 1]``
            (possibly none), ``s_b = max(r1 - r0 - 1, 0)`` of them check drafts.
        input_ids: ``[T]`` int, the step's flat query tokens.
        logits_indices: ``[>= N]`` int, the query token each logits row was computed at; the
            draft checked by row ``r0 + j`` (``j < s_b``) is the query token after it,
            ``d_j = input_ids[logits_indices[r0 + j] + 1]``.
        num_reqs: number of requests ``B``.
        out: out ``[>= B, S]`` int64 (rows contiguous): row ``b`` gets
            ``target[r0 .. r0 + m]`` (``m + 1`` tokens), then ``-1`` to the end of the row.
        num_out: out ``[>= B]`` int32, ``m + 1``; ``0`` for a request without logits rows
            (its ``out`` row is all ``-1``).

    ``m`` is the number of accepted drafts: the largest ``m <= s_b`` with
    ``target[r0 + j] == d_j`` for all ``j < m``. A request must own at most ``S`` rows; were
    it more, only its first ``S - 1`` drafts would be checked. Rows ``>= B`` are untouched.
    Runs :func:`strict_rejection_triton` when :func:`use_triton` (on ``out``) says so, else
    :func:`strict_rejection_ref`.
    """
    impl = strict_rejection_triton if use_triton(out) else strict_rejection_ref
    impl(target, cu_num_logits, input_ids, logits_indices, num_reqs, out, num_out)


# --------------------------------------------------------------------------------------------
# ngram_propose
# --------------------------------------------------------------------------------------------


@triton.jit
def _ngram_propose_kernel(
    token_ids_ptr: tl.tensor,
    token_ids_stride: int,
    max_model_len: int,
    num_tokens_ptr: tl.tensor,
    idx_mapping_ptr: tl.tensor,
    num_sampled_ptr: tl.tensor,
    num_found_ptr: tl.tensor,
    k: int,
    min_n: int,
    max_n: int,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    i = tl.program_id(0)
    if tl.load(num_sampled_ptr + i) <= 0:
        tl.store(num_found_ptr + i, 0)
        return
    row = tl.load(idx_mapping_ptr + i).to(tl.int64)
    seq_ptr = token_ids_ptr + row * token_ids_stride
    T = tl.load(num_tokens_ptr + row).to(tl.int32)
    offs = tl.arange(0, BLOCK_E)
    # Best candidate so far as one key, (len << 32) | e: the maximum is the longest match, then
    # the most recent end. -1: none with len >= min_n yet.
    best = tl.full([], -1, tl.int64)
    for e0 in range(1, T, BLOCK_E):
        e = e0 + offs
        alive = e < T
        length = tl.zeros([BLOCK_E], dtype=tl.int32)
        for j in range(1, max_n + 1):
            ok = alive & (e >= j)
            tail = tl.load(seq_ptr + T - j, mask=j <= T, other=0)
            cand = tl.load(seq_ptr + e - j, mask=ok, other=0)
            alive = ok & (cand == tail)
            length += alive.to(tl.int32)
        key = (length.to(tl.int64) << 32) | e.to(tl.int64)
        key = tl.where((e < T) & (length >= min_n), key, -1)
        best = tl.maximum(best, tl.max(key, 0))
    found = best >= 0
    start = (best - ((best >> 32) << 32)).to(tl.int32)
    period = tl.where(found, T - start, 1)
    jk = tl.arange(0, BLOCK_K)
    src = tl.where(found, start + jk % period, tl.maximum(T - 1, 0))  # T = 0: no row -1
    drafts = tl.load(seq_ptr + src, mask=jk < k, other=0)
    dst = T + jk
    tl.store(seq_ptr + dst, drafts, mask=(jk < k) & (dst < max_model_len))
    tl.store(num_found_ptr + i, tl.where(found, k, 0).to(tl.int32))


def _check_ngram_args(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_sampled: torch.Tensor,
    num_reqs: int,
    k: int,
    min_n: int,
    max_n: int,
    num_found: torch.Tensor,
) -> None:
    check_rows("token_ids", token_ids)
    check_1d("num_tokens", num_tokens, 0)
    check_1d("idx_mapping", idx_mapping, num_reqs)
    check_1d("num_sampled", num_sampled, num_reqs)
    check_1d("num_found", num_found, num_reqs)
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got {k=}, {min_n=}, {max_n=}")


def ngram_propose_ref(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_sampled: torch.Tensor,
    num_reqs: int,
    k: int,
    min_n: int,
    max_n: int,
    num_found: torch.Tensor,
) -> None:
    """Plain-torch specification of :func:`ngram_propose` (same arguments, same effect).

    All candidate ends of all requests at once: ``[B, L]`` match lengths built over
    ``j = 1..max_n``.
    """
    _check_ngram_args(
        token_ids, num_tokens, idx_mapping, num_sampled, num_reqs, k, min_n, max_n, num_found
    )
    if num_reqs == 0:
        return
    dev, width = token_ids.device, token_ids.shape[1]
    rows = idx_mapping[:num_reqs].to(device=dev, dtype=torch.int64)
    active = num_sampled[:num_reqs].to(dev) > 0
    seqs = token_ids[rows]  # [B, L]
    seq_len = num_tokens[rows].to(torch.int64)  # T per request
    e = torch.arange(width, device=dev, dtype=torch.int64)
    candidate = (e[None, :] >= 1) & (e[None, :] < seq_len[:, None])
    alive = candidate
    length = torch.zeros_like(seqs, dtype=torch.int64)
    for j in range(1, max_n + 1):
        alive = alive & (e[None, :] >= j)
        cand = seqs.gather(1, (e - j).clamp(min=0)[None, :].expand_as(seqs))
        tail = seqs.gather(1, (seq_len - j).clamp(min=0)[:, None])
        alive = alive & (cand == tail)
        length += alive.to(torch.int64)
    key = torch.where(candidate & (length >= min_n), length * width + e[None, :], -1)
    best = key.amax(dim=1)
    found = best >= 0
    start = torch.where(found, best % width, 0)
    period = torch.where(found, seq_len - start, 1)
    jk = torch.arange(k, device=dev, dtype=torch.int64)
    src = torch.where(  # (clamped: an inactive row, a graph's padding, may be empty)
        found[:, None], start[:, None] + jk[None, :] % period[:, None],
        (seq_len[:, None] - 1).clamp(min=0),
    )
    drafts = seqs.gather(1, src)  # [B, k]
    dst = seq_len[:, None] + jk[None, :]
    write = active[:, None] & (dst < width)
    token_ids[rows[:, None].expand_as(dst)[write], dst[write]] = drafts[write]
    num_found[:num_reqs] = torch.where(active & found, k, 0).to(num_found.dtype)


def ngram_propose_triton(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_sampled: torch.Tensor,
    num_reqs: int,
    k: int,
    min_n: int,
    max_n: int,
    num_found: torch.Tensor,
    block_e: int | None = None,
) -> None:
    """Triton implementation of :func:`ngram_propose`: one program per request.

    A program scans its candidate ends in ``block_e`` tiles (``T`` is read on the device), each
    tile comparing ``j = 1..max_n`` tokens back, and keeps the best ``(len, e)`` as one packed
    key. ``num_reqs`` only sizes the grid; ``k``, ``min_n`` and ``max_n`` are configuration.
    """
    _check_ngram_args(
        token_ids, num_tokens, idx_mapping, num_sampled, num_reqs, k, min_n, max_n, num_found
    )
    if num_reqs == 0:
        return
    be = default_block(token_ids, cuda=256, cpu=32, block=block_e)
    _ngram_propose_kernel[(num_reqs,)](
        token_ids,
        token_ids.stride(0),
        token_ids.shape[1],
        num_tokens,
        idx_mapping,
        num_sampled,
        num_found,
        k,
        min_n,
        max_n,
        BLOCK_E=be,
        BLOCK_K=next_power_of_2(k),
    )


def ngram_propose(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_sampled: torch.Tensor,
    num_reqs: int,
    k: int,
    min_n: int,
    max_n: int,
    num_found: torch.Tensor,
) -> None:
    """Propose ``k`` draft tokens per request by n-gram lookup in its own tokens, in place.

    Args:
        token_ids: ``[R, L]`` int32 state table (rows contiguous); drafts are written at
            ``token_ids[row, T + j]`` for ``j < k`` where ``T + j < L``.
        num_tokens: ``[R]`` int32, known tokens ``T >= 1`` per row (not changed).
        idx_mapping: ``[>= B]`` int, batch position -> row (distinct rows).
        num_sampled: ``[>= B]`` int32, tokens request ``i`` produced this step; requests with
            ``0`` (mid-prompt chunks) propose nothing: their row is untouched.
        num_reqs: number of requests ``B``.
        k: drafts per request (``>= 1``).
        min_n: shortest match that counts (``>= 1``).
        max_n: longest match compared (``>= min_n``).
        num_found: out ``[>= B]`` int32, ``k`` when a match was found, else ``0``.

    The match, tie-breaking and period rule are in the module docstring. Runs
    :func:`ngram_propose_triton` when :func:`use_triton` (on ``token_ids``) says so, else
    :func:`ngram_propose_ref`.
    """
    impl = ngram_propose_triton if use_triton(token_ids) else ngram_propose_ref
    impl(token_ids, num_tokens, idx_mapping, num_sampled, num_reqs, k, min_n, max_n, num_found)


# --------------------------------------------------------------------------------------------
# write_drafts
# --------------------------------------------------------------------------------------------


@triton.jit
def _write_drafts_kernel(
    token_ids_ptr: tl.tensor,
    row_stride: int,
    rows_ptr: tl.tensor,
    pos_ptr: tl.tensor,
    drafts_ptr: tl.tensor,
    valid_ptr: tl.tensor,
    n: int,
    BLOCK: tl.constexpr,
) -> None:
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    valid = tl.load(valid_ptr + i, mask=inside, other=0) != 0
    row = tl.load(rows_ptr + i, mask=valid, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + i, mask=valid, other=0).to(tl.int64)
    draft = tl.load(drafts_ptr + i, mask=valid, other=0)
    tl.store(token_ids_ptr + row * row_stride + pos,
             draft.to(token_ids_ptr.dtype.element_ty), mask=valid)


def _check_write_drafts(token_ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                        drafts: torch.Tensor, valid: torch.Tensor) -> int:
    if token_ids.dim() != 2 or token_ids.stride(1) != 1:
        raise ValueError(
            f"token_ids must be [R, L] with contiguous rows, got {tuple(token_ids.shape)}"
        )
    n = rows.shape[0]
    for name, t in (("rows", rows), ("pos", pos), ("drafts", drafts), ("valid", valid)):
        if t.dim() != 1 or t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{n}], got {tuple(t.shape)}")
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool, got {valid.dtype}")
    return n


def write_drafts_ref(token_ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                     drafts: torch.Tensor, valid: torch.Tensor) -> None:
    """Plain-torch reference of :func:`write_drafts` (selects the valid entries: syncs)."""
    _check_write_drafts(token_ids, rows, pos, drafts, valid)
    keep = valid.nonzero().squeeze(1)
    token_ids[rows[keep].long(), pos[keep].long()] = drafts[keep].to(token_ids.dtype)


def write_drafts_triton(token_ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                        drafts: torch.Tensor, valid: torch.Tensor,
                        block: int | None = None) -> None:
    """Triton implementation of :func:`write_drafts`: masked stores, ``block`` requests per
    program."""
    n = _check_write_drafts(token_ids, rows, pos, drafts, valid)
    if n == 0:
        return
    size = default_block(token_ids, 256, 32, block)
    _write_drafts_kernel[(cdiv(n, size),)](
        token_ids, token_ids.stride(0), rows, pos, drafts, valid, n, BLOCK=size,
    )


def write_drafts(token_ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                 drafts: torch.Tensor, valid: torch.Tensor) -> None:
    """``token_ids[rows[i], pos[i]] = drafts[i]`` for every ``i`` with ``valid[i]``, in place;
    nothing else is touched.

    Args:
        token_ids: ``[R, L]`` state-table token rows (rows contiguous).
        rows, pos: ``[n]`` int, where entry ``i`` goes (distinct among the valid entries; the
            invalid ones may hold anything, they are not read as addresses).
        drafts: ``[n]`` int, the values (cast to ``token_ids``' dtype).
        valid: ``[n]`` bool.
    """
    impl = write_drafts_triton if use_triton(token_ids) else write_drafts_ref
    impl(token_ids, rows, pos, drafts, valid)
