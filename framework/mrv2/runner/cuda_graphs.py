"""Full CUDA graphs of uniform-decode steps, one per (query length, padded batch size), and of
small mixed steps, one per padded token count.

A decode step of ``B`` requests of ``q`` query tokens each (``q = 1``, or ``1 + k`` while
verifying ``k`` drafts) is padded to the smallest captured size ``>= B`` for that ``q``; the
graph replays the model forward and the logits of every token over the persistent input
buffers. Padding requests have zero-length queries and padding tokens write no KV (slot -1), so
they change nothing. Attention metadata baked into a graph bounds sequence length by
``max_model_len``; the kernels read the real lengths from the buffers.

Each graph also gets a *sampling tail* graph when the sampler can capture its common plan
(``Sampler.capturable``: temperature or greedy rows, no top-k/top-p, min-p, rare stages or
logprobs; unless ``MRV2_TOP_K_TAIL_GRAPHS=0``, a second tail, variant 1, for batches with
top-k/top-p rows: ``Sampler.graph_plans``): sampling the graph's logits, verifying the drafts of
a ``1 + k`` step (strict, probabilistic or synthetic rejection) and the post-update of the state
table, replayed right after the forward, so a decode step launches its graphs and no sampler
kernel from Python. Its padding requests have empty queries: the rejection gives them no tokens,
the post-update skips them, and what is sampled at their rows is never read. The tail writes
outside the graphs' memory pool (``tail_sampled``, ``spec_samples``), where the host copy and
the drafting read.

A speculator whose ``propose`` is capturable (``Speculator.cuda_graphs``) gets a further graph
per ``(1 + k, size)``: all of a decode step's drafting (the drafter's catch-up and its ``k``
draft steps) over the target graph's hidden-state output and the persistent samples
(``spec_samples``, which the verify tail writes in place), replayed right after sampling. Its
padding requests sampled nothing, so they draft nothing.

A step with prompt tokens (or any step no decode graph serves) of ``T <= max_mixed_graph_tokens``
tokens over ``B`` requests replays the *mixed* graph of the smallest captured token count
``T' >= T`` (:func:`mixed_token_sizes`), whose batch has ``min(max_num_seqs, T')`` requests:
padding requests have empty queries and padding tokens write no KV, as above. Its attention
metadata bakes ``max_query_len = T'`` and ``max_seq_len = max_model_len`` (upper bounds, as the
metadata contract allows); the paged kernel's flat grid launches no more programs for that.
The graph computes the logits of ``min(T', B' (1 + k))`` rows (``B'`` its requests, ``k`` the
speculative tokens: each request's last token, or its draft tokens and the one before) and
copies them and the hidden states into buffers shared by every mixed graph; sampling, the
drafts' verification and the drafting stay eager. Eager, a
small mixed step is all host time: 512 tokens (prompt chunks beside 64 decodes) of a
0.6B-parameter model took 35 ms a step back to back for 2.6 ms of GPU work, replayed 3.6 ms
(H200, BENCHMARKS.md 2026-12-02, eleventh session). Serving pays that on every step where a
prompt arrives. Steps whose inputs need host work (``ModelState.mixed_graph_allowed`` says
False: a multimodal state's steps that compute placeholders) stay eager, as do all steps with
prompt tokens of a ModelState or an attention backend whose ``mixed_step_graphs`` is False
(an attention whose launches grow with the baked bounds). Layers whose cost depends on the
rows' values skip the padding rows on the device (the routed experts:
``mrv2.contract.forward_context.real_token_count``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.samples import StepSamples
from mrv2_kernels._backend import cuda_event_ms

Outputs = tuple[torch.Tensor, torch.Tensor]
"""``(hidden states [T, hidden], logits [T, vocab])`` of a captured step."""


logger = logging.getLogger(__name__)

#: ``1``: after capture, keep the mixed graphs only up to the largest token count whose replay
#: beats an eager step's host time (:meth:`StepGraphs.drop_slow_mixed`); off by default until
#: measured on a GPU.
MEASURED_ENV_VAR = "MRV2_MIXED_GRAPHS_MEASURED"


def measured_mixed_graphs() -> bool:
    """Whether :data:`MEASURED_ENV_VAR` turns the measured cut of the mixed graphs on."""
    return os.environ.get(MEASURED_ENV_VAR, "0") == "1"


def timed_ms(fn: Callable[[], object], device: torch.device, host_only: bool) -> float:
    """Milliseconds of ``fn()``, the least of three runs after one more: its host time
    (``host_only``: the wall time of the call, which never waits for the device, then a
    synchronization outside the timing), or its device time (CUDA events around it; wall
    time on other devices)."""
    best = float("inf")
    for i in range(4):
        if device.type == "cuda" and not host_only:
            ms = cuda_event_ms(fn)
        else:
            begin = time.perf_counter()
            fn()
            ms = (time.perf_counter() - begin) * 1e3
            _sync()
        if i:
            best = min(best, ms)
    return best


def _sync() -> None:
    if torch.cuda.is_initialized():  # a CPU stand-in capture (tests) has nothing to wait for
        torch.cuda.synchronize()


def capture_sizes(max_num_reqs: int, limit: int = 512, sizes: Sequence[int] | None = None,
                  exact: Sequence[int] | None = None) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16, capped at ``min(max_num_reqs,
    limit)``; ``sizes`` given (``cuda_graph_sizes``, vLLM's): one value is the cap instead of
    ``limit``, several are the sizes themselves; ``exact`` given (vLLM's
    ``cudagraph_capture_sizes``): the sizes themselves, even one. Only those up to
    ``max_num_reqs`` of a list are kept."""
    if exact is not None or (sizes is not None and len(sizes) > 1):
        return sorted({s for s in (exact if exact is not None else sizes or ())
                       if s <= max_num_reqs})
    if sizes:
        limit = sizes[0]
    top = min(max_num_reqs, limit)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top, 256) + 1, 8))
    sizes += list(range(272, top + 1, 16))
    if top not in sizes:
        sizes.append(top)
    return sorted(set(sizes))


