"""Full CUDA graphs of uniform-decode steps, one per padded batch size.

A decode step of ``B`` requests (one query token each) is padded to the smallest captured size
``>= B``; the graph replays the model forward and the logits over the persistent input buffers.
Padding requests have zero-length queries and padding tokens write no KV (slot -1), so they
change nothing. Attention metadata baked into a graph bounds sequence length by
``max_model_len``; the kernels read the real lengths from the buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mrv2.runner.input_batch import InputBatch


def capture_sizes(max_num_reqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16, capped at ``max_num_reqs``."""
    top = min(max_num_reqs, limit)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top, 256) + 1, 8))
    sizes += list(range(272, top + 1, 16))
    if top not in sizes:
        sizes.append(top)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured graphs and their output logits, keyed by padded batch size."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a batch of ``num_reqs`` decodes replays at, or ``None``."""
        for size in self.sizes:
            if size >= num_reqs and size in self.graphs:
                return size
        return None

    def capture_all(
        self,
        dummy_batch: Callable[[int], InputBatch],
        forward_logits: Callable[[InputBatch], torch.Tensor],
        capture: Callable[[InputBatch, Callable[[], torch.Tensor]], object],
    ) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool.

        ``capture`` (the ModelState hook) may return ``None`` for a size it cannot capture; that
        size then runs eager.
        """
        for size in sorted(self.sizes, reverse=True):
            batch = dummy_batch(size)
            forward_logits(batch)  # warm up: compile kernels outside the capture
            torch.cuda.synchronize()
            out: dict[str, torch.Tensor] = {}

            def body(batch: InputBatch = batch, out: dict[str, torch.Tensor] = out) -> torch.Tensor:
                out["logits"] = forward_logits(batch)
                return out["logits"]

            graph = capture(batch, body)
            if graph is not None:
                self.graphs[size] = graph
                self.outputs[size] = out["logits"]
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size``; returns its ``[size, vocab]`` logits buffer."""
        self.graphs[size].replay()  # type: ignore[attr-defined]
        return self.outputs[size]
