"""Plain-torch reference of :func:`mrv2_kernels.paged_attention.paged_attention`.

The specification the Triton kernel is tested against (same KV cache layout and contract: see
:mod:`mrv2_kernels.paged_attention`), plus the input checks both share. Re-exported from
:mod:`mrv2_kernels.paged_attention`.
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention_ref"]


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    assert query.dim() == 3, f"query must be [T, H, D], got shape {tuple(query.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got shape {tuple(kv_cache.shape)}"
    )
    _, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert kv_cache.shape[4] == head_dim, (
        f"head_dim mismatch: query {head_dim}, kv_cache {kv_cache.shape[4]}"
    )
    assert num_heads % num_kv_heads == 0, (
        f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    )
    return num_heads, num_kv_heads, head_dim, block_size


def _check_local(sliding_window: int | None, attention_chunk: int | None) -> None:
    """ValueError for a ``sliding_window`` or ``attention_chunk`` below 1, or both given."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if attention_chunk is not None and attention_chunk < 1:
        raise ValueError(f"attention_chunk must be None or >= 1, got {attention_chunk}")
    if sliding_window is not None and attention_chunk is not None:
        raise ValueError(f"sliding_window ({sliding_window}) and attention_chunk "
                         f"({attention_chunk}) cannot be combined: give one or neither")


def paged_attention_ref(
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
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`paged_attention` (fp32 math, same outputs contract).

    Reads ``query_start_loc``/``seq_lens`` on the host (a sync on GPU): meant for tests and CPU.
    ``max_query_len``/``max_seq_len``/``uniform_decode`` are accepted for signature parity.
    ``sliding_window``: a query at position ``p`` sees keys ``p - sliding_window + 1 .. p``.
    ``logit_softcap``: scores become ``cap * tanh(score / cap)`` before the softmax.
    ``sinks`` ``[H]``: each head's sink score joins the softmax (as a key valued zero).
    ``attention_chunk`` ``C``: chunked local attention (Llama 4), a query at position ``p``
    sees keys ``(p // C) * C .. p``; not with ``sliding_window``.
    """
    del max_query_len, max_seq_len, uniform_decode
    num_heads, num_kv_heads, head_dim, block_size = _check_inputs(query, kv_cache)
    _check_local(sliding_window, attention_chunk)
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    qsl = query_start_loc[: num_reqs + 1].tolist()
    lens = seq_lens[:num_reqs].tolist()
    for i in range(num_reqs):
        q_start, q_end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        qlen = q_end - q_start
        if qlen <= 0 or seq_len <= 0:
            continue
        ctx_len = seq_len - qlen
        first = 0 if sliding_window is None else max(0, ctx_len - sliding_window + 1)
        if attention_chunk is not None:
            first = (max(ctx_len, 0) // attention_chunk) * attention_chunk
        n = torch.arange(first, seq_len, device=query.device)  # (earlier keys: never read)
        blocks = block_table[i, n // block_size].long()
        k = kv_cache[0, blocks, n % block_size].float()  # [S, Hk, D]
        v = kv_cache[1, blocks, n % block_size].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        chunk = 256  # bound the score matrix of long prompts
        for c0 in range(0, qlen, chunk):
            c1 = min(c0 + chunk, qlen)
            q = query[q_start + c0 : q_start + c1].float().transpose(0, 1)  # [H, c, D]
            scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, c, S]
            if logit_softcap is not None:
                scores = logit_softcap * torch.tanh(scores / logit_softcap)
            qpos = ctx_len + torch.arange(c0, c1, device=query.device)
            visible = n[None, :] <= qpos[:, None]  # [c, S]
            if sliding_window is not None:
                visible &= n[None, :] > qpos[:, None] - sliding_window
            if attention_chunk is not None:
                visible &= n[None, :] >= (qpos[:, None] // attention_chunk) * attention_chunk
            scores = scores.masked_fill(~visible[None], float("-inf"))
            if sinks is not None:  # a column of each head's sink, dropped after the softmax
                column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
                scores = torch.cat([scores, column], dim=-1)
            probs = torch.softmax(scores, dim=-1)
            if sinks is not None:
                probs = probs[..., :-1]
            probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key -> zeros
            o = torch.matmul(probs, v)  # [H, c, D]
            out[q_start + c0 : q_start + c1] = o.transpose(0, 1).to(query.dtype)
    return out
