"""Paged attention for CPU tensors in a few torch ops per layer (the torch backend's CPU path).

On the CPU a "device" tensor is host memory, so the step's bounds can be read directly. Once
per step (by the first layer; kept in ``metadata.derived``) a :class:`CpuAttentionPlan` turns
the metadata into flat KV slot indices ``[B * L]`` (each request's positions ``0 .. seq_len -
1``, padded with its position 0 up to the longest sequence ``L``), a boolean mask when one is
needed, the token <-> padded-query maps when query lengths differ, and the slots the step
writes. Each layer then stores its keys and values with one ``index_copy_``, gathers exactly
the keys and values it reads with one ``index_select``, and calls
``scaled_dot_product_attention`` once, with the query heads of a KV head stacked as extra query
rows (``[B, Hk, Q * G, D]``: grouped-query attention without repeating K/V, and no mask at all
for a decode batch of equal lengths). fp32 math, as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mrv2.contract.attention import AttentionMetadata
from mrv2_kernels.kv_cache import to_cache_dtype

_PLAN_KEY = "torch_cpu_attention"


@dataclass
class CpuAttentionPlan:
    """What every layer of one step shares (see the module docstring)."""

    num_tokens: int
    write_slots: torch.Tensor
    """``[W]`` int64 slots of the tokens that store K/V (negative slots left out)."""
    write_rows: torch.Tensor | None
    """``[W]`` int64 token rows of ``write_slots``; None: every token (``W == num_tokens``)."""
    num_reqs: int = 0
    """0: the step attends to nothing (every output row is zero)."""
    max_query_len: int = 0
    max_seq_len: int = 0
    read_slots: torch.Tensor | None = None
    """``[B * L]`` int64 flat KV slots to gather."""
    mask: torch.Tensor | None = None
    """``[B, 1, Q, 1, L]`` bool, True where a query may see a key; None: it sees all."""
    query_rows: torch.Tensor | None = None
    """``[B * Q]`` int64 token row of each padded query; None: the tokens are ``[B, Q]``."""
    out_rows: torch.Tensor | None = None
    """``[real tokens]`` int64 padded-query row of each token; None: the identity."""
    query_pos: torch.Tensor | None = None
    """``[B, Q]`` int64 position of each padded query (for sliding windows)."""
    group_masks: dict[tuple[int, int, int], torch.Tensor | None] = field(
        default_factory=dict)

    def mask_for(self, group: int, window: int | None = None, chunk: int | None = None
                 ) -> torch.Tensor | None:
        """The mask over ``[B, 1, Q * group, L]`` query rows (row ``j * group + g``); with
        ``window``, each query's last ``window`` keys only; with ``chunk``, its chunk's."""
        key = (group, window or 0, chunk or 0)
        if key not in self.group_masks:
            mask = self.mask
            if window is not None and self.query_pos is not None:
                b, q = self.query_pos.shape
                pos = torch.arange(self.max_seq_len)
                recent = (pos > self.query_pos[:, :, None] - window).view(b, 1, q, 1, -1)
                mask = recent if mask is None else mask & recent
            if chunk is not None and self.query_pos is not None:
                b, q = self.query_pos.shape
                pos = torch.arange(self.max_seq_len)
                local = pos >= self.query_pos[:, :, None] // chunk * chunk
                mask = local.view(b, 1, q, 1, -1) if mask is None else (
                    mask & local.view(b, 1, q, 1, -1))
            if mask is not None:
                b, _, q, _, length = mask.shape
                if q == 1:
                    mask = mask.view(b, 1, 1, length)  # broadcasts over the group's rows
                else:
                    mask = mask.expand(b, 1, q, group, length).reshape(b, 1, q * group, length)
            self.group_masks[key] = mask
        return self.group_masks[key]


def plan_for(metadata: AttentionMetadata) -> CpuAttentionPlan:
    """The step's plan, built on the first call and kept in ``metadata.derived``."""
    derived = metadata.derived
    plan = derived.get(_PLAN_KEY)
    if plan is None:
        plan = derived[_PLAN_KEY] = _build_plan(metadata)
    return plan


