"""Probabilistic rejection sampling for speculative decoding (Leviathan et al. 2023, Chen et
al. 2023), on the device.

A request with ``k`` drafts owns ``k + 1`` logits rows ``r0 .. r0 + k``; row ``r0 + j``
predicts the token after the request's ``j``-th query token, and the draft it checks
(``j < k``) is the query token right after that one, ``d_j = input_ids[logits_indices[r0 + j]
+ 1]`` (as in :func:`mrv2_kernels.spec_decode.strict_rejection`). With
``p_j = softmax(logits[r0 + j] / T)`` the target's distribution and ``q_j`` the drafter's
(one-hot at ``d_j`` when ``draft_probs`` is None: n-gram / prompt-lookup drafts):

- draft ``j`` is accepted iff every earlier one was and ``u_j * q_j(d_j) < p_j(d_j)``
  (``u_j < p_j(d_j) / q_j(d_j)``);
- at the first rejected ``j`` the request emits a sample of the residual
  ``normalize(max(p_j - q_j, 0))`` and stops; when all ``k`` are accepted it emits the
  sampler's own bonus sample ``target_sampled[r0 + k]``.

Every emitted token is then distributed exactly as the target's own sample given the tokens
before it, whatever ``q`` is. Greedy rows (``T < 1e-5``) keep the strict semantics: accept
while ``d_j == target_sampled[r0 + j]`` (the argmax), emit ``target_sampled`` at the first
mismatch.

Noise contract (do not change without versioning it; it extends :mod:`mrv2_kernels.gumbel`,
whose row key ``key = row_key(seed, position)`` and per-index uniform ``u(key, v)`` it uses,
with the ``(seed, position)`` of the row being verified, the same keys the sampler drew that
row's Gumbel sample with):

- acceptance uniform: ``u_j = u(key, ACCEPT_INDEX)`` with ``ACCEPT_INDEX = 2**31 - 1``, the
  hash at a vocab index that no vocabulary reaches (the Gumbel noise only uses ``v < V``), so
  it is independent of the row's Gumbel noise (:func:`acceptance_uniform_ref`);
- residual sample: Gumbel-max with the row's own noise ``g(v) = -log(-log(u(key, v)))``.
  For a full ``q``: ``argmax_v log(max(e(v) - q(v) * s, 0)) + g(v)`` with ``x = logits / T``
  (IEEE division), ``m = max x``, ``e = exp(x - m)``, ``s = sum e`` (``p = e / s``; the
  common factor ``s`` does not move the argmax). For one-hot ``q``:
  ``argmax_{v != d_j} x(v) + g(v)``, the sampler's own Gumbel sample with ``d_j`` excluded, so
  a rejected row whose target sample differs from its draft emits exactly that sample.
  Ties go to the smallest index; a residual that is zero everywhere (``p == q`` up to
  rounding: a rejection of probability zero) emits ``target_sampled`` of the row;
- the acceptance test is evaluated as ``u_j * q_j(d_j) * s < e(d_j)`` (left to right).

The drafter must draw ``d_j`` with randomness independent of these streams (a drafter that
reused the target's ``(seed, position)`` Gumbel noise would correlate ``d_j`` with the residual
sample and bias it). The reference and the Triton kernel agree token for token except where
two candidates are within fp32 rounding of each other (``s`` is summed in a different order).

Rows with every logit ``-inf`` are outside the contract. A draft token outside ``[0, V)`` has
``p = q = 0`` and is rejected. ``draft_probs`` rows of bonus rows and of greedy rows are never
read.
"""

import torch
import triton
import triton.language as tl

from ._backend import default_block, next_power_of_2, use_triton
from ._checks import check_1d, check_rows
from .gumbel import gumbel_noise_ref, hash_row_key, hash_uniform, mix32_ref, row_key_ref
from .spec_decode import check_rejection_args, request_logits_rows

__all__ = [
    "ACCEPT_INDEX",
    "GREEDY_TEMPERATURE",
    "acceptance_uniform_ref",
    "probabilistic_rejection",
    "probabilistic_rejection_ref",
    "probabilistic_rejection_triton",
]

#: Vocab index of the acceptance uniform in the row's hash stream (outside every vocabulary).
ACCEPT_INDEX = 2**31 - 1
#: Rows whose temperature is below this are greedy.
GREEDY_TEMPERATURE = 1e-5

_MASK32 = 0xFFFFFFFF
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


def _uniform_at_ref(seeds: torch.Tensor, positions: torch.Tensor, index: int) -> torch.Tensor:
    """The gumbel module's uniform ``u(row_key(seed, position), index)``, float32 ``[N]``."""
    key = row_key_ref(seeds, positions)
    h = mix32_ref((mix32_ref(key ^ index) + key) & _MASK32)
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


