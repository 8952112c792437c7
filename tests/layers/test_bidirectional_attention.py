"""Spans of query rows that attend both ways (an image's tokens in Gemma 3): the core attention
layer's output against a dense masked reference (causal OR same span; a sliding window's lower
bound still applies), with cached context, a span the step starts inside of (a prefix hit
ending mid-image), GQA, soft-capping and sinks, on the torch and the Triton backends; and the
scheduler's rule that no step ends inside a bidirectional item."""

from __future__ import annotations

import math

import pytest
import torch

from mrv2.attention import AttentionMetadata
from mrv2.attention.torch_backend import TorchAttentionBackend
from mrv2.attention.triton_backend import TritonAttentionBackend
from mrv2.contract.forward_context import (
    BidirectionalSpan,
    ForwardContext,
    bidirectional_spans,
    set_forward_context,
)
from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.request import Request
from mrv2.layers import bidirectional
from mrv2.layers.attention import Attention

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 16
#: (cached context, new tokens, spans as (item start, item end) positions)
REQUESTS = [(3, 9, [(5, 9)]), (0, 7, [(1, 4)]), (6, 4, [(4, 8)])]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int,
               spans: list[tuple[int, int]], window: int | None, cap: float | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """``q [n, H, D]`` at positions ``ctx ..``; ``k`` / ``v`` ``[ctx + n, Hk, D]``; fp64."""
    n, total = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    qpos = torch.arange(ctx, ctx + n)[:, None]
    kpos = torch.arange(total)[None, :]
    seen = kpos <= qpos
    for a, b in spans:
        inside = (qpos >= a) & (qpos < b)
        seen |= inside & (kpos >= a) & (kpos < b)
    if window is not None:
        seen &= kpos > qpos - window
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) / math.sqrt(DIM)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], -1)
        probs = scores.softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize("window,cap,sink,one_per_group", [
    (None, None, False, False), (3, None, False, True), (None, 5.0, False, False),
    (5, None, True, True)])
def test_spans_match_a_dense_mask(backend_cls: type, window: int | None, cap: float | None,
                                  sink: bool, one_per_group: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """All spans in one padded group, or (``one_per_group``) a group each."""
    if one_per_group:
        monkeypatch.setattr(bidirectional, "MAX_GROUP_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(1)
    backend = backend_cls()
    if window is not None and not backend.sliding_window:
        pytest.fail(f"{backend.name} takes no sliding window")
    num_blocks = sum(math.ceil((c + n) / BLOCK) for c, n, _ in REQUESTS) + 2
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=gen) * 1e3  # poison
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values, slots, spans = [], [], [], [], []
    row = 0
    for i, (ctx, n, items) in enumerate(REQUESTS):
        blocks = [perm.pop() for _ in range(math.ceil((ctx + n) / BLOCK))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        k = torch.randn(ctx + n, KV_HEADS, DIM, generator=gen)
        v = torch.randn(ctx + n, KV_HEADS, DIM, generator=gen)
        keys.append(k)
        values.append(v)
        for p in range(ctx):  # earlier steps' keys
            cache[0, blocks[p // BLOCK], p % BLOCK] = k[p]
            cache[1, blocks[p // BLOCK], p % BLOCK] = v[p]
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + n)]
        for a, b in items:
            first = max(a, ctx)
            spans.append(BidirectionalSpan(i, row + first - ctx, first, b))
        row += n
    lens = [n for _, n, _ in REQUESTS]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(REQUESTS), num_tokens=row, max_query_len=max(lens),
        max_seq_len=max(c + n for c, n, _ in REQUESTS), query_start_loc=qsl,
        seq_lens=torch.tensor([c + n for c, n, _ in REQUESTS], dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=BLOCK)
    q = torch.randn(row, HEADS * DIM, generator=gen)
    k_new = torch.cat([k[c:] for k, (c, _, _) in zip(keys, REQUESTS, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _, _) in zip(values, REQUESTS, strict=True)])
    sinks = torch.randn(HEADS, generator=gen) if sink else None
    layer = Attention(HEADS, KV_HEADS, DIM, DIM**-0.5, 0, sliding_window=window,
                      logit_softcap=cap)
    context = ForwardContext(metadata, [cache], [backend])
    with set_forward_context(context), bidirectional_spans(spans):
        out = layer(q, k_new.reshape(row, -1), v_new.reshape(row, -1), sinks=sinks)
        assert context.bidirectional == tuple(spans)
    assert context.bidirectional == ()
    start = 0
    for (ctx, n, items), k, v in zip(REQUESTS, keys, values, strict=True):
        want = _reference(q[start:start + n].reshape(n, HEADS, DIM), k, v, ctx, items,
                          window, cap, sinks)
        torch.testing.assert_close(out[start:start + n].reshape(n, HEADS, DIM).double(), want,
                                   atol=2e-5, rtol=2e-5)
        start += n
    # the same call without spans differs exactly on the span rows (the test can fail)
    with set_forward_context(ForwardContext(metadata, [cache], [backend])):
        causal = layer(q, k_new.reshape(row, -1), v_new.reshape(row, -1), sinks=sinks)
    # a layer that opts out (Gemma 4's global layers) stays causal inside the spans' context
    causal_layer = Attention(HEADS, KV_HEADS, DIM, DIM**-0.5, 0, sliding_window=window,
                             logit_softcap=cap, bidirectional_spans=False)
    with set_forward_context(ForwardContext(metadata, [cache], [backend])), \
            bidirectional_spans(spans):
        opted_out = causal_layer(q, k_new.reshape(row, -1), v_new.reshape(row, -1), sinks=sinks)
    torch.testing.assert_close(opted_out, causal)
    changed = (causal - out).abs().amax(-1) > 1e-6
    rows = set()
    for span in spans:
        rows |= set(range(span.first_row, span.first_row + span.end - span.first_position - 1))
    assert set(torch.nonzero(changed).flatten().tolist()) == rows  # (a span's last row: causal)


def test_no_step_ends_inside_a_bidirectional_item() -> None:
    """``Request.chunk_size``: cut back to an item's start, or 0 from inside one whose rest
    does not fit; plain items and whole items pass."""
    items = [MultiModalItem("image", None, "a", 4, 6, bidirectional=True),
             MultiModalItem("image", None, "b", 12, 3),
             MultiModalItem("image", None, "c", 20, 4, bidirectional=True)]
    request = Request(req_id="r", prompt_token_ids=list(range(30)),
                      sampling_params=SamplingParams(), seed=0, eos_token_ids=frozenset(),
                      max_tokens=4, mm_items=items)
    cases = {(0, 3): 3, (0, 4): 4, (0, 5): 4, (0, 9): 4, (0, 10): 10, (0, 13): 13,
             (0, 21): 20, (2, 28): 28, (5, 3): 0, (5, 5): 5, (4, 6): 6, (10, 11): 10,
             (22, 1): 0, (22, 2): 2}
    got = {key: request.chunk_size(*key) for key in cases}
    assert got == cases
