"""Plain-torch specifications of :mod:`~mrv2_kernels.sparse_mla`'s lightning-indexer logits
and sparse (top-k) latent attention, and the argument checks both paths share.

Neither reads anything back to the host: the token-to-request map and every token's position
come in as device tensors (``token_req`` -1 for a padding row), and the work is cut into
chunks of query rows whose sizes are host-known, so the references also serve the CPU path of
long prompts without materializing ``[T, S, D]`` at once."""

from __future__ import annotations

import torch

__all__ = ["indexer_logits_ref", "sparse_mla_attention_ref"]

#: Elements of the largest gathered tensor one chunk of query rows may build.
_CHUNK_ELEMENTS = 1 << 24


def _check_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                  token_req: torch.Tensor, token_pos: torch.Tensor, out: torch.Tensor) -> None:
    assert q.dim() == 3 and weights.shape == q.shape[:2], (
        f"q must be [T, H, D] and weights [T, H], got {tuple(q.shape)}, {tuple(weights.shape)}")
    assert k_cache.dim() == 3 and k_cache.shape[2] == q.shape[2], (
        f"k_cache must be [num_blocks, block_size, {q.shape[2]}], got {tuple(k_cache.shape)}")
    assert token_req.shape[0] >= q.shape[0] and token_pos.shape[0] >= q.shape[0], "[T] maps"
    assert out.dim() == 2 and out.shape[0] == q.shape[0] and out.dtype == torch.float32, (
        "out must be fp32 [T, S]")


def indexer_logits_ref(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
    token_req: torch.Tensor, token_pos: torch.Tensor, scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """The lightning indexer's scores, the specification.

    ``out[t, s] = sum_h weights[t, h] * relu(scale * q[t, h] . k[s])`` over the cached key
    ``k[s]`` of position ``s`` of token ``t``'s request (``token_req[t]``'s block table row),
    for ``s <= token_pos[t]``; ``-inf`` past it and on padding rows (``token_req < 0``).
    ``out`` is fp32 ``[T, S]``, ``S`` any bound on the positions (keys past the block table's
    reach are never read: they are all past the token). Returns ``out``."""
    _check_logits(q, weights, k_cache, token_req, token_pos, out)
    num_tokens, heads, dim = q.shape
    span = out.shape[1]
    block_size = k_cache.shape[1]
    flat = k_cache.reshape(-1, dim)
    n = torch.arange(span, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, span * max(dim, heads)))
    for t0 in range(0, num_tokens, step):
        t1 = min(num_tokens, t0 + step)
        req, pos = token_req[t0:t1].long(), token_pos[t0:t1].long()
        visible = (n[None, :] <= pos[:, None]) & (req[:, None] >= 0)
        blocks = n // block_size
        cols = blocks.clamp(max=block_table.shape[1] - 1)
        ids = block_table[req.clamp(min=0)][:, cols].long()  # [t, S]
        slots = torch.where(visible, ids * block_size + n % block_size, 0)
        keys = flat[slots].float()  # [t, S, D]
        dots = torch.einsum("thd,tsd->ths", q[t0:t1].float(), keys) * scale
        scores = torch.einsum("th,ths->ts", weights[t0:t1].float(), torch.relu(dots))
        out[t0:t1] = scores.masked_fill(~visible, float("-inf"))
    return out


def _check_sparse(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  slots: torch.Tensor, out: torch.Tensor) -> None:
    assert q_latent.dim() == 3 and q_pe.dim() == 3 and q_latent.shape[:2] == q_pe.shape[:2], (
        f"q_latent/q_pe must be [T, H, R] and [T, H, P], got {tuple(q_latent.shape)}, "
        f"{tuple(q_pe.shape)}")
    assert cache.dim() == 3 and cache.shape[2] == q_latent.shape[2] + q_pe.shape[2], (
        f"cache must be [num_blocks, block_size, R + P], got {tuple(cache.shape)}")
    assert slots.dim() == 2 and slots.shape[0] >= q_latent.shape[0], "slots must be [T, K]"
    assert out.shape == q_latent.shape, f"out must be {tuple(q_latent.shape)}"


def sparse_mla_attention_ref(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
    sm_scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """Absorbed MLA attention of token ``t`` over the cache rows ``slots[t]`` only (flat
    slots; negative: none), the specification: ``softmax(sm_scale * (q_latent . c + q_pe .
    k_pe)) @ c`` in fp32; a token with no slot gets zeros. Returns ``out`` ``[T, H, R]``."""
    _check_sparse(q_latent, q_pe, cache, slots, out)
    num_tokens, heads, rank = q_latent.shape
    width = cache.shape[2]
    flat = cache.reshape(-1, width)
    top = slots.shape[1]
    step = max(1, _CHUNK_ELEMENTS // max(1, top * max(width, heads)))
    for t0 in range(0, num_tokens, step):
        t1 = min(num_tokens, t0 + step)
        sel = slots[t0:t1].long()
        ok = sel >= 0
        rows = flat[sel.clamp(min=0)].float()  # [t, K, R + P]
        c, k_pe = rows[..., :rank], rows[..., rank:]
        scores = torch.einsum("thr,tkr->thk", q_latent[t0:t1].float(), c)
        scores = (scores + torch.einsum("thp,tkp->thk", q_pe[t0:t1].float(), k_pe)) * sm_scale
        scores = scores.masked_fill(~ok[:, None, :], float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        out[t0:t1] = torch.einsum("thk,tkr->thr", probs, c).to(out.dtype)
    return out