def acceptance_uniform_ref(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The acceptance uniform ``u`` of each row (float32 ``[N]``): ``u(key, ACCEPT_INDEX)``."""
    return _uniform_at_ref(seeds, positions, ACCEPT_INDEX)


# --------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------


@triton.jit
def _verify_row_kernel(
    logits_ptr: tl.tensor,
    logits_stride: int,
    vocab_size: int,
    temperature_ptr: tl.tensor,
    seeds_ptr: tl.tensor,
    positions_ptr: tl.tensor,
    target_ptr: tl.tensor,
    cu_num_logits_ptr: tl.tensor,
    input_ids_ptr: tl.tensor,
    logits_indices_ptr: tl.tensor,
    q_ptr: tl.tensor,
    q_stride: int,
    out_ptr: tl.tensor,
    out_stride: int,
    S: int,
    BLOCK_V: tl.constexpr,
    HAS_Q: tl.constexpr,
) -> None:
    # Program (b, j) verifies draft j of request b and writes out[b, j]: the draft when it is
    # accepted, else -2 - (the token to emit there); the assembly kernel decodes it.
    b = tl.program_id(0)
    j = tl.program_id(1)
    r0, count, num_drafts = request_logits_rows(cu_num_logits_ptr, b, S)
    if j >= num_drafts:
        return
    r = r0 + j
    tok_idx = tl.load(logits_indices_ptr + r).to(tl.int64)
    d = tl.load(input_ids_ptr + tok_idx + 1).to(tl.int64)
    target = tl.load(target_ptr + r).to(tl.int64)
    temperature = tl.load(temperature_ptr + r).to(tl.float32)
    acc = (d == target).to(tl.int32)  # greedy: the strict test
    tok = target
    if temperature >= 1e-5:
        row_ptr = logits_ptr + r * logits_stride
        offs = tl.arange(0, BLOCK_V)
        # Online max / sum of exp per lane, folded at the end.
        m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s_vec = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            v = v0 + offs
            x = tl.load(row_ptr + v, mask=v < vocab_size, other=float("-inf")).to(tl.float32)
            x = tl.div_rn(x, temperature)
            m_new = tl.maximum(m_vec, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
            m_vec = m_new
        m = tl.max(m_vec, axis=0)
        s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
        valid = (d >= 0) & (d < vocab_size)
        d_safe = tl.where(valid, d, 0)
        x_d = tl.load(row_ptr + d_safe, mask=valid, other=float("-inf")).to(tl.float32)
        e_d = tl.exp(tl.div_rn(x_d, temperature) - m)
        q_row = q_ptr + r * q_stride
        q_d = tl.full([], 1.0, tl.float32)
        if HAS_Q:
            q_d = tl.load(q_row + d_safe, mask=valid, other=0.0).to(tl.float32)
        key = hash_row_key(tl.load(seeds_ptr + r), tl.load(positions_ptr + r))
        u = hash_uniform(key, tl.full([], 2147483647, tl.int32))
        acc = (u * q_d * s < e_d).to(tl.int32)
        if acc == 0:
            best_val = tl.full([], float("-inf"), tl.float32)
            best_idx = tl.full([], 0, tl.int32)
            for v0 in range(0, vocab_size, BLOCK_V):
                v = v0 + offs
                mask = v < vocab_size
                x = tl.load(row_ptr + v, mask=mask, other=float("-inf")).to(tl.float32)
                x = tl.div_rn(x, temperature)
                g = -tl.log(-tl.log(hash_uniform(key, v)))
                if HAS_Q:
                    q = tl.load(q_row + v, mask=mask, other=0.0).to(tl.float32)
                    res = tl.exp(x - m) - q * s
                    # (the inner select keeps log's argument positive: no spurious NaN/-inf)
                    val = tl.where(res > 0, tl.log(tl.where(res > 0, res, 1.0)), float("-inf")) + g
                else:
                    val = tl.where(v == d, float("-inf"), x + g)
                tile_max = tl.max(val, axis=0)
                tile_idx = tl.min(tl.where(val == tile_max, v, vocab_size), axis=0)
                better = tile_max > best_val
                best_idx = tl.where(better, tile_idx, best_idx)
                best_val = tl.where(better, tile_max, best_val)
            tok = tl.where(best_val == float("-inf"), target, best_idx.to(tl.int64))
    enc = tl.where(acc != 0, d, -2 - tok)
    tl.store(out_ptr + b.to(tl.int64) * out_stride + j, enc)


@triton.jit
def _assemble_kernel(
    target_ptr: tl.tensor,
    cu_num_logits_ptr: tl.tensor,
    out_ptr: tl.tensor,
    out_stride: int,
    num_out_ptr: tl.tensor,
    S: int,
    BLOCK_S: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    r0, count, num_drafts = request_logits_rows(cu_num_logits_ptr, b, S)
    j = tl.arange(0, BLOCK_S).to(tl.int64)
    is_draft = j < num_drafts
    row_ptr = out_ptr + b.to(tl.int64) * out_stride
    enc = tl.load(row_ptr + j, mask=is_draft, other=0)
    rejected = is_draft & (enc < 0)
    accepted = tl.min(tl.where(rejected, j, num_drafts), 0)
    tok = tl.where(enc < 0, -2 - enc, enc)
    bonus = tl.load(target_ptr + r0 + num_drafts, mask=count > 0, other=-1).to(tl.int64)
    val = tl.where(is_draft, tok, bonus)
    keep = (j <= accepted) & (count > 0)
    tl.store(row_ptr + j, tl.where(keep, val, -1), mask=j < S)
    tl.store(num_out_ptr + b, tl.where(count > 0, accepted + 1, 0))


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {t.dtype}")


def _check_args(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    target_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    check_rows("logits", logits, 0, 1)
    _check_dtype("logits", logits, _FLOATS)
    n, vocab = logits.shape
    if num_reqs < 0:
        raise ValueError(f"num_reqs must be >= 0, got {num_reqs}")
    check_1d("temperature", temperature, n)
    _check_dtype("temperature", temperature, (torch.float32,))
    for name, t in (("seeds", seeds), ("positions", positions),
                    ("target_sampled", target_sampled)):
        check_1d(name, t, n)
        _check_dtype(name, t, (torch.int64,))
    check_rejection_args(target_sampled, cu_num_logits, input_ids, logits_indices, num_reqs,
                         out, num_out)
    for name, t in (("cu_num_logits", cu_num_logits), ("input_ids", input_ids),
                    ("logits_indices", logits_indices), ("num_out", num_out)):
        _check_dtype(name, t, _INTS)
    _check_dtype("out", out, (torch.int64,))
    if draft_probs is not None:
        check_rows("draft_probs", draft_probs, n)
        _check_dtype("draft_probs", draft_probs, (torch.float32,))
        if draft_probs.shape[1] != vocab:
            raise ValueError(
                f"draft_probs must have {vocab} columns (logits'), got {draft_probs.shape[1]}"
            )


def _verify_rows_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    target: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``D`` draft rows at once: (accepted ``[D]`` bool, token to emit if rejected)."""
    vocab = logits.shape[1]
    greedy = temperature < GREEDY_TEMPERATURE
    x = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    m = x.amax(dim=1, keepdim=True)
    e = torch.exp(x - m)
    s = e.sum(dim=1)
    valid = (drafts >= 0) & (drafts < vocab)
    d_safe = torch.where(valid, drafts, 0)[:, None]
    e_d = torch.where(valid, e.gather(1, d_safe)[:, 0], 0.0)
    q_d = torch.ones_like(s) if q is None else torch.where(valid, q.gather(1, d_safe)[:, 0], 0.0)
    u = acceptance_uniform_ref(seeds, positions)
    accepted = u * q_d * s < e_d
    g = gumbel_noise_ref(seeds, positions, vocab)
    if q is None:
        v = torch.arange(vocab, device=x.device)
        val = torch.where(v[None, :] == drafts[:, None], float("-inf"), x + g)
    else:
        val = torch.log(torch.clamp(e - q.float() * s[:, None], min=0.0)) + g
    residual = torch.where(val.amax(dim=1) == float("-inf"), target, val.argmax(dim=1))
    accepted = torch.where(greedy, drafts == target, accepted)
    return accepted, torch.where(greedy, target, residual)


def probabilistic_rejection_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    target_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> None:
    """Plain-torch specification of :func:`probabilistic_rejection` (same arguments, same
    effect). Verifies all draft rows of all requests at once (``[D, V]`` copies)."""
    _check_args(logits, temperature, seeds, positions, target_sampled, cu_num_logits,
                input_ids, logits_indices, num_reqs, out, num_out, draft_probs)
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
    n = logits.shape[0]
    tgt = target_sampled[:n][rows] if n else torch.full_like(rows, -1)
    accepted = torch.ones_like(is_draft)
    tok = torch.zeros_like(rows)
    if is_draft.any():
        dr = rows[is_draft]
        drafts = input_ids[logits_indices[dr].to(torch.int64) + 1].to(torch.int64)
        q = None if draft_probs is None else draft_probs[dr]
        acc, residual = _verify_rows_ref(logits[dr], temperature[dr], seeds[dr], positions[dr],
                                         target_sampled[dr], drafts, q)
        accepted[is_draft] = acc
        tok[is_draft] = torch.where(acc, drafts, residual)
    first_reject = torch.where(is_draft & ~accepted, j[None, :], num_drafts[:, None]).amin(dim=1)
    bonus = tgt.gather(1, num_drafts[:, None])
    val = torch.where(is_draft, tok, bonus)
    keep = (j[None, :] <= first_reject[:, None]) & (count[:, None] > 0)
    out[:num_reqs] = torch.where(keep, val, -1)
    num_out[:num_reqs] = torch.where(count > 0, first_reject + 1, 0).to(num_out.dtype)


def probabilistic_rejection_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    target_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    block_v: int | None = None,
) -> None:
    """Triton implementation of :func:`probabilistic_rejection`: two launches.

    1. Grid ``(num_reqs, S - 1)``: program ``(b, j)`` verifies draft ``j`` of request ``b``
       (it exits at once past the request's drafts). A sampled row walks its vocabulary in
       ``block_v`` tiles once for the max and sum of exp, reads ``p(d)`` and ``q(d)``, and
       walks it a second time, for the residual argmax, only when the draft is rejected.
       It writes its verdict into ``out[b, j]`` (the draft, or ``-2 - token``).
    2. Grid ``(num_reqs,)``: decodes the verdicts, cuts at the first rejection and appends the
       bonus token, like :func:`~mrv2_kernels.spec_decode.strict_rejection`.

    No scratch buffers, no host synchronization; grid sizes depend only on ``num_reqs`` and
    ``out``'s width, so the op can be captured in a CUDA graph. Nothing of ``[N, V]`` is
    copied, and only draft rows are read in full.
    """
    _check_args(logits, temperature, seeds, positions, target_sampled, cu_num_logits,
                input_ids, logits_indices, num_reqs, out, num_out, draft_probs)
    if num_reqs == 0:
        return
    width = out.shape[1]
    bv = default_block(logits, cuda=1024, cpu=128, block=block_v)
    if width > 1:
        q = draft_probs if draft_probs is not None else logits
        _verify_row_kernel[(num_reqs, width - 1)](
            logits,
            logits.stride(0),
            logits.shape[1],
            temperature,
            seeds,
            positions,
            target_sampled,
            cu_num_logits,
            input_ids,
            logits_indices,
            q,
            q.stride(0),
            out,
            out.stride(0),
            width,
            BLOCK_V=bv,
            HAS_Q=draft_probs is not None,
        )
    _assemble_kernel[(num_reqs,)](
        target_sampled,
        cu_num_logits,
        out,
        out.stride(0),
        num_out,
        width,
        BLOCK_S=next_power_of_2(width),
    )


