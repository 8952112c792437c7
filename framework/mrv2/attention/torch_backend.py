"""The plain-torch paged attention backend: the CPU's default, and a reference on any device.

CPU tensors take :mod:`mrv2.attention.cpu_paged` (a few ops per layer, over a plan built once
per step from the metadata, which on the CPU can be read for free). Other devices take the
reference below: no host syncs, every shape from the tensors or from the CPU bounds in the
metadata (``num_reqs``, ``max_query_len``, ``max_seq_len``), never from reading device values.
"""

from __future__ import annotations

import torch

from mrv2.attention.cpu_paged import (
    gather_slots,
    paged_attention_cpu,
    plan_for,
    scatter_slots,
    write_kv_cpu,
)
from mrv2.contract.attention import AttentionMetadata, PagedAttentionBackend
from mrv2.contract.forward_context import current_forward_context
from mrv2_kernels.kv_cache import to_cache_dtype


class TorchAttentionBackend(PagedAttentionBackend):
    """Scatter writes for the cache, dense masked attention in fp32.

    CPU tensors take the fast path (:mod:`mrv2.attention.cpu_paged`). Elsewhere, and in
    :meth:`write_kv_reference` / :meth:`forward_reference` on any device, ``forward`` pads the
    step's queries to ``[num_reqs, max_query_len]``, gathers each request's keys and values
    through its block table up to ``max_seq_len``, masks by causal position and sequence
    length, and scatters the result back to the token layout. Padding query rows (past
    ``query_start_loc[num_reqs]``) come out as zeros.
    """

    name = "torch"
    fp8_kv_cache = True
    sliding_window = True
    logit_softcap = True
    attention_sinks = True
    attention_chunk = True

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` at their slots; tokens with a negative slot are not stored."""
        if key.device.type == "cpu":
            ctx = current_forward_context()  # the step's plan, when these are its slots
            metadata = ctx.metadata_with_slots(slot_mapping) if ctx is not None else None
            plan = plan_for(metadata) if metadata is not None else None
            write_kv_cpu(key, value, kv_cache, slot_mapping, plan)
        else:
            self.write_kv_reference(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        """Causal GQA attention of ``query`` ``[T, H, D]``; returns ``[T, H, D]``."""
        if query.device.type == "cpu":
            return paged_attention_cpu(query, kv_cache, metadata, scale, sliding_window,
                                       logit_softcap, sinks, attention_chunk)
        return self.forward_reference(query, kv_cache, metadata, scale,
                                      sliding_window=sliding_window,
                                      logit_softcap=logit_softcap, sinks=sinks,
                                      attention_chunk=attention_chunk)

    def write_kv_reference(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The device-agnostic :meth:`write_kv`.

        Every row is written somewhere (a data-dependent row count would need a host sync):
        a padding row takes the slot and value of the first real row, so the duplicate write is
        harmless; when no row is real, each writes slot 0's own value back.
        """
        num_tokens = key.shape[0]
        slots = slot_mapping[:num_tokens]
        valid = slots >= 0
        first_valid = torch.argmax(valid.to(torch.int32))
        rows = torch.arange(num_tokens, device=slots.device)
        src = torch.where(valid, rows, first_valid)
        target = slots[src].clamp(min=0).long()
        keep_old = ~valid[src][None, :, None, None]
        new = to_cache_dtype(torch.stack((key[src], value[src])), kv_cache.dtype)
        old = gather_slots(kv_cache, target)
        if new.element_size() == 1:  # fp8: where on the bytes
            merged = torch.where(keep_old, old.view(torch.uint8),
                                 new.view(torch.uint8)).view(new.dtype)
        else:
            merged = torch.where(keep_old, old, new)
        scatter_slots(kv_cache, target, merged)

    def forward_reference(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        """The device-agnostic :meth:`forward` (no host reads)."""
        num_tokens, num_heads, head_dim = query.shape
        block_size, num_kv_heads = kv_cache.shape[2:4]
        group = num_heads // num_kv_heads
        device = query.device
        num_reqs = metadata.num_reqs
        max_q = metadata.max_query_len
        max_len = metadata.max_seq_len
        if num_tokens == 0 or num_reqs == 0 or max_q == 0:
            return torch.zeros_like(query)
        starts = metadata.query_start_loc[: num_reqs + 1].long()
        seq_lens = metadata.seq_lens[:num_reqs].long()
        query_lens = starts[1:] - starts[:-1]

        # Queries padded per request: [B, Q, Hk, G, D], with their absolute positions [B, Q].
        offsets = torch.arange(max_q, device=device)
        q_rows = (starts[:-1, None] + offsets).clamp(max=num_tokens - 1)
        q = query.float()[q_rows].view(num_reqs, max_q, num_kv_heads, group, head_dim)
        q_pos = (seq_lens - query_lens)[:, None] + offsets

        # Keys and values of each request up to max_len: [B, L, Hk, D].
        blocks_needed = -(-max_len // block_size)
        block_ids = metadata.block_table[:num_reqs, :blocks_needed].long()
        k = kv_cache[0][block_ids].flatten(1, 2)[:, :max_len].float()
        v = kv_cache[1][block_ids].flatten(1, 2)[:, :max_len].float()
        k_pos = torch.arange(max_len, device=device)
        in_seq = k_pos[None, :] < seq_lens[:, None]  # [B, L]
        v = torch.where(in_seq[:, :, None, None], v, 0.0)  # unwritten slots may hold NaN

        scores = torch.einsum("bqhgd,blhd->bhgql", q, k) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]; real queries: < seq_len
        if sliding_window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        if attention_chunk is not None:
            mask &= k_pos[None, None, :] >= q_pos[:, :, None] // attention_chunk * attention_chunk
        scores = scores.masked_fill(~mask[:, None, None], torch.finfo(torch.float32).min)
        if sinks is not None:  # [B, Hk, G, Q, L + 1]: each head's sink, dropped after
            column = sinks.float().view(1, num_kv_heads, group, 1, 1)
            scores = torch.cat([scores, column.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        out = torch.einsum("bhgql,blhd->bqhgd", probs, v).reshape(num_reqs, max_q, num_heads, -1)

        # Back to token rows; tokens past the last request's queries are padding.
        tokens = torch.arange(num_tokens, device=device)
        req = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=num_reqs - 1)
        pos_in_req = (tokens - starts[req]).clamp(0, max_q - 1)
        is_real = tokens < starts[-1]
        result = torch.where(is_real[:, None, None], out[req, pos_in_req], 0.0)
        return result.to(query.dtype)
