"""Penalties at draft rows (``mrv2.sample.draft_penalties``): the kept tokens' penalties (the
kernel) and then :func:`penalize_drafts` give each row what the penalties give with the drafts
before it counted as outputs (the torch reference over full counts), for random logits,
counts, prompts and drafts that repeat, reappear from the prompt or the output, or are new."""

from __future__ import annotations

from types import MethodType, SimpleNamespace

import pytest
import torch

from mrv2.contract.batch import InputBatch
from mrv2.sample.draft_penalties import penalize_drafts
from mrv2_kernels.penalties import apply_penalties_ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draft_rows_count_the_drafts_before_them(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab, table_rows, k = 40, 6, 3
    drafts = [3, 0, 2, 1]  # per request: its drafts this step (0: a row without drafts)
    rows_of = [4, 1, 0, 5]  # state-table rows
    # each request's query: its last token, then its drafts, drawn from a small range so
    # drafts repeat and meet the prompt and the output
    queries = [torch.randint(0, 8, (1 + d,), generator=g) for d in drafts]
    queries[0][1:] = torch.tensor([9, 9, 10])  # new tokens, one drafted twice
    input_ids = torch.cat(queries).to(torch.int32)
    lens = torch.tensor([1 + d for d in drafts])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    logits_indices = torch.arange(int(lens.sum()))  # every token a logits row
    idx = torch.cat([torch.full((1 + d,), r) for d, r in zip(drafts, rows_of, strict=True)])
    counts = torch.randint(0, 3, (table_rows, vocab), generator=g).to(torch.int32)
    counts[:, 8:] = 0
    counts[:, :8] *= torch.randint(0, 2, (table_rows, 8), generator=g).to(torch.int32)
    prompt = torch.rand(table_rows, vocab, generator=g) < 0.2
    prompt[rows_of[0], 9] = False
    repetition = 1 + torch.rand(table_rows, generator=g)
    frequency = torch.rand(table_rows, generator=g)
    presence = torch.rand(table_rows, generator=g)
    repetition[rows_of[3]], frequency[rows_of[3]], presence[rows_of[3]] = 1.0, 0.0, 0.0
    logits = torch.randn(int(lens.sum()), vocab, generator=g) * 3
    logits[0, 5] = float("-inf")  # a structured output's mask: stays -inf
    batch = SimpleNamespace(
        max_draft_tokens=k, num_reqs=len(drafts), cu_num_logits_dev=starts.to(torch.int32),
        logits_indices=logits_indices, input_ids=input_ids, logits_idx_mapping=idx.int())
    batch.logits_row_offsets = MethodType(InputBatch.logits_row_offsets, batch)
    want = logits.clone()
    for r in range(want.shape[0]):  # the reference: full counts per row
        req = int(torch.searchsorted(starts[1:], torch.tensor(r), right=True))
        j = r - int(starts[req])
        full = counts.clone()
        for t in queries[req][1 : j + 1].tolist():
            full[rows_of[req], t] += 1
        apply_penalties_ref(want[r : r + 1], idx[r : r + 1], full, prompt, repetition,
                            frequency, presence)
    got = logits.clone()
    apply_penalties_ref(got, idx, counts, prompt, repetition, frequency, presence)
    penalize_drafts(got, batch, counts, prompt, repetition, frequency,  # type: ignore[arg-type]
                    presence)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert got[0, 5] == float("-inf")
