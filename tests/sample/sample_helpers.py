"""Build a state table, a sampler and an ``InputBatch`` by hand, to drive the sampler without a
model."""

from __future__ import annotations

import numpy as np
import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import NewRequest
from mrv2.contract.staged_edits import StagedEdits
from mrv2.contract.state_table import RequestStateTable, RowInfo
from mrv2.sample.sampler import Sampler


def apply_on_cpu(staged: StagedEdits) -> None:
    """Apply staged edits without an upload (CPU tensors)."""
    staged.apply({k: torch.from_numpy(v) for k, v in staged.arrays().items()})


def make_batch(
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]],
    vocab: int,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    rows: list[int] | None = None,
    max_len: int = 64,
) -> tuple[InputBatch, RequestStateTable, Sampler]:
    """One decode step of ``len(params)`` requests; ``histories[i] = (prompt, output)``.

    Each request enters the sampler as a resumed one (prompt + output, the prompt's length
    given), so its penalty state starts from its history, as in the engine.
    """
    n = len(params)
    num_rows = max(rows or [0]) + n + 1
    table = RequestStateTable(num_rows, max_len, 4, torch.device("cpu"))
    sampler = Sampler(num_rows, vocab, torch.device("cpu"))
    rows = rows or list(range(n))
    staged = StagedEdits()
    for i, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        while table._free_rows[-1] != rows[i]:
            table._free_rows.insert(0, table._free_rows.pop())
        tokens = prompt + output
        row = table.allocate(RowInfo(f"r{i}", len(tokens), len(tokens)))
        table.token_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        table.num_tokens[row] = len(tokens)
        p._num_prompt_tokens = len(prompt)
        request = NewRequest(f"r{i}", tokens, p, (seeds or [0] * n)[i], [])
        sampler.add_request(request, row, staged)
    apply_on_cpu(staged)
    idx = torch.tensor(rows, dtype=torch.int32)
    pos = torch.tensor(positions if positions is not None
                       else [len(a) + len(b) for a, b in histories], dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int32)
    steps = np.arange(n + 1, dtype=np.int32)
    batch = InputBatch(
        req_ids=[f"r{i}" for i in range(n)], num_reqs=n, num_reqs_padded=n, num_tokens=n,
        num_tokens_padded=n, max_query_len=1, max_seq_len=max_len, uniform_decode=True,
        do_sample=np.ones(n, dtype=bool), idx_mapping=idx, query_start_loc=empty,
        input_ids=empty, positions=empty, slot_mapping=empty, seq_lens=pos.to(torch.int32),
        block_table=empty, logits_indices=torch.arange(n), idx_mapping_cpu=np.asarray(
            rows, dtype=np.int32), query_start_loc_cpu=steps,
        num_computed_cpu=pos.numpy().astype(np.int32) - 1,
        num_draft_tokens=np.zeros(n, dtype=np.int32), cu_num_logits=steps,
        logits_idx_mapping=idx, logits_positions=pos,
    )
    return batch, table, sampler
