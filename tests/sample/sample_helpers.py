"""Build a state table and an ``InputBatch`` by hand, to drive the sampler without a model."""

from __future__ import annotations

import numpy as np
import torch

from mrv2.runner.input_batch import InputBatch
from mrv2.runner.state_table import RequestStateTable, RowInfo
from mrv2.sample.params import SamplingParams


def make_batch(
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]],
    vocab: int,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    rows: list[int] | None = None,
    max_len: int = 64,
) -> tuple[InputBatch, RequestStateTable]:
    """One decode step of ``len(params)`` requests; ``histories[i] = (prompt, output)``."""
    n = len(params)
    table = RequestStateTable(max(rows or [0]) + n + 1, max_len, 4, torch.device("cpu"))
    rows = rows or list(range(n))
    if any(p.uses_penalties for p in params):
        table.ensure_penalty_state(vocab)
    for i, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        while table._free_rows[-1] != rows[i]:
            table._free_rows.insert(0, table._free_rows.pop())
        row = table.allocate(RowInfo(f"r{i}", len(prompt), len(prompt) + len(output),
                                     p.greedy, p.top_k > 0, p.top_p < 1, p.min_p > 0, p))
        tokens = prompt + output
        table.token_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        table.num_tokens[row] = len(tokens)
        table.prefill_len[row] = len(prompt)
        table.temperature[row] = p.temperature
        table.top_k[row] = p.top_k
        table.top_p[row] = p.top_p
        table.min_p[row] = p.min_p
        table.seed[row] = (seeds or [0] * n)[i]
        table.repetition_penalty[row] = p.repetition_penalty
        table.frequency_penalty[row] = p.frequency_penalty
        table.presence_penalty[row] = p.presence_penalty
        table.min_tokens[row] = p.min_tokens
        if table.output_counts is not None and table.prompt_mask is not None:
            table.prompt_mask[row, prompt] = True
            for t in output:
                table.output_counts[row, t] += 1
    idx = torch.tensor(rows, dtype=torch.int32)
    pos = torch.tensor(positions if positions is not None
                       else [len(a) + len(b) for a, b in histories], dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    batch = InputBatch(
        req_ids=[f"r{i}" for i in range(n)], num_reqs=n, num_reqs_padded=n, num_tokens=n,
        num_tokens_padded=n, max_query_len=1, max_seq_len=max_len, uniform_decode=True,
        do_sample=np.ones(n, dtype=bool), idx_mapping=idx, query_start_loc=empty,
        input_ids=empty, positions=empty, slot_mapping=empty, seq_lens=pos,
        block_table=empty, logits_indices=empty,
        all_greedy=all(p.greedy for p in params),
        any_min_p=any(p.min_p > 0 for p in params),
        any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
        idx_mapping_cpu=np.asarray(rows, dtype=np.int32),
    )
    return batch, table
