"""The engine's request side (:class:`RequestOps`): a request checked (``validate``), queued
(``add_request``: an ``n > 1`` request as its samples) and aborted, over the ids and steps in
flight that :class:`~mrv2.engine.in_flight.InFlight` keeps."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from mrv2.config import EngineConfig
from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import RequestOutputKind, SamplingParams, derive_seed
from mrv2.contract.pooling import PoolingParams
from mrv2.contract.prompt_embeds import check_given_embeds, split_prompt_embeds
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.engine.in_flight import InFlight
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request import Request
from mrv2.engine.request_inputs import (
    check_cache_salt,
    check_priority,
    check_prompt,
    check_runner,
    process_multimodal,
    truncate_prompt,
)
from mrv2.engine.sampling_outputs import (
    BadWords,
    LogprobState,
    TrackedRequest,
    child_id,
    prepare_params,
)
from mrv2.engine.scheduler import Scheduler
from mrv2.engine.structured_outputs import StructuredOutputs
from mrv2.engine.tokenizer import Tokenizer

__all__ = ["RequestOps"]


class RequestOps:
    """:class:`~mrv2.engine.engine.LLMEngine`'s request operations (a mixin: the engine gives
    the attributes below, set in its constructor)."""

    config: EngineConfig
    runner: Any
    scheduler: Scheduler
    block_manager: BlockManager
    tokenizer: Tokenizer | None
    input_processor: InputProcessor | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    hidden_size: int
    num_labels: int | None
    matryoshka: bool | tuple[int, ...]
    refused_pooling_tasks: dict[str, str]
    normalize_embeddings: bool
    _flight: InFlight
    _bad_words: BadWords
    _guided: set[str]
    _held: list[RequestOutput]
    _seeds: random.Random
    _shut_down: bool
    # (the engine's methods, and WeightOps'; annotations only: no attribute here hides them)
    _check_open: Callable[[], None]
    _check_awake: Callable[[], None]
    has_unfinished: Callable[[], bool]
    _structured_outputs: Callable[[], StructuredOutputs]

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this, exclusive (the model's vocabulary)."""
        return int(self.runner.vocab_size)

    def process_multimodal(self, prompt_token_ids: list[int], mm_data: Any
                           ) -> tuple[list[int], list[MultiModalItem]]:
        """A prompt with ``multi_modal_data`` through the family's input processor: token ids
        with the placeholders expanded, and the items for :meth:`add_request`. ValueError
        naming the field on bad data or a text-only model."""
        return process_multimodal(self.input_processor, self.runner.model_entry.architecture,
                                  prompt_token_ids, mm_data)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None, pooling: bool = False) -> int:
        """Check a request (an embedding request with ``pooling``) can run; returns its
        effective max_tokens. Raises ``ValueError``."""
        self._check_open()
        self._check_awake()
        check_runner(self.config, pooling)
        check_prompt(prompt_token_ids, params, self.max_model_len, self.runner.vocab_size,
                     pooling, self.config.model.max_logprobs)
        if lora_request is not None:
            lora = getattr(self.runner, "lora", None)
            if lora is None:
                raise ValueError(f"lora_request {lora_request.lora_name!r} given, but the "
                                 "engine serves no adapters: start it with enable_lora=True")
            lora.check(lora_request)
        n = len(prompt_token_ids)
        self.runner.sampler.check_params(params)
        if params.stop and self.tokenizer is None:  # (matched in the text: there is none)
            why = ("skip_tokenizer_init=True loads no tokenizer"
                   if self.config.model.skip_tokenizer_init else "this model has no tokenizer")
            raise ValueError(f"SamplingParams.stop (stop strings) needs the output text; {why}"
                             ": stop on token ids with stop_token_ids")
        self._bad_words.token_ids(params)  # (refused words; kept for add_request)
        if params.structured_outputs is not None:  # compiled and checked (then cached)
            self._structured_outputs().grammar(params.structured_outputs)
        room = self.max_model_len - n
        if pooling:  # (its one sampled token, dropped, may lie past the context: the token
            room = max(room, 1)  # table takes no token there, and its KV is never computed)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if not self.config.scheduler.enable_chunked_prefill:
            budget = self.config.scheduler.max_num_batched_tokens
            if n > budget:
                raise ValueError(
                    f"the prompt has {n} tokens, more than max_num_batched_tokens={budget}; "
                    "enable chunked prefill or raise max_num_batched_tokens"
                )
        needed = self.scheduler.most_blocks(n + max_tokens)
        if needed > self.block_manager.num_blocks:
            lookahead = self.scheduler.num_lookahead_tokens
            slots = f" (and the drafter's {lookahead} lookahead slots)" if lookahead else ""
            raise ValueError(
                f"prompt + max_tokens = {n + max_tokens} tokens{slots} needs {needed} KV "
                f"blocks; the cache has {self.block_manager.num_blocks}"
            )
        return max_tokens

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
        priority: int = 0,
        mm_items: list[MultiModalItem] | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Nothing is queued if it is invalid.

        ``cache_salt`` (vLLM's): a non-empty string mixed into the hash of the request's first
        prefix-cache block, so only requests of the same salt share cached blocks (tenants'
        prefixes kept apart); its ``n`` samples share it.

        ``priority`` (vLLM's): under the ``"priority"`` policy lower values run first; any
        other than 0 is refused (ValueError) under ``"fcfs"``, as vLLM's.

        ``pooling_params``: an embedding request (``params`` then only gives its
        ``output_kind``): its output's ``embedding`` is its prompt's pooled final hidden
        state (:class:`~mrv2.contract.pooling.PoolingParams`).

        ``lora_request``: run the request through that LoRA adapter (``enable_lora``); its
        adapter is read and checked against the model here.

        ``mm_items``: multimodal inputs whose placeholder tokens lie in the prompt (a family's
        processor makes them); the model's ``ModelState`` embeds them.

        ``stream=True``: ``step()`` returns an output for this request after every new token
        (every ``stream_interval``), with ``new_token_ids``/``new_text``; otherwise, or with
        ``params.output_kind`` FINAL_ONLY, only its final output. ``output_kind`` DELTA: each
        output holds only what is new (``RequestOutput.delta``). While a request with stop
        strings runs, its outputs' text stops ``max(len(stop)) - 1`` characters short, so no
        output shows text that a stop string then cuts off (as vLLM's).
        """
        check_cache_salt(cache_salt)
        check_priority(priority, self.config.scheduler.policy)
        embeds = check_given_embeds(list(mm_items or []), prompt_token_ids,
                                    params.prompt_logprobs, self.config.model.enable_prompt_embeds,
                                    self.hidden_size)
        if pooling_params is None and params.truncate_prompt_tokens is not None:
            cut = truncate_prompt(prompt_token_ids, params, self.max_model_len, bool(mm_items))
            prompt = prompt if len(cut) == len(prompt_token_ids) else None
            prompt_token_ids = cut
        if pooling_params is not None:  # the prompt alone; its one sampled token is dropped
            pooling_params.check(self.hidden_size, self.num_labels, self.matryoshka,
                                 self.refused_pooling_tasks)
            if pooling_params.normalize is None:  # (the model's default)
                pooling_params = dataclasses.replace(pooling_params,
                                                     normalize=self.normalize_embeddings)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                    output_kind=params.output_kind)
        max_tokens = self.validate(prompt_token_ids, params, lora_request,
                                   pooling_params is not None)
        stream = stream and params.output_kind != RequestOutputKind.FINAL_ONLY
        mm_items = list(mm_items or [])
        flight = self._flight
        req_id = request_id if request_id is not None else flight.new_id(params.n)
        self.runner.model_state.check_request(  # (the family's item checks, before queueing)
            split_prompt_embeds(NewRequest(req_id, prompt_token_ids, params, 0, [],
                                           mm_items=mm_items))[0])
        budget = self.config.scheduler.max_num_batched_tokens
        for item in mm_items:
            if item.bidirectional and item.length > budget:
                raise ValueError(f"multi_modal_data.{item.kind}: an {item.kind} of {item.length} "
                                 "tokens whose tokens attend to each other is computed in one "
                                 f"step; max_num_batched_tokens={budget} is smaller (raise it "
                                 f"to at least {item.length})")
        if request_id is not None:  # (new_id's is free)
            flight.check_free(req_id, params.n)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        params = prepare_params(params, self.eos_token_ids, self._bad_words.token_ids(params),
                                len(prompt_token_ids), self.vocab_size)
        if params.n > 1:  # n sub-requests, merged into one output by flight.fanout
            self.scheduler.check_room(params.n)  # (a part queued would run for nobody)
            children = [child_id(req_id, i) for i in range(params.n)]
            try:
                for i, child in enumerate(children):
                    self.add_request(prompt_token_ids, params.child(i, derive_seed(seed, i)),
                                     child, prompt, stream, priority, mm_items, lora_request,
                                     cache_salt=cache_salt)
            except BaseException:
                for child in children:  # (no samples left running for nobody)
                    self.abort(child)
                raise
            flight.fanout.add(req_id, params.n, stream)
            return req_id
        guide = None
        if params.structured_outputs is not None:
            guide = self._structured_outputs().guide(params, prompt_token_ids)
        request = Request(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            seed=seed,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            max_tokens=max_tokens,
            priority=priority,
            mm_items=mm_items,
            lora_request=lora_request,
            cache_salt=cache_salt,
            pooling_params=pooling_params,
        )
        detok = None
        if self.tokenizer is not None and params.detokenize:
            # (the prompt's last tokens as context, as vLLM's: a sentencepiece model's first
            # word keeps its leading space, so prompt + output reads as the model wrote it)
            detok = IncrementalDetokenizer(  # (embeddings: placeholder ids, no context)
                self.tokenizer, [] if embeds else request.prompt_token_ids,
                params.skip_special_tokens,
                use_prompt_context=True,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        self.scheduler.add(request)
        holdback = 0
        if params.stop and not params.include_stop_str_in_output:
            holdback = max(len(s) for s in params.stop) - 1
        logprobs = (LogprobState() if params.logprobs is not None
                    or params.prompt_logprobs is not None else None)
        flight.requests[req_id] = TrackedRequest(request, prompt, detok, stream, guide=guide,
                                                 holdback=holdback, logprobs=logprobs)
        if guide is not None:
            self._guided.add(req_id)
        return req_id

    def abort(self, req_id: str) -> None:
        """Cancel a request (an ``n > 1`` parent: all its samples) wherever it is; unknown or
        finished ids are ignored (so is everything once the engine is shut down). One sample
        of an ``n > 1`` parent (its ``child_id``) ends alone, with ``finish_reason="abort"``
        in its parent's output, which the next :meth:`step` returns when that was the last
        sample running (else when the others end; streamed: at once), as vLLM's."""
        if self._shut_down:
            return
        for tracked in self._flight.remove_for_abort(req_id):
            self.scheduler.finish(tracked.request, "abort")  # its blocks are free at once
            if self._flight.is_sample(tracked.request.req_id):  # (its parent still runs)
                if tracked.detokenizer is not None:
                    tracked.detokenizer.flush()
                merged = self._flight.fanout.merge(tracked.output())
                if merged is not None:
                    self._held.append(merged)
        if not self.has_unfinished():
            self.runner.remove_requests(self.scheduler.take_finished_ids())  # idle: row too