#: Up to this many tokens the mixed graphs' sizes grow by 1.5x, beyond it by an eighth of a
#: power of two (see :func:`mixed_token_sizes`).
MIXED_FINE_ABOVE = 256


def mixed_token_sizes(limit: int, max_num_tokens: int) -> list[int]:
    """Token counts of the mixed graphs, capped at ``min(limit, max_num_tokens)`` (always one
    of them; none when the cap is 0):

    - 8, 12, 16, 24, ..., 192, 256: powers of two and 1.5x between. A step pads by less than
      half, which costs little: up to a few hundred tokens a step's linear layers read their
      weights once whatever the count (memory-bound).
    - then every eighth of a power of two: 288, 320, ..., 512, 576, ..., 1024, 1152, ... Beyond
      ~256 tokens the linear layers of a large model are compute-bound, so a padded token
      costs as much as a real one; the step pads by at most 12.5%. (With the 1.5x steps an
      8B model's 4,200-token step would compute 6,144.)
    """
    top = min(limit, max_num_tokens)
    sizes: list[int] = []
    size = 8
    while size < top and size < MIXED_FINE_ABOVE:
        sizes.append(size)
        if size + size // 2 < top:
            sizes.append(size + size // 2)
        size *= 2
    while size < top:
        sizes += [s for s in range(size, 2 * size, size // 8) if s < top]
        size *= 2
    if top > 0:
        sizes.append(top)
    return sizes


@dataclass
class MixedGraph:
    """A captured mixed step: the graph, its batch's requests (real and padding) and the
    logits rows it computes."""

    graph: object
    num_reqs: int
    num_rows: int


class StepGraphs:
    """A runner's captured graphs: the decode graphs (and their sampling tails and drafting
    graphs), keyed by ``(query length, padded batch size)``, and the mixed graphs, keyed by
    padded token count."""

    def __init__(self, sizes: list[int], query_lens: list[int], max_num_tokens: int) -> None:
        self.plan = {q: sorted(s for s in sizes if s * q <= max_num_tokens) for q in query_lens}
        self.graphs: dict[tuple[int, int], object] = {}
        self.outputs: dict[tuple[int, int], Outputs] = {}
        self.draft_graphs: dict[tuple[int, int], object] = {}
        self.tail_graphs: dict[tuple[int, int, int], object] = {}
        #: Per query length, the tail's sampled token of every logits row (``[size * q]``).
        self.tail_sampled: dict[int, torch.Tensor] = {}
        #: The ``1 + k`` steps' verified tokens and counts (``[size, 1 + k]``, ``[size]``):
        #: written by the verify tail, read by the drafting graph and the host copy.
        self.spec_samples: StepSamples | None = None
        #: Mixed graphs by padded token count (smallest first), and the outputs every one of
        #: them copies into (hidden states ``[T, hidden]``, logits ``[rows, vocab]``).
        self.mixed_graphs: dict[int, MixedGraph] = {}
        self.mixed_outputs: Outputs | None = None

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

    def mixed_size(self, num_tokens: int, num_reqs: int, num_logits: int) -> int | None:
        """The token count of the mixed graph a step of ``num_tokens`` tokens over ``num_reqs``
        requests with ``num_logits`` logits rows replays at, or ``None`` (eager)."""
        for size, mixed in self.mixed_graphs.items():  # smallest first
            if size >= num_tokens and mixed.num_reqs >= num_reqs and mixed.num_rows >= num_logits:
                return size
        return None

    def capture_mixed(
        self,
        sizes: dict[int, tuple[int, int]],
        dummy_batch: Callable[[int, int, int], InputBatch],
        forward: Callable[[InputBatch], Outputs],
        capture: Callable[[InputBatch, Callable[[], None]], object],
    ) -> None:
        """Capture a mixed graph per ``{tokens: (requests, logits rows)}`` of ``sizes``,
        largest first: the step's forward and its logits rows (``batch.logits_indices``),
        copied into :attr:`mixed_outputs` (allocated here, outside the graphs' pool, at the
        largest size's shapes)."""
        for tokens in sorted(sizes, reverse=True):
            num_reqs, num_rows = sizes[tokens]
            batch = dummy_batch(num_reqs, tokens, num_rows)
            hidden, logits = forward(batch)  # warm up: compile kernels outside the capture
            if self.mixed_outputs is None:
                self.mixed_outputs = (hidden.new_empty(hidden.shape),
                                      logits.new_empty(logits.shape))
            out_hidden = self.mixed_outputs[0][:tokens]
            out_logits = self.mixed_outputs[1][:num_rows]
            _sync()

            def body(batch: InputBatch = batch, out_hidden: torch.Tensor = out_hidden,
                     out_logits: torch.Tensor = out_logits) -> None:
                hidden, logits = forward(batch)
                out_hidden.copy_(hidden)
                out_logits.copy_(logits)

            graph = capture(batch, body)
            if graph is not None:
                self.mixed_graphs[tokens] = MixedGraph(graph, num_reqs, num_rows)
        self.mixed_graphs = dict(reversed(self.mixed_graphs.items()))  # smallest first
        _sync()

    def replay_mixed(self, tokens: int) -> Outputs:
        """Replay the mixed graph of ``tokens`` padded tokens; returns views of the shared
        outputs: ``[tokens]`` hidden states and the logits of the graph's logits rows."""
        mixed = self.mixed_graphs[tokens]
        mixed.graph.replay()  # type: ignore[attr-defined]
        assert self.mixed_outputs is not None
        hidden, logits = self.mixed_outputs
        return hidden[:tokens], logits[: mixed.num_rows]

    def drop_slow_mixed(self, slower: Callable[[int], bool]) -> list[int]:
        """Drop the mixed graphs from the smallest token count at which ``slower(tokens)``
        (its replay takes longer than an eager step's host time) on: those steps run eager.
        Replay time grows with the count and a step's host time hardly does, so ``slower``
        flips once; a binary search asks it ~log2(graphs) times. Returns the dropped counts.

        Eager, a step's device work hides behind its host time until the device time is the
        longer (an 8B dense model on an H200: host-bound at 300 tokens, device-bound from ~1,100);
        from there a graph only adds its padding (BENCHMARKS.md, twelfth session)."""
        sizes = list(self.mixed_graphs)  # smallest first
        lo, hi = 0, len(sizes)
        while lo < hi:
            mid = (lo + hi) // 2
            if slower(sizes[mid]):
                hi = mid
            else:
                lo = mid + 1
        for size in sizes[lo:]:
            del self.mixed_graphs[size]
        if lo < len(sizes):
            logger.info("mixed graphs up to %s tokens; steps of %d tokens and more run eager "
                        "(their replay is no faster than an eager step's host time)",
                        sizes[lo - 1] if lo else 0, sizes[lo - 1] + 1 if lo else 1)
        return sizes[lo:]

    def replay(self, query_len: int, size: int) -> Outputs:
        """Replay the graph of ``(query_len, size)``; returns its output buffers."""
        self.graphs[(query_len, size)].replay()  # type: ignore[attr-defined]
        return self.outputs[(query_len, size)]

    def _captured_sizes(self, query_len: int) -> list[int]:
        return [s for s in self.plan.get(query_len, ()) if (query_len, s) in self.graphs]

    def _static_samples(self, query_len: int, size: int) -> StepSamples:
        """The first ``size`` rows of the persistent samples of the ``query_len`` steps
        (allocated on first use, for the largest captured size; nothing sampled: counts
        zero)."""
        if self.spec_samples is None:
            top = max(self._captured_sizes(query_len))
            device = self.outputs[(query_len, top)][0].device
            self.spec_samples = StepSamples(
                torch.full((top, query_len), -1, dtype=torch.int64, device=device),
                torch.zeros(top, dtype=torch.int32, device=device),
            )
        static = self.spec_samples
        assert static.tokens.shape[1] == query_len
        return StepSamples(static.tokens[:size], static.num_sampled[:size])

    def capture_drafts(
        self,
        query_len: int,
        dummy_batch: Callable[[int, int], InputBatch],
        propose: Callable[[InputBatch, StepSamples, torch.Tensor], None],
        capture: Callable[[InputBatch, Callable[[], None]], object],
    ) -> None:
        """Capture ``propose(batch, samples, hidden)`` after every captured ``(query_len, size)``
        step, over that graph's hidden states and the persistent samples (nothing sampled
        during capture, so the warm-up and the capture write no drafts and no KV)."""
        sizes = self._captured_sizes(query_len)
        if not sizes:
            return
        for size in sorted(sizes, reverse=True):
            batch = dummy_batch(size, query_len)
            samples = self._static_samples(query_len, size)
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

    def replay_drafts(self, query_len: int, size: int, samples: StepSamples,
                      after: torch.cuda.Event | None = None) -> bool:
        """Replay the drafting graph of ``(query_len, size)`` for this step's ``samples``
        (copied in unless the verify tail wrote them there, once ``after`` has passed: the
        persistent samples may be the source of a copy still running; the padding requests'
        counts zeroed); False when there is none."""
        graph = self.draft_graphs.get((query_len, size))
        if graph is None:
            return False
        static = self.spec_samples
        assert static is not None
        if samples.tokens.data_ptr() != static.tokens.data_ptr():
            if after is not None:
                torch.cuda.current_stream().wait_event(after)
            num_reqs, width = samples.tokens.shape
            static.num_sampled[:num_reqs].copy_(samples.num_sampled)
            static.num_sampled[num_reqs:size].zero_()
            static.tokens[:num_reqs, :width].copy_(samples.tokens)
        graph.replay()  # type: ignore[attr-defined]
        return True

    def capture_tails(
        self,
        query_len: int,
        dummy_batch: Callable[[int, int], InputBatch],
        sample_tail: Callable[[InputBatch, torch.Tensor, torch.Tensor, StepSamples | None],
                              None],
        capture: Callable[[InputBatch, Callable[[], None]], object],
        variant: int = 0,
    ) -> None:
        """Capture ``sample_tail(batch, logits, sampled, samples)`` after every captured
        ``(query_len, size)`` step, as tail ``variant`` (the sampler's plan of that index,
        which ``sample_tail`` applies): it samples that graph's logits into ``sampled`` (a
        persistent buffer outside the graphs' memory pool, read by the host copy), verifies a
        ``1 + k`` step's drafts into ``samples`` (the persistent :attr:`spec_samples`; None for
        one-token steps) and updates the state table. The warm-up and the capture see only
        empty queries (the batch's ``query_start_loc`` zeroed), so they change no row and
        verify nothing."""
        sizes = self._captured_sizes(query_len)
        if not sizes:
            return
        top = max(sizes)
        device = self.outputs[(query_len, top)][1].device
        if query_len not in self.tail_sampled:  # one buffer for every variant
            self.tail_sampled[query_len] = torch.zeros(top * query_len, dtype=torch.int64,
                                                       device=device)
        for size in sorted(sizes, reverse=True):
            batch = dummy_batch(size, query_len)
            batch.query_start_loc.zero_()
            logits = self.outputs[(query_len, size)][1]
            sampled = self.tail_sampled[query_len][: size * query_len]
            samples = self._static_samples(query_len, size) if query_len > 1 else None
            sample_tail(batch, logits, sampled, samples)  # warm up: compile outside the capture
            _sync()

            def body(batch: InputBatch = batch, logits: torch.Tensor = logits,
                     sampled: torch.Tensor = sampled,
                     samples: StepSamples | None = samples) -> None:
                sample_tail(batch, logits, sampled, samples)

            graph = capture(batch, body)
            if graph is not None:
                self.tail_graphs[(query_len, size, variant)] = graph
        _sync()

    def replay_tail(self, query_len: int, size: int, variant: int = 0
                    ) -> tuple[torch.Tensor, StepSamples | None] | None:
        """Replay sampling tail ``variant`` of the ``(query_len, size)`` graph (after that
        graph); returns its ``[size * query_len]`` sampled tokens and, for ``1 + k`` steps, the
        ``[size]`` verified samples; None when there is no such tail graph."""
        graph = self.tail_graphs.get((query_len, size, variant))
        if graph is None:
            return None
        graph.replay()  # type: ignore[attr-defined]
        samples = self._static_samples(query_len, size) if query_len > 1 else None
        return self.tail_sampled[query_len][: size * query_len], samples
