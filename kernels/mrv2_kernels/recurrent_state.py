"""The state-row contract of the linear-attention layers' device ops (the causal conv of
:mod:`mrv2_kernels.causal_conv1d`; the gated delta rule of :mod:`mrv2_kernels.linear_attention`
and :mod:`mrv2_kernels.chunk_delta_rule`), and the helpers they share to keep it.

The ops are varlen over a flat token batch and keep per-request state in a tensor indexed by a
state **row** (not by batch position). Per step (all device tensors, no host syncs on the
Triton path):

* ``query_start_loc`` int32 ``[N + 1]``, ``query_start_loc[0] == 0``: sequence ``i`` owns
  tokens ``query_start_loc[i]:query_start_loc[i + 1]``; ``N`` may count padding sequences of
  length 0, and tokens past ``query_start_loc[N]`` are padding.
* ``seq_lens`` int32 ``[N]``: the sequence's length after this step; its chunk starts at
  ``start = seq_lens[i] - query length``. ``start > 0``: the row holds the state after the
  first ``start`` tokens; ``start == 0``: begin from zeros, whatever the row holds.
* ``state_rows`` int32 ``[N]``: sequence ``i``'s state row. Real sequences have distinct rows; a
  zero-length sequence neither reads nor writes its row (so padding may alias any row).

Prefix caching (``state_table``, optional, int32 ``[R_req, 6]``, indexed by a sequence's state
row): ``(src_row, src_pos, snap_pos0, snap_row0, snap_pos1, snap_row1)``. A chunk that starts at
``start == src_pos`` reads its initial state from row ``src_row`` instead of its own (a request
resuming from a snapshot of a cached prefix); and when the chunk covers absolute position
``snap_pos`` (``start < snap_pos <= start + length``), the state after the first ``snap_pos``
tokens is also stored in row ``snap_row`` (a snapshot for later requests). A row's defaults
``(row, -1, -1, 0, -1, 0)`` mean neither. Snapshot rows are distinct from every row the step
reads or writes otherwise (the engine's rule), so the stores race with nothing.

Speculative decoding (``row_slots = S > 1``, the verify step's ``1 + k`` tokens): each
sequence owns ``S`` consecutive state rows, ``state_rows[i] * S + j``, and the state after a
sequence's first ``c`` tokens lives in row ``state_rows[i] * S + c % S``. A chunk reads its
initial state from the row of its ``start`` and stores the states after each of its last ``S``
tokens (the final one included), so the next step, whose ``start`` is the accepted count the
device computed, reads the state after the last accepted token: rejected drafts are dropped
without a host sync and without recomputing anything. ``S = 1`` is the plain layout. Table rows
(``src_row``, snapshot rows) are absolute rows (snapshot slots after the ``R_req * S`` rows).

State layouts: the conv state is ``[R, W - 1, D]`` in ``x``'s dtype (each row's last ``W - 1``
inputs, oldest first); the recurrent state is ``[R, Hv, K, V]`` fp32. Outputs are zero on
padding tokens (the kernels write those zeros; nothing is left uninitialised).

The Triton kernels give one program to each (sequence, channel block), which owns its state
tile and walks the sequence's tokens in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_ROW_SLOTS",
    "STATE_TABLE_COLS",
    "SequenceChunk",
    "check_row_slots",
    "default_state_table",
    "iter_sequences",
    "kept_counts",
]

#: dtypes the Triton kernels take for activations (loaded and converted to fp32 at once).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The most state rows a sequence may own (``row_slots``: 1 + at most 16 drafts).
MAX_ROW_SLOTS = 17


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


#: Columns of a ``state_table`` row: ``(src_row, src_pos, snap_pos0, snap_row0, snap_pos1,
#: snap_row1)``.
STATE_TABLE_COLS = 6


def default_state_table(rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``state_table`` of ``rows`` rows that changes nothing: each row reads its own state
    and stores no snapshot."""
    table = torch.zeros((rows, STATE_TABLE_COLS), dtype=torch.int32, device=device)
    table[:, 0] = torch.arange(rows, dtype=torch.int32, device=device)
    table[:, 1] = table[:, 2] = table[:, 4] = -1
    return table


def _check_table(state_table: torch.Tensor | None) -> None:
    if state_table is None:
        return
    if state_table.dim() != 2 or state_table.shape[1] != STATE_TABLE_COLS:
        raise ValueError(f"state_table must be [R, {STATE_TABLE_COLS}], got "
                         f"{tuple(state_table.shape)}")
    if state_table.dtype != torch.int32 or not state_table.is_contiguous():
        # (the token-serial kernels address a row as 6 ints: a column slice of a wider table
        # would send their snapshot stores to other rows)
        raise TypeError("state_table must be a contiguous int32 tensor")


