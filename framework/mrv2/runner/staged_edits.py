"""One step's CPU edits of the state table, sent with the step's packed upload.

New rows' tokens, block-table entries, sampling params and penalty state travel as small
arrays in the step's single host-to-device copy and are scattered into the table by a few
``index_put`` launches (:meth:`StagedEdits.apply`).
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.runner.state_table import RequestStateTable
from mrv2.sample.params import SamplingParams

# Per-row parameters, in column order of the staged float / int arrays.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")
_INT_FIELDS = ("top_k", "seed", "num_computed", "num_tokens", "min_tokens", "prefill_len")


class StagedEdits:
    """CPU edits of this step (new rows' tokens, blocks, params), sent with the step's arrays."""

    def __init__(self) -> None:
        self.tok_rows: list[np.ndarray] = []
        self.tok_cols: list[np.ndarray] = []
        self.tok_vals: list[np.ndarray] = []
        self.blk_rows: list[int] = []
        self.blk_cols: list[int] = []
        self.blk_vals: list[int] = []
        self.rows: list[int] = []
        self.floats: list[tuple[float, ...]] = []
        self.ints: list[tuple[int, ...]] = []
        self.out_rows: list[np.ndarray] = []
        self.out_vals: list[np.ndarray] = []
        self.pm_rows: list[int] = []
        self.pm_vals: list[np.ndarray] = []

    def add_tokens(self, row: int, tokens: list[int]) -> None:
        self.tok_rows.append(np.full(len(tokens), row, dtype=np.int64))
        self.tok_cols.append(np.arange(len(tokens), dtype=np.int64))
        self.tok_vals.append(np.asarray(tokens, dtype=np.int32))

    def add_row(
        self, row: int, params: SamplingParams, seed: int, num_computed: int, num_tokens: int
    ) -> None:
        """A new row's sampling parameters and counts (columns: ``_FLOAT_FIELDS``,
        ``_INT_FIELDS``; ``prefill_len`` is the prompt length the penalties see)."""
        self.rows.append(row)
        self.floats.append((params.temperature, params.top_p, params.min_p,
                            params.repetition_penalty, params.frequency_penalty,
                            params.presence_penalty))
        self.ints.append((params.top_k, seed, num_computed, num_tokens, params.min_tokens,
                          params.prompt_len(num_tokens)))

    def add_prompt_mask(self, row: int, tokens: list[int], prompt_len: int) -> None:
        """Reset ``row``'s penalty state from its prefill: the first ``prompt_len`` tokens
        form the prompt mask, the rest (outputs of a resumed request) the output counts."""
        self.pm_rows.append(row)
        self.pm_vals.append(np.asarray(tokens[:prompt_len], dtype=np.int64))
        if prompt_len < len(tokens):
            self.out_rows.append(np.full(len(tokens) - prompt_len, row, dtype=np.int64))
            self.out_vals.append(np.asarray(tokens[prompt_len:], dtype=np.int64))

    def add_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        self.blk_rows.extend([row] * len(block_ids))
        self.blk_cols.extend(range(start, start + len(block_ids)))
        self.blk_vals.extend(block_ids)

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if self.tok_rows:
            out["tok_rows"] = np.concatenate(self.tok_rows)
            out["tok_cols"] = np.concatenate(self.tok_cols)
            out["tok_vals"] = np.concatenate(self.tok_vals)
        if self.blk_rows:
            out["blk_rows"] = np.asarray(self.blk_rows, dtype=np.int64)
            out["blk_cols"] = np.asarray(self.blk_cols, dtype=np.int64)
            out["blk_vals"] = np.asarray(self.blk_vals, dtype=np.int32)
        if self.rows:
            out["p_rows"] = np.asarray(self.rows, dtype=np.int64)
            out["p_float"] = np.asarray(self.floats, dtype=np.float32)
            out["p_int"] = np.asarray(self.ints, dtype=np.int64)
        if self.pm_rows:
            out["pm_rows"] = np.asarray(self.pm_rows, dtype=np.int64)
            pairs = zip(self.pm_rows, self.pm_vals, strict=True)
            out["pm_tok_rows"] = np.concatenate(
                [np.full(len(v), r, dtype=np.int64) for r, v in pairs]
            )
            out["pm_tok_vals"] = np.concatenate(self.pm_vals)
        if self.out_rows:
            out["out_rows"] = np.concatenate(self.out_rows)
            out["out_vals"] = np.concatenate(self.out_vals)
        return out

    @staticmethod
    def apply(dev: dict[str, torch.Tensor], table: RequestStateTable) -> None:
        """Scatter the staged edits into the device table (a few index_put launches)."""
        if "tok_rows" in dev:
            table.token_ids.index_put_((dev["tok_rows"], dev["tok_cols"]), dev["tok_vals"])
        if "blk_rows" in dev:
            table.block_table.index_put_((dev["blk_rows"], dev["blk_cols"]), dev["blk_vals"])
        if "p_rows" in dev:
            rows = dev["p_rows"]
            for i, name in enumerate(_FLOAT_FIELDS):
                getattr(table, name)[rows] = dev["p_float"][:, i]
            for i, name in enumerate(_INT_FIELDS):
                column = getattr(table, name)
                column[rows] = dev["p_int"][:, i].to(column.dtype)
        if "pm_rows" in dev:
            assert table.output_counts is not None and table.prompt_mask is not None
            table.output_counts[dev["pm_rows"]] = 0
            table.prompt_mask[dev["pm_rows"]] = False
            table.prompt_mask[dev["pm_tok_rows"], dev["pm_tok_vals"]] = True
        if "out_rows" in dev:
            assert table.output_counts is not None
            ones = torch.ones_like(dev["out_rows"], dtype=torch.int32)
            table.output_counts.index_put_((dev["out_rows"], dev["out_vals"]), ones,
                                           accumulate=True)
