"""Full CUDA graphs of uniform-decode steps, one per (query length, padded batch size).

A decode step of ``B`` requests of ``q`` query tokens each (``q = 1``, or ``1 + k`` while
verifying ``k`` drafts) is padded to the smallest captured size ``>= B`` for that ``q``; the
graph replays the model forward and the logits of every token over the persistent input
buffers. Padding requests have zero-length queries and padding tokens write no KV (slot -1), so
they change nothing. Attention metadata baked into a graph bounds sequence length by
``max_model_len``; the kernels read the real lengths from the buffers.

Without a speculator, each ``(1, size)`` graph also gets a *sampling tail* graph when the
sampler can capture its common plan (``Sampler.capturable``: temperature or greedy rows, no
top-k/top-p, min-p, rare stages or logprobs): sampling the graph's logits and the post-update
of the state table, replayed right after the forward, so a decode step launches two graphs and
no sampler kernel from Python. Its padding requests have empty queries (the post-update skips
them) and their sampled tokens are never read.

A speculator whose ``propose`` is capturable (``Speculator.cuda_graphs``) gets a second graph
per ``(1 + k, size)``: all of a decode step's drafting (the drafter's catch-up and its ``k``
draft steps) over the target graph's hidden-state output and a persistent copy of the step's
samples, replayed right after sampling. Its padding requests sampled nothing, so they draft
nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.samples import StepSamples

Outputs = tuple[torch.Tensor, torch.Tensor]
"""``(hidden states [T, hidden], logits [T, vocab])`` of a captured step."""


def _sync() -> None:
    if torch.cuda.is_initialized():  # a CPU stand-in capture (tests) has nothing to wait for
        torch.cuda.synchronize()


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
        self.draft_graphs: dict[tuple[int, int], object] = {}
        self._draft_samples: StepSamples | None = None
        self.tail_graphs: dict[int, object] = {}
        self.tail_tokens: torch.Tensor | None = None

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
            _sync()
            out: dict[str, Outputs] = {}

            def body(batch: InputBatch = batch, out: dict[str, Outputs] = out) -> Outputs:
                out["step"] = forward(batch)
                return out["step"]

            graph = capture(batch, body)
            if graph is not None:
                self.graphs[(q, size)] = graph
                self.outputs[(q, size)] = out["step"]
        _sync()

    def replay(self, query_len: int, size: int) -> Outputs:
        """Replay the graph of ``(query_len, size)``; returns its output buffers."""
        self.graphs[(query_len, size)].replay()  # type: ignore[attr-defined]
        return self.outputs[(query_len, size)]

    def capture_drafts(
        self,
        query_len: int,
        dummy_batch: Callable[[int, int], InputBatch],
        propose: Callable[[InputBatch, StepSamples, torch.Tensor], None],
        capture: Callable[[InputBatch, Callable[[], None]], object],
    ) -> None:
        """Capture ``propose(batch, samples, hidden)`` after every captured ``(query_len, size)``
        step, over that graph's hidden states and persistent samples (nothing sampled during
        capture, so the warm-up and the capture write no drafts and no KV)."""
        sizes = [s for s in self.plan.get(query_len, ()) if (query_len, s) in self.graphs]
        if not sizes:
            return
        top = max(sizes)
        device = self.outputs[(query_len, top)][0].device
        static = self._draft_samples = StepSamples(
            torch.full((top, query_len), -1, dtype=torch.int64, device=device),
            torch.zeros(top, dtype=torch.int32, device=device),
        )
        for size in sorted(sizes, reverse=True):
            batch = dummy_batch(size, query_len)
            samples = StepSamples(static.tokens[:size], static.num_sampled[:size])
            hidden = self.outputs[(query_len, size)][0]
            propose(batch, samples, hidden)  # warm up: compile kernels outside the capture
            _sync()

            def body(batch: InputBatch = batch, samples: StepSamples = samples,
                     hidden: torch.Tensor = hidden) -> None:
                propose(batch, samples, hidden)

            graph = capture(batch, body)
            if graph is not None:
                self.draft_graphs[(query_len, size)] = graph
        _sync()

    def replay_drafts(self, query_len: int, size: int, samples: StepSamples) -> bool:
        """Replay the drafting graph of ``(query_len, size)`` for this step's ``samples``
        (copied in; the padding requests' counts zeroed); False when there is none."""
        graph = self.draft_graphs.get((query_len, size))
        if graph is None:
            return False
        static = self._draft_samples
        assert static is not None
        num_reqs, width = samples.tokens.shape
        static.num_sampled[:num_reqs].copy_(samples.num_sampled)
        static.num_sampled[num_reqs:size].zero_()
        static.tokens[:num_reqs, :width].copy_(samples.tokens)
        graph.replay()  # type: ignore[attr-defined]
        return True

    def capture_tails(
        self,
        dummy_batch: Callable[[int, int], InputBatch],
        sample_tail: Callable[[InputBatch, torch.Tensor, torch.Tensor], None],
        capture: Callable[[InputBatch, Callable[[], None]], object],
    ) -> None:
        """Capture ``sample_tail(batch, logits, tokens)`` after every captured ``(1, size)``
        step: it samples that graph's logits into ``tokens`` (a persistent buffer outside the
        graphs' memory pool, read by the host copy) and updates the state table. The warm-up
        and the capture see only empty queries (the batch's ``query_start_loc`` zeroed), so
        they change no row."""
        sizes = [s for s in self.plan.get(1, ()) if (1, s) in self.graphs]
        if not sizes:
            return
        top = max(sizes)
        device = self.outputs[(1, top)][1].device
        self.tail_tokens = torch.zeros(top, dtype=torch.int64, device=device)
        for size in sorted(sizes, reverse=True):
            batch = dummy_batch(size, 1)
            batch.query_start_loc.zero_()
            logits = self.outputs[(1, size)][1]
            tokens = self.tail_tokens[:size]
            sample_tail(batch, logits, tokens)  # warm up: compile kernels outside the capture
            _sync()

            def body(batch: InputBatch = batch, logits: torch.Tensor = logits,
                     tokens: torch.Tensor = tokens) -> None:
                sample_tail(batch, logits, tokens)

            graph = capture(batch, body)
            if graph is not None:
                self.tail_graphs[size] = graph
        _sync()

    def replay_tail(self, size: int) -> torch.Tensor | None:
        """Replay the sampling tail of the ``(1, size)`` graph (after that graph); returns its
        ``[size]`` tokens, or None when there is no tail graph of that size."""
        graph = self.tail_graphs.get(size)
        if graph is None:
            return None
        assert self.tail_tokens is not None
        graph.replay()  # type: ignore[attr-defined]
        return self.tail_tokens[:size]