def _build_plan(metadata: AttentionMetadata) -> CpuAttentionPlan:
    num_tokens = metadata.num_tokens
    write_slots = metadata.slot_mapping[:num_tokens].long()
    write_rows = None
    if num_tokens and int(write_slots.min()) < 0:
        write_rows = (write_slots >= 0).nonzero().view(-1)
        write_slots = write_slots[write_rows]
    plan = CpuAttentionPlan(num_tokens, write_slots, write_rows)
    n = metadata.num_reqs
    if n == 0 or num_tokens == 0:
        return plan
    starts: list[int] = metadata.query_start_loc[: n + 1].tolist()
    lens: list[int] = metadata.seq_lens[:n].tolist()
    qlens = [starts[i + 1] - starts[i] for i in range(n)]
    q_max, l_max = max(qlens), max(lens)
    if q_max <= 0 or l_max <= 0:
        return plan
    bs = metadata.block_size
    pos = torch.arange(l_max)
    blocks = metadata.block_table[:n, : -(-l_max // bs)].long()
    slots = blocks[:, pos // bs] * bs + pos % bs  # [B, L]
    seq = torch.tensor(lens)[:, None]
    in_seq = pos < seq
    equal = all(x == l_max for x in lens)
    if not equal:  # padding keys read the request's first slot: written, so finite
        slots = torch.where(in_seq, slots, slots[:, :1])
    mask = None
    # causal: query j of a request sees positions <= seq_len - qlen + j
    q_pos = (seq - torch.tensor(qlens)[:, None]) + torch.arange(q_max)  # [B, Q]
    if q_max == 1:
        if not equal:
            mask = in_seq.view(n, 1, 1, 1, l_max)
    else:
        mask = ((pos <= q_pos[:, :, None]) & in_seq[:, None, :]).view(n, 1, q_max, 1, l_max)
    plan.query_pos = q_pos
    if not (all(q == q_max for q in qlens) and starts[0] == 0):  # not already [B, Q]
        rows = [starts[b] + min(j, max(qlens[b] - 1, 0)) for b in range(n) for j in range(q_max)]
        plan.query_rows = torch.tensor(rows, dtype=torch.int64).clamp_(max=num_tokens - 1)
        plan.out_rows = torch.tensor(
            [b * q_max + j for b in range(n) for j in range(qlens[b])], dtype=torch.int64
        )
    plan.num_reqs, plan.max_query_len, plan.max_seq_len = n, q_max, l_max
    plan.read_slots, plan.mask = slots.reshape(-1), mask
    return plan


def write_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: CpuAttentionPlan | None = None,
) -> None:
    """Store ``key``/``value`` ``[T, Hk, D]`` at their slots (negative: not stored); ``plan``,
    when given, is the step's (its ``slot_mapping``'s) and saves reading the slots."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if plan is not None and plan.num_tokens == num_tokens:
        slots, rows = plan.write_slots, plan.write_rows
    else:
        slots, rows = slot_mapping[:num_tokens].long(), None
        if int(slots.min()) < 0:
            rows = (slots >= 0).nonzero().view(-1)
            slots = slots[rows]
    new = torch.stack((key, value))  # [2, T, Hk, D]
    if rows is not None:
        new = new[:, rows]
    scatter_slots(kv_cache, slots, to_cache_dtype(new, kv_cache.dtype))


def gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[2, S, Hk, D]``: the keys and values at flat ``slots`` (int64, ``block * block_size
    + offset``) of ``kv_cache`` ``[2, N, block_size, Hk, D]``, a cache of its own or a view
    of shared pages (:func:`~mrv2.contract.kv_cache.shared_pages`)."""
    if kv_cache.is_contiguous():
        return kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4]).index_select(1, slots)
    size = kv_cache.shape[2]
    return kv_cache[:, slots // size, slots % size]


def scatter_slots(kv_cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Store ``new`` ``[2, S, Hk, D]`` (the cache's dtype) at flat ``slots`` of ``kv_cache``
    (as :func:`gather_slots` reads them)."""
    if new.element_size() == 1:  # fp8: CPU index_copy_ has no float8 kernel; the bytes do
        kv_cache, new = kv_cache.view(torch.uint8), new.view(torch.uint8)
    if kv_cache.is_contiguous():
        kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4]).index_copy_(1, slots, new)
    else:
        size = kv_cache.shape[2]
        kv_cache[:, slots // size, slots % size] = new


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``scaled_dot_product_attention``, or its steps written out with soft-capped scores or
    a sink column (``sinks``: ``[Hk, rows]``, each query row's head's sink)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1), v)
    column = sinks[None, :, :, None].expand(scores.shape[0], -1, -1, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def paged_attention_cpu(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None = None, logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None, attention_chunk: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``query`` ``[T, H, D]`` over the paged cache; ``[T, H, D]``;
    ``sliding_window``: each query's last that many keys (its own included) only;
    ``attention_chunk``: the keys of each query's chunk of that many positions only;
    ``logit_softcap``: scores ``cap * tanh(score / cap)``; ``sinks`` ``[H]``: each head's sink
    score joins its softmax (a key valued zero)."""
    num_tokens, num_heads, head_dim = query.shape
    plan = plan_for(metadata)
    if plan.num_reqs == 0:
        return torch.zeros_like(query)
    assert plan.read_slots is not None
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    n, q_len, length = plan.num_reqs, plan.max_query_len, plan.max_seq_len
    # Keys and values as [2, B, Hk, L, D] views over the gathered [2, B * L, Hk * D] rows.
    kv = gather_slots(kv_cache, plan.read_slots)
    if kv.dtype != torch.float32:
        kv = kv.float()
    kv = kv.view(2, n, length, num_kv_heads, head_dim).transpose(2, 3)
    q = query if plan.query_rows is None else query.index_select(0, plan.query_rows)
    if q_len == 1:
        q = q[:n].view(n, num_kv_heads, group, head_dim)
    else:
        q = q[: n * q_len].view(n, q_len, num_kv_heads, group, head_dim).transpose(1, 2)
        q = q.reshape(n, num_kv_heads, q_len * group, head_dim)
    if q.dtype != torch.float32:
        q = q.float()
    row_sinks = None  # the sink of each query row (row j * G + g: head g of the kv head)
    if sinks is not None:
        row_sinks = sinks.float().view(num_kv_heads, group).repeat(1, q_len)
    out = _attend(q, kv[0], kv[1], plan.mask_for(group, sliding_window, attention_chunk), scale,
                  logit_softcap, row_sinks)  # [B, Hk, Q * G, D]
    if q_len == 1:
        out = out.view(n, num_heads, head_dim)
    else:
        out = out.view(n, num_kv_heads, q_len, group, head_dim).transpose(1, 2)
        out = out.reshape(n * q_len, num_heads, head_dim)
    if plan.out_rows is not None:
        out = out.index_select(0, plan.out_rows)
    if out.shape[0] < num_tokens:  # padding rows
        out = torch.cat([out, out.new_zeros(num_tokens - out.shape[0], num_heads, head_dim)])
    return out if out.dtype == query.dtype else out.to(query.dtype)