def probabilistic_rejection(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    target_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    num_reqs: int,
    out: torch.Tensor,
    num_out: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> None:
    """Verify each request's drafts by probabilistic rejection sampling, in place.

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16 (rows contiguous), the target's processed logits per
            logits row (penalties and masks applied, ``-inf`` for excluded tokens), not yet
            divided by the temperature.
        temperature: ``[>= N]`` float32 per row; below ``1e-5``: a greedy row.
        seeds: ``[>= N]`` int64, positions: ``[>= N]`` int64: the noise keys of each row, the
            ones the sampler drew its Gumbel sample for that row with.
        target_sampled: ``[>= N]`` int64, the sampler's own sample at each row (the bonus
            token, and the greedy rows' argmax).
        cu_num_logits: ``[>= B + 1]`` int, exclusive prefix sum of logits rows per request:
            request ``b`` owns rows ``r0 = cu_num_logits[b]`` to ``cu_num_logits[b + 1]``;
            all but the last check a draft.
        input_ids: ``[T]`` int, the step's flat query tokens.
        logits_indices: ``[>= N]`` int, the query token each logits row was computed at; the
            draft checked by row ``r0 + j`` is ``d_j = input_ids[logits_indices[r0 + j] + 1]``.
        num_reqs: number of requests ``B``.
        out: out ``[>= B, S]`` int64 (rows contiguous): the accepted drafts, then the token
            emitted at the first rejection (or the bonus token), then ``-1``.
        num_out: out ``[>= B]`` int, the number of tokens in ``out[b]``: accepted drafts + 1,
            or ``0`` for a request without logits rows.
        draft_probs: None for deterministic drafts (``q`` one-hot at the draft), else
            ``[>= N, V]`` float32 whose row ``r0 + j`` is the distribution ``d_j`` was drawn
            from.

    The acceptance rule, the residual and the noise they use are in the module docstring. A
    request must own at most ``S`` rows (past that only its first ``S - 1`` drafts are
    checked). Rows ``>= B`` of ``out`` and ``num_out`` are untouched. Runs
    :func:`probabilistic_rejection_triton` when :func:`use_triton` (on ``logits``) says so,
    else :func:`probabilistic_rejection_ref`.
    """
    impl = probabilistic_rejection_triton if use_triton(logits) else probabilistic_rejection_ref
    impl(logits, temperature, seeds, positions, target_sampled, cu_num_logits, input_ids,
         logits_indices, num_reqs, out, num_out, draft_probs)
