"""From a ``SchedulerOutput`` to one step's ``InputBatch`` on the device.

The CPU checks the step, moves its count mirror (optimistically while drafts are verified:
every draft counted as kept until the step's result says otherwise), packs the step's small
arrays with the staged edits into one upload, and launches the prep kernel that builds token ids,
positions, slot mapping, sequence lengths and block tables from the state table.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mrv2.contract.batch import InputBatch, InputBuffers, last_token_indices
from mrv2.contract.requests import SchedulerOutput
from mrv2.contract.staged_edits import StagedEdits
from mrv2.contract.staging import Uploader
from mrv2.contract.state_table import RequestStateTable
from mrv2.runner.async_output import Drafted
from mrv2.runner.cuda_graphs import StepGraphs
from mrv2_kernels.input_prep import prepare_inputs

#: ``0`` keeps the scheduler's request order in the batch instead of longest sequence first.
LONGEST_FIRST_ENV_VAR = "MRV2_LONGEST_FIRST"


@dataclass
class StepPlan:
    """A built step: its batch, the sampler's plan, and how it runs."""

    batch: InputBatch
    sample_plan: Any
    replay_query_len: int
    """Query length of the CUDA graph that runs the step; 0: eager."""
    do_sample_dev: torch.Tensor
    """``[num_reqs]`` int32 on the device: which requests produce tokens."""
    num_drafts_dev: torch.Tensor | None
    """``[num_reqs]`` int32 drafts per request (steps with drafts only)."""
    drafted: dict[str, Drafted] = field(default_factory=dict)
    replay_tokens: int = 0
    """Token count of the mixed CUDA graph that runs the step; 0: none."""


