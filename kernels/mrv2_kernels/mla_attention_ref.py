"""Plain-torch specifications of :mod:`~mrv2_kernels.mla_attention`'s cache write and
absorbed decode attention, and the argument checks both paths share."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mla_cache_write_ref", "mla_decode_attention_ref"]


def _check_write(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    assert latent.dim() == 2 and k_pe.dim() == 2 and latent.shape[0] == k_pe.shape[0], (
        f"latent/k_pe must be [T, R] and [T, P], got {tuple(latent.shape)}, {tuple(k_pe.shape)}"
    )
    assert cache.dim() == 3 and cache.shape[2] == latent.shape[1] + k_pe.shape[1], (
        f"cache must be [num_blocks, block_size, R + P], got {tuple(cache.shape)}"
    )
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= latent.shape[0], "slot_mapping: [T]"


def mla_cache_write_ref(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-torch reference of :func:`mla_cache_write` (boolean indexing: syncs on GPU)."""
    _check_write(latent, k_pe, cache, slot_mapping)
    rank = latent.shape[1]
    slots = slot_mapping[: latent.shape[0]].long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // cache.shape[1], slots % cache.shape[1]
    cache[blocks, offsets, :rank] = latent[keep].to(cache.dtype)
    cache[blocks, offsets, rank:] = k_pe[keep].to(cache.dtype)


def _check_decode(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor | None,
) -> tuple[int, int, int]:
    assert q_latent.dim() == 3 and q_pe.dim() == 3 and q_latent.shape[:2] == q_pe.shape[:2], (
        f"q_latent/q_pe must be [T, H, R] and [T, H, P], got {tuple(q_latent.shape)}, "
        f"{tuple(q_pe.shape)}"
    )
    num_heads, rank, rope = q_latent.shape[1], q_latent.shape[2], q_pe.shape[2]
    assert cache.dim() == 3 and cache.shape[2] == rank + rope, (
        f"cache must be [num_blocks, block_size, {rank} + {rope}], got {tuple(cache.shape)}"
    )
    assert out.shape == q_latent.shape, f"out must be {tuple(q_latent.shape)}"
    assert lse is None or (lse.shape == q_latent.shape[:2] and lse.dtype == torch.float32), (
        "lse must be fp32 [T, H]"
    )
    return num_heads, rank, rope


def mla_decode_attention_ref(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, sm_scale: float,
    out: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    num_reqs: int | None = None,
    **_launch: Any,
) -> torch.Tensor:
    """The specification: gather each request's ``[c_kv ; k_pe]`` rows, direct fp32 softmax.

    Writes the rows of real query tokens of ``out`` (and ``lse``, natural log; ``-inf`` and a
    zero output for a token that sees no key); returns ``out``. Reads ``query_start_loc`` and
    ``seq_lens`` on the host (a sync on GPU). ``max_query_len`` and launch options are
    accepted for signature parity.
    """
    del max_query_len, _launch
    _, rank, _ = _check_decode(q_latent, q_pe, cache, out, lse)
    num_reqs = query_start_loc.shape[0] - 1 if num_reqs is None else num_reqs
    block_size = cache.shape[1]
    qsl = query_start_loc[: num_reqs + 1].tolist()
    lens = seq_lens[:num_reqs].tolist()
    for i in range(num_reqs):
        q0, q1, seq_len = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        if q1 <= q0:
            continue
        n = torch.arange(max(seq_len, 0), device=cache.device)
        kv = cache[block_table[i, n // block_size].long(), n % block_size].float()  # [S, R+P]
        c, k_pe = kv[:, :rank], kv[:, rank:]
        scores = torch.einsum("thr,sr->ths", q_latent[q0:q1].float(), c)
        scores = (scores + torch.einsum("thp,sp->ths", q_pe[q0:q1].float(), k_pe)) * sm_scale
        pos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=cache.device)
        scores = scores.masked_fill((n[None, :] > pos[:, None])[:, None, :], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        out[q0:q1] = torch.einsum("ths,sr->thr", probs, c).to(out.dtype)
        if lse is not None:
            lse[q0:q1] = torch.logsumexp(scores, dim=-1)
    return out