def _table_host(state_table: torch.Tensor | None, row: int, start: int, row_slots: int = 1
                ) -> tuple[int, list[tuple[int, int]]]:
    """The references' reading of ``state_table``: the row to read the initial state from and
    the ``(tokens into the chunk, row)`` of each snapshot (unfiltered by the chunk length)."""
    own = row * row_slots + start % row_slots
    if state_table is None:
        return own, []
    src_row, src_pos, p0, r0, p1, r1 = state_table[row].tolist()
    return (src_row if start == src_pos else own), [(p0 - start, r0), (p1 - start, r1)]


def check_row_slots(row_slots: int) -> int:
    """``row_slots`` as an int, ``ValueError`` unless it is 1 to 17 (``1 +
    num_speculative_tokens``, at most 16 drafts)."""
    if isinstance(row_slots, bool) or not isinstance(row_slots, int) or not \
            1 <= row_slots <= MAX_ROW_SLOTS:
        raise ValueError(f"row_slots must be an int in 1..{MAX_ROW_SLOTS} (1 + "
                         f"num_speculative_tokens), got {row_slots!r}")
    return row_slots


def kept_counts(start: int, length: int, row_slots: int) -> list[tuple[int, int]]:
    """The references' stores of a chunk: ``(tokens into the chunk, row offset)`` of the states
    kept, the chunk's last ``row_slots`` (the final one last)."""
    return [(c, (start + c) % row_slots) for c in range(max(1, length - row_slots + 1),
                                                         length + 1)]


class SequenceChunk(NamedTuple):
    """One sequence's chunk of a step as the plain-torch references read it (host ints; rows
    are absolute rows of the state tensor)."""

    bos: int
    """The chunk's first token in the flat batch."""
    eos: int
    """One past its last token (``eos - bos`` is the chunk's length, at least 1)."""
    row: int
    """The sequence's state row (``state_rows[i]``): it owns rows ``row * S .. row * S + S - 1``
    (``S = row_slots``)."""
    start: int
    """Tokens before the chunk: ``start == 0`` begins from zeros, else from row ``src``."""
    src: int
    """The row holding the state after the first ``start`` tokens: ``row * S + start % S``, or
    the table's ``src_row`` when ``start == src_pos``."""
    snaps: list[tuple[int, int]]
    """``(tokens into the chunk, row)`` of the table's snapshots the chunk covers (``0 < c <=
    length``), in the table's order."""
    kept: list[tuple[int, int]]
    """``(tokens into the chunk, row)`` of the states kept in the sequence's own rows, its last
    ``S`` (:func:`kept_counts`), the final state last."""

    @property
    def length(self) -> int:
        """The chunk's token count."""
        return self.eos - self.bos


def iter_sequences(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   state_rows: torch.Tensor, state_table: torch.Tensor | None = None,
                   row_slots: int = 1) -> Iterator[SequenceChunk]:
    """The per-sequence loop of the plain-torch references: a :class:`SequenceChunk` for each
    sequence of the step with tokens, in order (zero-length and padding sequences skipped).
    Reads the metadata on the host; checks nothing (the references check it first, with
    ``_check_meta``, ``_check_table`` and :func:`check_row_slots`)."""
    qsl, lens, rows = query_start_loc.tolist(), seq_lens.tolist(), state_rows.tolist()
    for i in range(len(rows)):
        bos, eos = qsl[i], qsl[i + 1]
        length = eos - bos
        if length <= 0:
            continue
        row, start = rows[i], lens[i] - length
        src, snaps = _table_host(state_table, row, start, row_slots)
        yield SequenceChunk(bos, eos, row, start, src,
                            [(c, r) for c, r in snaps if 0 < c <= length],
                            [(c, row * row_slots + j)
                             for c, j in kept_counts(start, length, row_slots)])


def _check_meta(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                state_rows: torch.Tensor) -> int:
    """The sequence count ``N`` after checking the metadata's shapes and dtypes (no sync)."""
    n = query_start_loc.shape[0] - 1
    if query_start_loc.dim() != 1 or n < 0:
        raise ValueError("query_start_loc must be 1-D of length N + 1")
    for name, t in (("seq_lens", seq_lens), ("state_rows", state_rows)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    for t in (query_start_loc, seq_lens, state_rows):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"step metadata must be int32 (or int64), got {t.dtype}")
    return n


@triton.jit
def _zero_tail(out_ptr: tl.tensor, qsl_ptr: tl.tensor, num_seqs: tl.tensor,
               num_tokens: tl.tensor, out_stride: int, cols: tl.tensor, cmask: tl.tensor,
               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr) -> None:
    """Triton helper: zeros in ``out_ptr``'s rows ``query_start_loc[N]:num_tokens`` (the
    padding tokens), columns ``cols`` (``[BLOCK_C]``) where ``cmask``."""
    end = tl.load(qsl_ptr + num_seqs).to(tl.int32)
    zero = tl.zeros([BLOCK_T, BLOCK_C], dtype=out_ptr.dtype.element_ty)
    t_offs = tl.arange(0, BLOCK_T)
    for t0 in range(end, num_tokens, BLOCK_T):
        t = t0 + t_offs
        dst = out_ptr + t.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(dst, zero, mask=(t < num_tokens)[:, None] & cmask[None, :])