class BatchBuilder:
    """Builds each step's batch over the state table and the persistent input buffers."""

    def __init__(
        self, table: RequestStateTable, buffers: InputBuffers, block_size: int,
        max_num_tokens: int, num_speculative_tokens: int,
    ) -> None:
        self.table = table
        self.buffers = buffers
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self._graphs: StepGraphs | None = None
        self._last: _Layout | None = None  # the previous step's layout
        self.longest_first = os.environ.get(LONGEST_FIRST_ENV_VAR, "1") != "0"
        self._order: list[str] = []  # the last step's request order (longest_first)
        self._scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: ``(rows, num_computed, query_lens) -> bool``: may a step with prompt tokens replay a
        #: mixed graph (the ModelState's ``mixed_graph_allowed``; the runner sets it).
        self.mixed_graph_allowed: Callable[[list[int], list[int], list[int]], bool] = (
            lambda rows, computed, lens: True)

    # -- staged writes of new rows -------------------------------------------------------------

    def stage_new_row(
        self, row: int, token_ids: list[int], block_ids: list[int], num_computed: int,
        staged: StagedEdits,
    ) -> None:
        """A new request's tokens, blocks and counts, written with the step's upload."""
        self.stage_new_rows([row], [token_ids], [block_ids], [num_computed], staged)

    def stage_new_rows(
        self, rows: list[int], token_ids: list[list[int]], block_ids: list[list[int]],
        num_computed: list[int], staged: StagedEdits,
        extra_block_ids: list[list[list[int]]] | None = None,
    ) -> None:
        """New requests' tokens, blocks and counts (one list entry per row), written with the
        step's upload: one staged put per table for all of them. ``extra_block_ids``: each
        row's blocks in every block table after the first (sliding-window tables)."""
        if not rows:
            return
        table = self.table
        at = np.asarray(rows, dtype=np.int64)
        lens = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(rows))
        staged.put(table.token_ids, _ragged_index(at, lens),
                   _concat(token_ids, int(lens.sum())))
        self._stage_table_rows(0, rows, at, block_ids, staged)
        for t in range(1, len(table.block_tables)):
            assert extra_block_ids is not None  # (check() refused a step without them)
            self._stage_table_rows(t, rows, at, [extra[t - 1] for extra in extra_block_ids],
                                   staged)
        staged.put(table.num_computed, (at,), np.asarray(num_computed, dtype=np.int32))
        staged.put(table.num_tokens, (at,), lens.astype(np.int32))

    def _stage_table_rows(self, t: int, rows: list[int], at: np.ndarray,
                          block_ids: list[list[int]], staged: StagedEdits) -> None:
        table = self.table
        counts = table.table_num_blocks[t]
        counts[at] = 0
        num_new = np.fromiter((len(b) for b in block_ids), dtype=np.int64, count=len(rows))
        if (num_new > table.max_blocks_per_req).any():
            row = rows[int(np.argmax(num_new > table.max_blocks_per_req))]
            raise ValueError(f"request {table.info[row].req_id!r} would hold more blocks than "
                             "max_model_len needs")
        if num_new.any():
            staged.put(table.block_tables[t], _ragged_index(at, num_new),
                       _concat(block_ids, int(num_new.sum())))
            counts[at] = num_new

    def stage_new_blocks(self, row: int, block_ids: list[int], staged: StagedEdits,
                         table_index: int = 0) -> None:
        """Blocks appended to ``row``'s block table (``table_index``: which one)."""
        if not block_ids:
            return
        counts = self.table.table_num_blocks[table_index]
        start = int(counts[row])
        if start + len(block_ids) > self.table.max_blocks_per_req:
            raise ValueError(
                f"request {self.table.info[row].req_id!r} would hold more blocks than "
                "max_model_len needs"
            )
        staged.put(self.table.block_tables[table_index],
                   (np.full(len(block_ids), row), np.arange(start, start + len(block_ids))),
                   np.asarray(block_ids, dtype=np.int32))
        counts[row] = start + len(block_ids)

    # -- checks ----------------------------------------------------------------------------------

    def check(self, scheduled: SchedulerOutput) -> None:
        """Refuse a malformed step before anything changes (a clear error naming the request)."""
        table = self.table
        num_reqs = len(scheduled.num_scheduled_tokens)
        if not 0 < num_reqs <= table.max_num_reqs:
            raise ValueError(f"a step needs 1..{table.max_num_reqs} requests, got {num_reqs}")
        total = scheduled.total_num_scheduled_tokens
        if total > self.max_num_tokens:
            raise ValueError(f"{total} tokens scheduled; at most {self.max_num_tokens}")
        new = {r.req_id: r for r in scheduled.new_requests}
        leaving = set(scheduled.finished_req_ids)
        extra = len(table.block_tables) - 1
        for req_id, ids in itertools.chain(
                ((r.req_id, r.extra_block_ids) for r in scheduled.new_requests),
                scheduled.new_extra_block_ids.items()):
            if len(ids) != extra:
                raise ValueError(f"request {req_id!r}: blocks for {len(ids)} block tables "
                                 f"after the first; this model has {extra}")
        for req_id, n in scheduled.num_scheduled_tokens.items():
            d = scheduled.num_draft_tokens.get(req_id, 0)
            if req_id in new:
                waiting = len(new[req_id].token_ids) - new[req_id].num_computed_tokens
            elif req_id in table.rows and req_id not in leaving:
                info = table.info[table.rows[req_id]]
                waiting = info.num_known - info.num_computed
            else:
                raise KeyError(f"request {req_id!r} is not in the state table")
            if d:
                if not 0 < d <= self.num_speculative_tokens or n != 1 + d or waiting != 1:
                    raise ValueError(
                        f"request {req_id!r}: {d} draft tokens in {n} scheduled; drafts need "
                        f"a decode request (1 token waiting, has {waiting}) scheduled 1 + d "
                        f"tokens, d in 1..{self.num_speculative_tokens}"
                    )
            elif not 0 < n <= waiting:
                raise ValueError(f"request {req_id!r}: scheduled {n} tokens but only "
                                 f"{waiting} are waiting to be computed")

    # -- the batch -------------------------------------------------------------------------------

    @property
    def graphs(self) -> StepGraphs | None:
        """The runner's decode graphs (padded sizes come from them), or None."""
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: StepGraphs | None) -> None:
        self._graphs = graphs
        self._last = None  # a layout's padding depends on them

    def build(
        self, scheduled: SchedulerOutput, staged: StagedEdits,
        sample_plan: Callable[[InputBatch], Any], uploader: Uploader,
    ) -> StepPlan:
        """Move the counts, upload, run the prep kernel; the step's batch and plan.

        A step with the previous step's layout (the same requests in the same order, the same
        query lengths, drafts and sampling flags: a run of decode steps) sends only its staged
        edits (new blocks), if any, and rewrites none of the layout's buffers, which still hold
        it: only the prep kernel and the logits positions run.
        """
        table = self.table
        req_ids = self._row_order(scheduled)
        num_reqs = len(req_ids)
        counts = scheduled.num_scheduled_tokens
        lens_l = [counts[r] for r in req_ids]
        draft_map = scheduled.num_draft_tokens
        drafts_l = [draft_map.get(r, 0) for r in req_ids] if draft_map else [0] * num_reqs
        rows_l = [table.rows[r] for r in req_ids]
        computed_l = [0] * num_reqs
        sample_l = [False] * num_reqs
        drafted: dict[str, Drafted] = {}
        max_seq_len = 0
        in_prompt = False
        for i, row in enumerate(rows_l):
            info = table.info[row]
            computed_l[i] = info.num_computed
            in_prompt |= info.num_computed < info.num_prompt
            info.num_computed += lens_l[i]
            if info.num_computed == info.num_known + drafts_l[i]:
                sample_l[i] = True
                info.num_known = info.num_computed + 1
            if drafts_l[i]:
                drafted[req_ids[i]] = Drafted(info, drafts_l[i])
            max_seq_len = max(max_seq_len, info.num_computed)
        graph_ok = not in_prompt or self.mixed_graph_allowed(rows_l, computed_l, lens_l)
        key = (rows_l, lens_l, drafts_l, sample_l, in_prompt, graph_ok)
        layout = self._last
        if layout is None or layout.key != key:
            layout = self._layout(key, staged, uploader)
        elif staged:  # blocks appended to running requests: only the edits travel
            staged.apply(uploader.upload(staged.arrays()))
        self._last = layout
        buffers = self.buffers
        num_padded, num_tokens_padded = layout.num_padded, layout.num_tokens_padded
        num_block_cols = min(-(-max_seq_len // self.block_size), table.max_blocks_per_req)
        input_ids = buffers.input_ids[:num_tokens_padded]
        positions = buffers.positions[:num_tokens_padded]
        seq_lens = buffers.seq_lens[:num_padded]
        block_table = buffers.block_table[:num_padded]
        prepare_inputs(layout.idx_mapping, layout.query_start_loc, num_reqs, table.token_ids,
                       table.num_computed, table.block_table, self.block_size, input_ids,
                       positions, buffers.slot_mapping[:num_tokens_padded], seq_lens,
                       block_table, num_block_cols)
        table_inputs = self._table_inputs(layout, num_reqs, num_tokens_padded, num_block_cols)
        logits_positions = buffers.logits_positions[: layout.num_logits]
        if layout.max_drafts:
            torch.index_select(buffers.positions, 0, layout.logits_indices, out=logits_positions)
            logits_positions.add_(1)
        else:  # one logits row per request: its last token, predicting position seq_len
            logits_positions.copy_(seq_lens[:num_reqs])
        batch = InputBatch(
            req_ids=req_ids, num_reqs=num_reqs, num_reqs_padded=num_padded,
            num_tokens=layout.num_tokens, num_tokens_padded=num_tokens_padded,
            max_query_len=layout.max_query_len, max_seq_len=max_seq_len,
            uniform_decode=layout.uniform, do_sample=layout.do_sample,
            idx_mapping=layout.idx_mapping, query_start_loc=layout.query_start_loc,
            input_ids=input_ids, positions=positions,
            slot_mapping=buffers.slot_mapping[:num_tokens_padded], seq_lens=seq_lens,
            block_table=block_table[:, :num_block_cols], logits_indices=layout.logits_indices,
            idx_mapping_cpu=layout.rows, query_start_loc_cpu=layout.qsl_cpu,
            num_computed_cpu=np.array(computed_l, dtype=np.int32),
            num_draft_tokens=layout.drafts, cu_num_logits=layout.cu_logits,
            logits_idx_mapping=layout.logits_idx_mapping, logits_positions=logits_positions,
            cu_num_logits_dev=layout.dev.get("cu_num_logits"),
            token_bitmasks=scheduled.token_bitmasks, table_inputs=table_inputs,
        )
        plan = sample_plan(batch)
        return StepPlan(batch, plan, layout.replay_query_len, layout.dev["do_sample"],
                        layout.dev.get("num_drafts"), drafted, layout.replay_tokens)

    def _table_inputs(self, layout: _Layout, num_reqs: int, num_tokens: int, num_cols: int
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The step's block table and slot mapping of each block table after the first (a
        prep launch each, its token ids, positions and lengths written to scratch)."""
        table, buffers = self.table, self.buffers
        if len(table.block_tables) == 1:
            return ()
        num_padded = layout.num_padded
        scratch = self._prep_scratch()
        out = []
        for t in range(1, len(table.block_tables)):
            block_table = buffers.block_tables[t][:num_padded]
            slots = buffers.slot_mappings[t][:num_tokens]
            prepare_inputs(layout.idx_mapping, layout.query_start_loc, num_reqs,
                           table.token_ids, table.num_computed, table.block_tables[t],
                           self.block_size, scratch[0][:num_tokens], scratch[1][:num_tokens],
                           slots, scratch[2][:num_padded], block_table, num_cols)
            out.append((block_table[:, :num_cols], slots))
        return tuple(out)

    def _prep_scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and sequence lengths the extra tables' prep launches write
        (the first table's launch writes the real ones)."""
        if self._scratch is None:
            b = self.buffers
            self._scratch = (torch.empty_like(b.input_ids), torch.empty_like(b.positions),
                             torch.empty_like(b.seq_lens))
        return self._scratch

    def _row_order(self, scheduled: SchedulerOutput) -> list[str]:
        """The step's requests in batch-row order: longest sequence (after the step) first.

        Attention launches its programs row by row, so long sequences start first and the
        short ones fill the tail; in the scheduler's order one long request landing last
        kept a step's final wave waiting (``bench_attention --workload``: the throughput
        workload's decode attention at 0.94 of the KV-byte floor against 0.90, H200,
        BENCHMARKS.md 2026-12-01, seventh session). The order is kept while the same
        requests run (decode steps all advance alike, and an unchanged order keeps the layout
        for reuse); it is sorted again when requests join or leave. Ties keep the scheduler's
        order. Only the speed depends on it: every row's request travels with the batch
        (``req_ids``). ``MRV2_LONGEST_FIRST=0`` keeps the scheduler's order.
        """
        counts = scheduled.num_scheduled_tokens
        if not self.longest_first or len(counts) < 2:
            return list(counts)
        last = self._order
        if len(last) == len(counts) and all(r in counts for r in last):
            return list(last)
        info, rows = self.table.info, self.table.rows
        self._order = sorted(counts, key=lambda r: -(info[rows[r]].num_computed + counts[r]))
        return list(self._order)

    def _layout(self, key: tuple[Any, ...], staged: StagedEdits, uploader: Uploader) -> _Layout:
        """A step's layout from its lists: uploaded (with the staged edits, applied) and
        written into the persistent buffers."""
        rows_l, lens_l, drafts_l, sample_l, in_prompt, graph_ok = key
        buffers = self.buffers
        rows = np.array(rows_l, dtype=np.int32)
        lens = np.array(lens_l, dtype=np.int32)
        drafts = np.array(drafts_l, dtype=np.int32)
        do_sample = np.array(sample_l, dtype=bool)
        num_reqs = len(rows)
        num_tokens = int(lens.sum())
        max_drafts = int(drafts.max())
        query_len = int(lens[0])
        # a decode graph serves decode steps only: a one-token prompt chunk may need the
        # ModelState's eager input work (an image token's embedding)
        uniform = bool(not in_prompt and (lens == query_len).all()
                       and (drafts == query_len - 1).all())

        qsl_cpu = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl_cpu[1:])
        cu_logits = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(drafts + 1, out=cu_logits[1:])
        num_logits = int(cu_logits[-1])
        padded = mixed = None
        mixed_rows = 0  # a mixed graph's logits rows
        graphs = self.graphs
        if graphs is not None and uniform:
            padded = graphs.padded_size(query_len, num_reqs)
        if graphs is not None and padded is None and graph_ok:
            mixed = graphs.mixed_size(num_tokens, num_reqs, num_logits)
        if padded:
            num_padded, num_tokens_padded = padded, padded * query_len
        elif mixed:
            assert graphs is not None
            graph = graphs.mixed_graphs[mixed]
            num_padded, num_tokens_padded, mixed_rows = graph.num_reqs, mixed, graph.num_rows
        else:
            num_padded, num_tokens_padded = num_reqs, num_tokens
        query_start_loc = np.full(num_padded + 1, num_tokens, dtype=np.int32)
        query_start_loc[: num_reqs + 1] = qsl_cpu

        arrays: dict[str, np.ndarray] = {
            "idx_mapping": rows, "query_start_loc": query_start_loc,
            "do_sample": do_sample.astype(np.int32),
        }
        if max_drafts:
            arrays["logits_indices"] = last_token_indices(qsl_cpu, drafts + 1)
            arrays["logits_rows"] = np.repeat(rows, drafts + 1)
            arrays["cu_num_logits"] = cu_logits
            arrays["num_drafts"] = drafts
        arrays.update(staged.arrays())
        dev = uploader.upload(arrays)
        staged.apply(dev)

        idx_mapping = buffers.idx_mapping[:num_reqs]
        idx_mapping.copy_(dev["idx_mapping"])
        query_start_loc_dev = buffers.query_start_loc[: num_padded + 1]
        query_start_loc_dev.copy_(dev["query_start_loc"])
        logits_indices = buffers.logits_indices[:num_logits]
        if max_drafts:
            logits_indices.copy_(dev["logits_indices"])
            logits_idx_mapping = buffers.logits_idx_mapping[:num_logits]
            logits_idx_mapping.copy_(dev["logits_rows"])
            written = num_logits
        else:  # (a mixed graph's padding requests too: their rows point at the last token)
            written = num_padded if mixed else num_reqs
            torch.sub(query_start_loc_dev[1 : written + 1], 1,
                      out=buffers.logits_indices[:written])
            logits_idx_mapping = idx_mapping
        if mixed_rows > written:  # the rest of a mixed graph's logits rows: any valid token
            buffers.logits_indices[written:mixed_rows].fill_(num_tokens - 1)
        return _Layout(
            key=key, rows=rows, drafts=drafts, do_sample=do_sample, qsl_cpu=qsl_cpu,
            cu_logits=cu_logits, dev=dev, idx_mapping=idx_mapping,
            query_start_loc=query_start_loc_dev, logits_indices=logits_indices,
            logits_idx_mapping=logits_idx_mapping, num_tokens=num_tokens,
            num_tokens_padded=num_tokens_padded,
            num_padded=num_padded, num_logits=num_logits, max_drafts=max_drafts,
            max_query_len=int(lens.max()), uniform=uniform,
            replay_query_len=query_len if padded else 0, replay_tokens=mixed or 0)


@dataclass
class _Layout:
    """What a step's requests, query lengths, drafts and sampling flags fix: its CPU arrays,
    its uploaded arrays and the buffer views they were written into."""

    key: tuple[Any, ...]
    rows: np.ndarray
    drafts: np.ndarray
    do_sample: np.ndarray
    qsl_cpu: np.ndarray
    cu_logits: np.ndarray
    dev: dict[str, torch.Tensor]
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    logits_idx_mapping: torch.Tensor
    num_tokens: int
    num_tokens_padded: int
    num_padded: int
    num_logits: int
    max_drafts: int
    max_query_len: int
    uniform: bool
    replay_query_len: int
    replay_tokens: int


def _ragged_index(rows: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, column)`` index of columns ``0 .. lens[i] - 1`` of each ``rows[i]``, rows in
    order."""
    firsts = np.cumsum(lens) - lens  # where each row's run starts in the concatenation
    return np.repeat(rows, lens), np.arange(int(lens.sum())) - np.repeat(firsts, lens)


def _concat(lists: list[list[int]], total: int) -> np.ndarray:
    """The int lists one after another as one int32 array of ``total`` values."""
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=total)
