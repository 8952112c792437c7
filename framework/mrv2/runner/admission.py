"""Requests into and out of the runner's rows (:meth:`Runner._add_requests`,
:meth:`Runner.remove_requests`), prompts given as embeddings among them
(:mod:`mrv2.contract.prompt_embeds`), and the lengths the runner settles at start-up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mrv2.config import EngineConfig
from mrv2.contract.prompt_embeds import check_prompt_embeds_support, split_prompt_embeds
from mrv2.contract.requests import NewRequest
from mrv2.contract.staged_edits import StagedEdits
from mrv2.contract.state_table import RowInfo
from mrv2.layers.rotary import context_limit

#: The runner (:class:`mrv2.runner.runner.Runner`; typed loosely: that module imports this
#: one).
Runner = Any

__all__ = ["add_requests", "check_prompt_embeds", "engine_max_model_len", "kv_dtype_name",
           "remove_requests"]


def check_prompt_embeds(runner: Runner) -> Callable[[list[int], list[int], list[int]], bool]:
    """With ``enable_prompt_embeds``, a ValueError naming the architecture where the model
    can't take them; the batch builder's mixed-graph test: the ModelState's, and (with the flag
    on only, nothing to check per step otherwise) no step computing prompt-embedding rows
    (they are spliced in on the host's say-so)."""
    state = runner.model_state
    if not runner.config.model.enable_prompt_embeds:  # (no request holds any: add_requests)
        return state.mixed_graph_allowed
    check_prompt_embeds_support(runner.model, state, runner.model_entry.architecture)
    state.prompt_embeds.scale = float(getattr(runner.model, "prompt_embeds_scale", 1.0))
    family, given = state.mixed_graph_allowed, state.prompt_embeds

    def allowed(rows: list[int], num_computed: list[int], query_lens: list[int]) -> bool:
        return (given.graph_allowed(rows, num_computed, query_lens)
                and family(rows, num_computed, query_lens))
    return allowed


def add_requests(runner: Runner, requests: list[NewRequest], staged: StagedEdits) -> None:
    """Give a step's new requests their rows and stage their tokens, blocks and sampling
    columns, all requests checked first (one staged put per table for all of them: a burst of
    prompts costs ~26 µs of host time a request when staged one at a time). A prompt given as
    embeddings goes to ``model_state.prompt_embeds`` (copied to the device here, once); the
    family's hooks see the request without it."""
    state = runner.model_state
    split = [split_prompt_embeds(request) for request in requests]
    for request, (own, given) in zip(requests, split, strict=True):
        n = len(request.token_ids)
        if not 0 < n <= runner.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {n} tokens; allowed 1..{runner.max_model_len}"
            )
        if len(request.block_ids) > runner.max_blocks_per_req:
            raise ValueError(f"request {request.req_id!r} holds too many blocks")
        if given is not None and not runner.config.model.enable_prompt_embeds:
            raise ValueError(f"request {request.req_id!r} gives prompt_embeds; start the "
                             "engine with --enable-prompt-embeds")
        runner.sampler.check_params(request.sampling_params)
        state.check_request(own)
    if runner.lora is not None:
        runner.lora.check_requests(requests)
    elif any(r.lora_request is not None for r in requests):
        raise ValueError("a request names a LoRA adapter but enable_lora is off")
    rows = [runner.table.allocate(RowInfo(r.req_id, r.num_computed_tokens, len(r.token_ids),
                                          len(r.token_ids))) for r in requests]
    runner.builder.stage_new_rows(rows, [r.token_ids for r in requests],
                                  [r.block_ids for r in requests],
                                  [r.num_computed_tokens for r in requests], staged,
                                  [r.extra_block_ids for r in requests])
    runner.sampler.add_requests(requests, rows, staged)
    if runner.lora is not None:
        runner.lora.add_requests(requests, rows, staged)
    runner.pooler.add(requests, rows)
    runner.state_rows.add_requests(requests, rows, staged)
    for (own, given), row in zip(split, rows, strict=True):
        state.add_request(own, row)
        if given is not None:
            state.prompt_embeds.add(row, own.req_id, given, own.num_computed_tokens)


def remove_requests(runner: Runner, req_ids: list[str]) -> None:
    """Free the rows of finished, aborted or preempted requests. An id without a row is passed
    over: a request admitted to a step that failed before it got one (an adapter that could no
    longer be read), aborted since."""
    for req_id in req_ids:
        if req_id not in runner.table.rows:
            continue
        row = runner.table.release(req_id)
        runner.sampler.remove_request(row)
        runner.model_state.remove_request(req_id, row)
        runner.model_state.prompt_embeds.remove(row)
        if runner.lora is not None:
            runner.lora.remove_request(row)
        runner.pooler.remove(row)


def kv_dtype_name(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The cache's element type: the model's for ``auto``."""
    return str(dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype


def engine_max_model_len(config: EngineConfig, hf_config: Any, window: int | None = None
                         ) -> int:
    """The engine's ``max_model_len``: the one asked for, at most the model's context limit
    (:func:`mrv2.layers.rotary.context_limit`: ``max_position_embeddings``, or longer by its
    RoPE scaling, as vLLM derives it; at most ``window``, the sliding window
    ``disable_sliding_window`` removed), which is the default. ``"auto"``: that limit, until
    :meth:`Runner._fit_max_model_len` takes the longest length up to it that the KV cache
    holds (the buffers sized before the cache keep the limit's size)."""
    limit, why = context_limit(hf_config)
    if window is not None and (limit is None or window < limit):
        limit, why = window, (f"the model's sliding_window={window} (disable_sliding_window: "
                              "full attention up to the window's length, as vLLM)")
    requested = config.model.fixed_max_model_len
    if requested is None:
        if limit is None:
            auto = " ('auto' is at most the model's context length)" if (
                config.model.auto_max_model_len) else ""
            raise ValueError(f"max_model_len is required{auto}: {why}")
        return limit
    if limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds {why}")
    return requested
