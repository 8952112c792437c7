"""Full CUDA graphs of uniform-decode steps, one per (query length, padded batch size).

A decode step of ``B`` requests of ``q`` query tokens each (``q = 1``, or ``1 + k`` while
verifying ``k`` drafts) is padded to the smallest captured size ``>= B`` for that ``q``; the
graph replays the model forward and the logits of every token over the persistent input
buffers. Padding requests have zero-length queries and padding tokens write no KV (slot -1), so
they change nothing. Attention metadata baked into a graph bounds sequence length by
``max_model_len``; the kernels read the real lengths from the buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mrv2.contract.batch import InputBatch

Outputs = tuple[torch.Tensor, torch.Tensor]
"""``(hidden states [T, hidden], logits [T, vocab])`` of a captured step."""


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
    """Captured graphs and their outputs, keyed by ``(query length, padded batch size)``."""

    def __init__(self, sizes: list[int], query_lens: list[int], max_num_tokens: int) -> None:
        self.plan = {q: sorted(s for s in sizes if s * q <= max_num_tokens) for q in query_lens}
        self.graphs: dict[tuple[int, int], object] = {}
        self.outputs: dict[tuple[int, int], Outputs] = {}

    def padded_size(self, query_len: int, num_reqs: int) -> int | None:
        """The captured size a batch of ``num_reqs`` requests of ``query_len`` tokens replays
        at, or ``None``."""
        for size in self.plan.get(query_len, ()):
            if size >= num_reqs and (query_len, size) in self.graphs:
                return size
        return None

    def capture_all(
        self,
        dummy_batch: Callable[[int, int], InputBatch],
        forward: Callable[[InputBatch], Outputs],
        capture: Callable[[InputBatch, Callable[[], Outputs]], object],
    ) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool.

        ``capture`` (the ModelState's) may return ``None`` for a size it cannot capture; that
        size then runs eager.
        """
        keys = [(q, s) for q, sizes in self.plan.items() for s in sizes]
        for q, size in sorted(keys, key=lambda k: k[0] * k[1], reverse=True):
            batch = dummy_batch(size, q)
            forward(batch)  # warm up: compile kernels outside the capture
            torch.cuda.synchronize()
            out: dict[str, Outputs] = {}

            def body(batch: InputBatch = batch, out: dict[str, Outputs] = out) -> Outputs:
                out["step"] = forward(batch)
                return out["step"]

            graph = capture(batch, body)
            if graph is not None:
                self.graphs[(q, size)] = graph
                self.outputs[(q, size)] = out["step"]
        torch.cuda.synchronize()

    def replay(self, query_len: int, size: int) -> Outputs:
        """Replay the graph of ``(query_len, size)``; returns its output buffers."""
        self.graphs[(query_len, size)].replay()  # type: ignore[attr-defined]
        return self.outputs[(query_len, size)]
