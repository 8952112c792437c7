"""One step's CPU edits of device tensors, sent with the step's packed upload.

Whoever owns per-request device columns (the runner's state table, the sampler's parameter
columns, a ModelState's extras) stages its writes here when a request takes a row; the values
travel in the step's single host-to-device copy and :meth:`StagedEdits.apply` scatters them
with one ``index_put_`` per target tensor and kind (writes to the same tensor from several new
requests are concatenated). Edits of one target apply in the order first staged; a step stages
each row at most once, so a ``fill`` of a row before a ``put`` into it keeps its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class _Edit:
    target: torch.Tensor
    kind: str  # "put", "add" (accumulating put) or "fill"
    index: list[list[np.ndarray]] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    fill_value: float | int | bool = 0


class StagedEdits:
    """CPU edits of this step, sent with the step's arrays and applied on the device."""

    def __init__(self) -> None:
        self._edits: dict[tuple[int, str, object], _Edit] = {}

    def __bool__(self) -> bool:
        """Whether anything is staged."""
        return bool(self._edits)

    def put(
        self, target: torch.Tensor, index: tuple[np.ndarray, ...], values: np.ndarray,
        accumulate: bool = False,
    ) -> None:
        """``target[index] = values`` (``+=`` with ``accumulate``); ``index`` one int array per
        indexed dimension, ``values`` matching (a row of values per index for 2-D targets
        indexed by rows only)."""
        kind = "add" if accumulate else "put"
        edit = self._edits.setdefault((id(target), kind, len(index)), _Edit(target, kind))
        edit.index.append([np.asarray(i, dtype=np.int64) for i in index])
        values = np.ascontiguousarray(values)
        if values.dtype == np.float64:
            values = values.astype(np.float32)
        edit.values.append(values)

    def fill(self, target: torch.Tensor, rows: np.ndarray, value: float | int | bool) -> None:
        """``target[rows] = value``."""
        key = (id(target), "fill", value)
        edit = self._edits.setdefault(key, _Edit(target, "fill", fill_value=value))
        edit.index.append([np.asarray(rows, dtype=np.int64)])

    def arrays(self) -> dict[str, np.ndarray]:
        """The staged index and value arrays, named for :meth:`apply`."""
        out: dict[str, np.ndarray] = {}
        for n, edit in enumerate(self._edits.values()):
            for d in range(len(edit.index[0])):
                out[f"e{n}i{d}"] = np.concatenate([ix[d] for ix in edit.index])
            if edit.kind != "fill":
                out[f"e{n}v"] = np.concatenate(edit.values)
        return out

    def apply(self, dev: dict[str, torch.Tensor]) -> None:
        """Scatter the staged edits into their targets (the arrays uploaded)."""
        for n, edit in enumerate(self._edits.values()):
            index = tuple(dev[f"e{n}i{d}"] for d in range(len(edit.index[0])))
            target = edit.target
            if edit.kind == "fill":
                value = torch.full((), edit.fill_value, dtype=target.dtype, device=target.device)
                target.index_put_(index, value)
            else:
                target.index_put_(index, dev[f"e{n}v"].to(target.dtype),
                                  accumulate=edit.kind == "add")
