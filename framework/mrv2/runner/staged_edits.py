"""One step's CPU edits of the state table, sent with the step's packed upload.

New rows' tokens, block-table entries, sampling params and penalty state travel as small
arrays in the step's single host-to-device copy and are scattered into the table by a few
``index_put`` launches (:meth:`StagedEdits.apply`).
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.runner.state_table import RequestStateTable


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
        self.params: list[tuple[float, int, float, float, int, int, int]] = []
        self.params2: list[tuple[float, float, float, int, int]] = []
        self.out_rows: list[np.ndarray] = []
        self.out_vals: list[np.ndarray] = []
        self.pm_rows: list[int] = []
        self.pm_vals: list[np.ndarray] = []

    def add_tokens(self, row: int, tokens: list[int]) -> None:
        self.tok_rows.append(np.full(len(tokens), row, dtype=np.int64))
        self.tok_cols.append(np.arange(len(tokens), dtype=np.int64))
        self.tok_vals.append(np.asarray(tokens, dtype=np.int32))

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
            p = self.params
            out["p_rows"] = np.asarray(self.rows, dtype=np.int64)
            out["p_float"] = np.asarray([(t, tp, mp) for t, _, tp, mp, *_ in p], dtype=np.float32)
            out["p_int"] = np.asarray([(k, s, c, n) for _, k, _, _, s, c, n in p], dtype=np.int64)
            out["p_pen"] = np.asarray([q[:3] for q in self.params2], dtype=np.float32)
            out["p_min"] = np.asarray([q[3:] for q in self.params2], dtype=np.int32)
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
            rows, floats, ints = dev["p_rows"], dev["p_float"], dev["p_int"]
            table.temperature[rows] = floats[:, 0]
            table.top_p[rows] = floats[:, 1]
            table.min_p[rows] = floats[:, 2]
            table.top_k[rows] = ints[:, 0].int()
            table.seed[rows] = ints[:, 1]
            table.num_computed[rows] = ints[:, 2].int()
            table.num_tokens[rows] = ints[:, 3].int()
            table.prefill_len[rows] = dev["p_min"][:, 1]
            table.repetition_penalty[rows] = dev["p_pen"][:, 0]
            table.frequency_penalty[rows] = dev["p_pen"][:, 1]
            table.presence_penalty[rows] = dev["p_pen"][:, 2]
            table.min_tokens[rows] = dev["p_min"][:, 0]
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
