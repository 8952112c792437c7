"""The runner's start-up measurements and graph captures (:class:`~mrv2.runner.runner.Runner`
calls them; kept apart so the runner's module is its step): one set of CUDA graphs, whether a
mixed graph beats an eager step, and the activation memory of the largest step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch

from mrv2.contract.batch import InputBatch
from mrv2.distributed.parallel_state import agree_min
from mrv2.layers.embedding import PoolingLogits
from mrv2.model_loader.build import CausalLM
from mrv2.runner.cuda_graphs import (
    StepGraphs,
    capture_sizes,
    measured_mixed_graphs,
    mixed_token_sizes,
    timed_ms,
)

#: The runner (:class:`mrv2.runner.runner.Runner`; typed loosely: that module imports this
#: one).
Runner = Any

__all__ = ["capture_set", "max_mixed_graph_tokens", "mixed_graph_slower", "profile_peak_bytes"]


def capture_set(runner: Runner, capture: Callable[[InputBatch, Callable[[], Any]], object]
                ) -> StepGraphs:
    """One set of the runner's graphs (:meth:`~mrv2.runner.runner.Runner.capture_graphs`): the
    mixed graphs, the uniform-decode graphs, the drafting graphs and the sampling tails."""
    query_lens = sorted({1, 1 + runner.num_speculative_tokens})
    device = runner.config.device
    sizes = capture_sizes(runner.max_num_reqs, sizes=device.cuda_graph_sizes,
                          exact=device.cudagraph_capture_sizes)
    runner.graphs = graphs = StepGraphs(sizes, query_lens, runner.max_num_tokens)
    mixed: dict[int, tuple[int, int]] = {}
    if runner.model_state.mixed_step_graphs and all(b.mixed_step_graphs
                                                  for b in runner.kv.backends):
        for tokens in mixed_token_sizes(max_mixed_graph_tokens(runner), runner.max_num_tokens):
            num_reqs = min(runner.max_num_reqs, tokens)  # a dummy request fits its row:
            if -(-tokens // num_reqs) <= runner.max_blocks_per_req * runner.block_size:
                rows = min(tokens, num_reqs * (1 + runner.num_speculative_tokens))
                mixed[tokens] = (num_reqs, rows)  # a real step of so many tokens may exist
    with torch.inference_mode():
        # the largest graphs first: the later ones reuse their memory pool
        graphs.capture_mixed(mixed, runner._mixed_dummy_batch, runner._forward_logits_rows,
                             capture)
        if measured_mixed_graphs() and graphs.mixed_graphs:
            graphs.drop_slow_mixed(functools.partial(mixed_graph_slower, runner))
        if isinstance(getattr(runner.model, "lm_head", None), PoolingLogits):
            return graphs  # pooling only: every request ends with its prompt, none decodes
        graphs.capture_all(runner._graph_dummy_batch, runner._forward_all_logits, capture)
        if runner.speculator is not None and runner.speculator.cuda_graphs:
            graphs.capture_drafts(1 + runner.num_speculative_tokens,
                                  runner._graph_dummy_batch, runner._propose, capture)
        for variant, plan in enumerate(runner.sampler.graph_plans()):
            for query_len in query_lens:
                graphs.capture_tails(query_len, runner._graph_dummy_batch,
                                     functools.partial(runner._sample_tail, plan=plan),
                                     capture, variant)
    return graphs

def mixed_graph_slower(runner: Runner, tokens: int) -> bool:
    """Whether the mixed graph of ``tokens`` replays slower than an eager step of as many
    tokens spends on the host (on any rank: every rank then keeps the same graphs)."""
    graphs = runner.graphs
    assert graphs is not None
    graph = graphs.mixed_graphs[tokens]
    batch = runner._mixed_dummy_batch(graph.num_reqs, tokens, graph.num_rows)
    host = timed_ms(lambda: runner._forward_logits_rows(batch), runner.device, host_only=True)
    replay = timed_ms(lambda: graphs.replay_mixed(tokens), runner.device, host_only=False)
    return agree_min(int(replay <= host)) == 0

def max_mixed_graph_tokens(runner: Runner) -> int:
    """``max_mixed_graph_tokens``, by default the whole token budget: the graphs' pool
    then holds the largest step's activations, which eager steps never need again. With
    chunked prefill off (a budget of ``max_model_len`` or more: 32K tokens, whose steps' host
    cost is nothing beside their work), at most the default budget's 8,192. With a
    speculator, whose eager drafting after a mixed step needs activation memory beside the
    pool's: 512 (small steps are where the host costs most)."""
    cap = runner.config.device.max_mixed_graph_tokens
    if cap is None:
        if runner.speculator is not None:
            return 512
        scheduler = runner.config.scheduler
        if not scheduler.enable_chunked_prefill:
            default = type(scheduler).model_fields["max_num_batched_tokens"].default
            return int(min(runner.max_num_tokens, default))
        return runner.max_num_tokens
    return cap

def profile_batch(runner: Runner) -> InputBatch:
    """The largest step's dummy batch (:meth:`Runner.profile_shape`) with the query bound of
    any step of its size, its token count (one request may hold every token): layers that pick
    a form by the longest query (the chunked delta rule, and its scratch) take their widest."""
    num_reqs, num_tokens = runner.profile_shape()
    batch = runner._dummy_batch(num_reqs, num_tokens)
    return InputBatch(**{**batch.__dict__, "max_query_len": num_tokens})


def profile_peak_bytes(runner: Runner) -> int:
    """Activation memory of the largest step, measured by one dummy forward
    (:func:`profile_batch`), or the sampler's scratch over its widest step, or the
    family's encoder over the largest input one prompt may carry
    (``ModelState.profile_encoder``), whichever is most, plus what the family keeps beside
    them (its encoder cache's budget). CUDA only."""
    if runner.device.type != "cuda" or runner.config.cache.num_gpu_blocks_override is not None:
        return 0
    runner.kv.allocate(1, runner.block_size, runner.dtype, runner.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    batch = profile_batch(runner)
    with torch.inference_mode():
        hidden = runner._forward(batch)
        cast(CausalLM, runner.model).compute_logits(hidden[batch.logits_indices]).float()
        del hidden
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(runner.device) - before
        # the sampler's scratch over the widest step (a tail graph or an eager step with
        # top-k / top-p), measured alone: it runs after the forward's activations are gone
        torch.cuda.reset_peak_memory_stats(runner.device)
        rows = min(runner.max_num_reqs * (1 + runner.num_speculative_tokens), runner.max_num_tokens)
        runner.sampler.profile_scratch(rows, runner.dtype)
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated(runner.device) - before)
        # the encoder (a vision tower) over the largest input, alone: it runs before a
        # step's forward, its output a few rows the forward then reads
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
        kept = runner.model_state.profile_encoder(runner.max_model_len - 1)
    torch.cuda.synchronize()
    top = torch.cuda.max_memory_allocated(runner.device)
    runner.startup.facts.update(encoder_peak_bytes=top - base, encoder_kept_bytes=kept)
    peak = max(peak, top - before) + kept
    runner.kv.release()  # (num_blocks_for returns the freed memory to the device)
    return int(peak)
