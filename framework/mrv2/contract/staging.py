"""Host-to-device transfer of each step's small arrays: one packed copy per step.

Arrays are packed into one pinned host buffer and sent with one non-blocking copy. Buffers are
used in rotation and each waits on the event of its previous copy before the CPU writes it
again, so step N+1's host writes never race step N's copy. With the CPU one step ahead at most,
that wait finds the copy long finished.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16


class Uploader:
    """Sends dicts of numpy arrays to ``device`` through rotating pinned buffers."""

    def __init__(self, device: torch.device, num_buffers: int = 3, capacity: int = 1 << 16) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers = [self._alloc(capacity) for _ in range(num_buffers)]
        self._events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Copy every array to the device; returns device tensors of the same dtypes and shapes."""
        layout: list[tuple[str, int, np.ndarray]] = []
        offset = 0
        for name, array in arrays.items():
            array = np.ascontiguousarray(array)
            layout.append((name, offset, array))
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        total = max(offset, _ALIGN)
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        event = self._events[index]
        if event is not None:
            event.synchronize()  # the copy of len(buffers) steps ago: long done
        if self._buffers[index].numel() < total:
            self._buffers[index] = self._alloc(max(total, 2 * self._buffers[index].numel()))
        host = self._buffers[index]
        host_np = host.numpy()
        for _, start, array in layout:
            host_np[start : start + array.nbytes] = array.view(np.uint8).reshape(-1)
        if self.device.type == "cpu":
            packed = host[:total].clone()
        else:
            packed = torch.empty(total, dtype=torch.uint8, device=self.device)
            packed.copy_(host[:total], non_blocking=True)
            recorded = torch.cuda.Event()
            recorded.record()
            self._events[index] = recorded
        out: dict[str, torch.Tensor] = {}
        for name, start, array in layout:
            dtype = _TORCH_DTYPES[array.dtype.str]
            piece = packed[start : start + array.nbytes].view(dtype)
            out[name] = piece.view(array.shape)
        return out


_TORCH_DTYPES: dict[str, torch.dtype] = {
    np.dtype(np.int32).str: torch.int32,
    np.dtype(np.int64).str: torch.int64,
    np.dtype(np.float32).str: torch.float32,
    np.dtype(np.bool_).str: torch.bool,
    np.dtype(np.uint8).str: torch.uint8,
}


def to_device(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without a CPU-GPU sync.

    ``torch.tensor(..., device="cuda")`` copies from pageable memory and waits for the copy;
    this stages through pinned memory with a non-blocking copy (the caching host allocator keeps
    the pinned block until the copy has run). For the rare per-step index lists of the sampler.
    """
    cpu = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)
