"""The rarely-used per-request logit edits: logit bias, allowed tokens, bad words, min_tokens,
structured outputs' allowed-token bitmasks.

Which requests need them is known on the CPU (their params); for those few requests a small
index tensor is built on the CPU and one or two device ops apply the edit to the whole batch.
Conditions that depend on generated tokens (bad-word prefixes, the output length for
``min_tokens``) are evaluated on the device from the state table, so no sampled token has to
reach the CPU first.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.contract.params import SamplingParams
from mrv2.contract.staging import to_device
from mrv2.contract.state_table import RequestStateTable
from mrv2.sample.state import SamplingState
from mrv2_kernels.token_bitmask import apply_token_bitmask as apply_bitmask_kernel

_NEG_INF = float("-inf")


def apply_masks(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    table: RequestStateTable,
    state: SamplingState,
    special: list[tuple[int, SamplingParams]],
    positions: torch.Tensor | None = None,
) -> None:
    """Apply bias, allowed tokens, bad words and min_tokens of ``special`` rows, in place
    (structured outputs' masks: :func:`apply_token_bitmask`).

    ``special`` lists ``(logits row, params)`` of the rows whose request uses some rarely
    used stage; ``logits`` is ``[N, V]`` float32, ``idx_mapping`` ``[N]`` the state-table row of
    each logits row. ``positions`` (``InputBatch.logits_positions``): the position each row
    predicts, so ``min_tokens`` and bad words count the outputs before a draft row's token too
    (without it, the request's known tokens: one row a request).
    """
    bias_b: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    allowed: list[tuple[int, list[int]]] = []
    cond_b: list[int] = []  # (row, token, kind) edits masked on a device-side condition
    cond_t: list[int] = []
    words: list[tuple[int, list[int]]] = []
    min_b: list[int] = []
    min_t: list[int] = []
    for b, p in special:
        if p.logit_bias:
            for token, value in p.logit_bias.items():
                bias_b.append(b)
                bias_t.append(token)
                bias_v.append(float(value))
        if p.allowed_token_ids:
            allowed.append((b, p.allowed_token_ids))
        for word in p._bad_words_token_ids:
            if len(word) == 1:
                cond_b.append(b)
                cond_t.append(word[0])
            else:
                words.append((b, word))
        if p.min_tokens > 0:
            for token in {*p._eos_token_ids, *(p.stop_token_ids or ())}:
                min_b.append(b)
                min_t.append(token)
    device = logits.device
    vocab = logits.shape[1]
    if bias_b:
        logits.index_put_((_t(bias_b, device), _t(bias_t, device)),
                          to_device(bias_v, torch.float32, device),
                          accumulate=True)
    if allowed:
        rows = _t([b for b, _ in allowed], device)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
        local = [i for i, (_, toks) in enumerate(allowed) for _ in toks]
        toks = [t for _, ts in allowed for t in ts]
        _fill(keep, (_t(local, device), _t(toks, device)), True)
        logits[rows] = logits[rows].masked_fill(~keep, _NEG_INF)
    if cond_b:
        _fill(logits, (_t(cond_b, device), _t(cond_t, device)), _NEG_INF)
    if words:
        _ban_bad_words(logits, idx_mapping, table, state, words, positions)
    if min_b:
        batch_idx = _t(min_b, device)
        rows = idx_mapping[batch_idx].long()
        known = table.num_tokens[rows] if positions is None else positions[batch_idx]
        num_out = known - state.prompt_len[rows]
        add = torch.where(num_out < state.min_tokens[rows], _NEG_INF, 0.0)
        logits.index_put_((batch_idx, _t(min_t, device)), add, accumulate=True)


def _ban_bad_words(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    table: RequestStateTable,
    state: SamplingState,
    words: list[tuple[int, list[int]]],
    positions: torch.Tensor | None = None,
) -> None:
    """Ban each word's last token where its other tokens end the row's generated output: the
    tokens before the position the row predicts (``positions``; a draft row's drafts before
    it lie there in the state table, where the drafter wrote them), else the request's known
    tokens."""
    device = logits.device
    longest = max(len(w) for _, w in words) - 1
    prefix = torch.full((len(words), longest), -1, dtype=torch.int64)
    for i, (_, word) in enumerate(words):
        prefix[i, : len(word) - 1] = torch.tensor(word[:-1])
    plen = _t([len(w) - 1 for _, w in words], device)
    b = _t([bb for bb, _ in words], device)
    last = _t([w[-1] for _, w in words], device)
    rows = idx_mapping[b].long()
    end = (table.num_tokens[rows] if positions is None else positions[b]).long()
    start = end - plen  # first position the prefix would occupy
    j = torch.arange(longest, device=device)
    pos = (start[:, None] + j[None, :]).clamp(0, table.token_ids.shape[1] - 1)
    seen = table.token_ids[rows[:, None], pos].long()
    used = j[None, :] < plen[:, None]
    match = ((seen == to_device(prefix, torch.int64, device)) | ~used).all(dim=1)
    match &= start >= state.prompt_len[rows]  # the prefix lies within the output
    add = torch.where(match, _NEG_INF, 0.0)
    logits.index_put_((b, last), add, accumulate=True)


def _t(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.int64, device)


def _fill(t: torch.Tensor, index: tuple[torch.Tensor, ...], value: float | bool) -> None:
    # ``t[index] = value`` copies the Python scalar from pageable memory (a sync on CUDA); a
    # device-side 0-d tensor does not.
    t.index_put_(index, torch.full((), value, dtype=t.dtype, device=t.device))


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose token's bit is 0 in ``bitmask``
    (``[len(rows), words]`` int32 on the CPU; bit ``t % 32`` of word ``t // 32`` is token
    ``t``): the masks and rows uploaded (pinned, asynchronous on CUDA), then
    :func:`mrv2_kernels.token_bitmask.apply_token_bitmask` (a store-only kernel on CUDA)."""
    device = logits.device
    apply_bitmask_kernel(logits, to_device(bitmask, torch.int32, device), _t(rows, device))
