"""The engine loop: schedule, launch, and read outputs one step late (requests come in
validated and queued by :class:`~mrv2.engine.request_ops.RequestOps`).

With ``async_scheduling`` (the default) step N+1 is scheduled and launched before step N's
tokens are read; a request that stops at step N wastes at most the one token of step N+1,
which is discarded here (:mod:`mrv2.engine.in_flight`: whose results a step holds for an id).
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

import numpy as np

from mrv2.config import EngineConfig
from mrv2.contract.pooling import matryoshka_of
from mrv2.contract.requests import SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.engine_stats import lora_stats, spec_stats
from mrv2.engine.generation_defaults import load_sampling_defaults
from mrv2.engine.in_flight import InFlight
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request_inputs import (  # noqa: F401 (_load_tokenizer: tests import it here)
    _load_tokenizer,
    classifier_labels,
    default_pooling_task,
    make_input_processor,
    normalizes_embeddings,
    refused_pooling_tasks,
    tokenizer_kwargs,
)
from mrv2.engine.request_ops import RequestOps
from mrv2.engine.sampling_outputs import (
    BadWords,
    TrackedRequest,
    add_prompt_logprobs,
    add_sample_logprobs,
)
from mrv2.engine.scheduler import Scheduler
from mrv2.engine.state_snapshots import StateSnapshots
from mrv2.engine.structured_outputs import (
    StructuredOutputs,
    fill_bitmasks,
    fill_draft_bitmasks,
)
from mrv2.engine.tokenizer import Tokenizer, load_generation_eos
from mrv2.engine.warmup import warm_up
from mrv2.engine.weight_ops import WeightOps
from mrv2.executor import make_runner
from mrv2.model_loader.build import text_config_of
from mrv2.plugins import PluginManager
from mrv2.runner.async_output import AsyncStepOutput
from mrv2.runner.kv_cache import kv_budget_knob

logger = logging.getLogger(__name__)

#: "0": a structured-output request waits for its token in flight (every other step of an
#: async batch) instead of having its mask filled during the step's forward (the A/B switch).
LATE_TOKEN_MASKS_ENV = "MRV2_LATE_TOKEN_MASKS"


class LLMEngine(WeightOps, RequestOps):
    """Owns a :class:`Runner`, a :class:`Scheduler` and the requests in flight; its weight
    and memory operations (``update_weights``, ``sleep``...) are :class:`WeightOps`', its
    request operations (``validate``, ``add_request``, ``abort``...) :class:`RequestOps`'."""

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None) -> None:
        started = time.perf_counter()
        self.config = config
        note = config.structured_outputs.backend_note()
        if note is not None:  # (here, not on validation: once, in the engine's process)
            logger.info("%s", note)
        #: SamplingParams defaults from the model's generation config (``generation_config``
        #: / ``override_generation_config``) for the fields a request leaves unset; checked
        #: before the weights load.
        self.sampling_defaults = load_sampling_defaults(
            config.model.model, config.model.generation_config,
            config.model.override_generation_config)
        skip = config.model.skip_tokenizer_init  # (vLLM's: no tokenizer at all)
        named = None if skip else config.model.tokenizer  # (its own must load: before weights)
        tokenizer = (None if named is None
                     else _load_tokenizer(named, config.model.chat_template, required=True,
                                          kwargs=tokenizer_kwargs(config.model)))
        self.runner = make_runner(config, plugins)
        model_dir = config.model.model or self.runner.model_dir
        self.tokenizer: Tokenizer | None = (  # (a named one loaded, or raised, above)
            tokenizer if tokenizer is not None or skip
            else _load_tokenizer(model_dir, config.model.chat_template,
                                 kwargs=tokenizer_kwargs(config.model)))
        # the tokenizer's EOS (vLLM's primary one) and every one the model's configs name
        eos = load_generation_eos(model_dir)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        if config.model.model is None:  # the default model: its directory is known now
            self.sampling_defaults = load_sampling_defaults(
                model_dir, config.model.generation_config,
                config.model.override_generation_config)
        entry = self.runner.model_entry
        #: The family's multimodal prompt processor (None: the model takes text only).
        self.input_processor = make_input_processor(entry.input_processor, model_dir,
                                                    self.runner.hf_config, self.tokenizer,
                                                    config, entry)
        self.max_model_len = self.runner.max_model_len
        #: The length of the model's final hidden states (an embedding's, whole).
        self.hidden_size = int(text_config_of(self.runner.hf_config).hidden_size)
        #: Whether embeddings may be cut short (``dimensions``): the sizes allowed, True any
        #: (:func:`~mrv2.contract.pooling.matryoshka_of`).
        self.matryoshka = matryoshka_of(self.runner.hf_config)
        #: The pooling tasks the checkpoint's sentence-transformers configuration rules out,
        #: each with its reason (:func:`~mrv2.engine.request_inputs.refused_pooling_tasks`).
        self.refused_pooling_tasks = refused_pooling_tasks(model_dir)
        #: Whether an embedding is normalized when its request does not say (its
        #: ``PoolingParams.normalize`` None): :func:`~mrv2.engine.request_inputs.
        #: normalizes_embeddings`.
        self.normalize_embeddings = normalizes_embeddings(model_dir)
        #: A sequence classifier's label count and names (None, {}: not a classifier).
        self.num_labels, self.id2label = classifier_labels(config, self.runner.hf_config)
        #: What a pooling request asks for when it does not say (``LLM.encode``): a token
        #: classifier's per-token labels, a sequence classifier's labels, else an embedding.
        self.default_pooling_task = default_pooling_task(self.runner.hf_config)
        #: Whether full prompt blocks are cached and reused: ``cache.enable_prefix_caching``;
        #: for a model with per-request recurrent state, only with snapshot slots for the
        #: state at block boundaries (:mod:`mrv2.engine.state_snapshots`).
        self.prefix_caching = bool(config.cache.enable_prefix_caching)
        #: Those slots' count (0: the model keeps no such state, or caching is off).
        self.state_snapshot_slots = 0
        if self.prefix_caching and getattr(self.runner, "keeps_request_state", False):
            self.state_snapshot_slots = int(self.runner.state_rows.num_slots)
            if not self.state_snapshot_slots:
                self.prefix_caching = False
                logger.info("prefix caching off: %s keeps per-request recurrent state and "
                            "cache.state_snapshot_slots is 0", entry.architecture)
        self.block_manager, self.scheduler = self._new_scheduler()
        try:
            self._check_kv_capacity()
        except BaseException:
            self.runner.shutdown()  # tensor-parallel workers must not outlive a failed start
            raise
        k = self.runner.num_speculative_tokens
        #: Request-steps by how many drafts they verified (``[d]``) and kept (``[a]``); every
        #: speculation count of :meth:`stats` derives from these two histograms.
        self._drafted_hist = [0] * (k + 1)
        self._accepted_hist = [0] * (k + 1)
        #: Prompt tokens of the requests that produced their first token, and tokens
        #: generated, since the engine started (``stats()``: what a stats line divides by
        #: its interval).
        self.num_prompt_tokens = self.num_generation_tokens = 0
        #: The requests and steps in flight, and which request each id names.
        self._flight = InFlight()
        #: Bad words' token ids, tokenized once a request (:meth:`validate`, then queueing).
        self._bad_words = BadWords(self.tokenizer, self.vocab_size)
        #: Outputs of the steps a pause finished (:meth:`pause_generation`), for the next
        #: :meth:`step`.
        self._held: list[RequestOutput] = []
        self._shut_down = False
        self._seeds = random.Random(config.model.seed)
        self._structured: StructuredOutputs | None = None
        self._guided: set[str] = set()  # requests with a structured output (some may be done)
        #: Seconds the start-up warm-up took (None: it did not run; it runs on CUDA only).
        self.warmup_seconds: float | None = None
        if config.device.warmup and self.runner.device.type == "cuda":
            try:
                self.warmup_seconds = warm_up(self)
            except BaseException:
                self.runner.shutdown()  # tensor-parallel workers must not outlive a failed start
                raise
        parts = getattr(self.runner, "startup", None)
        seconds = dict(parts.seconds) if parts is not None else {}
        if self.warmup_seconds is not None:
            seconds["warm-up"] = self.warmup_seconds
        total = time.perf_counter() - started
        seconds["other"] = max(0.0, total - sum(seconds.values()))  # tokenizer, tables, ...
        logger.info("engine ready in %.1f s (%s)", total,
                    ", ".join(f"{name.replace('_', ' ')} {s:.1f} s"
                              for name, s in seconds.items()))

    def _new_scheduler(self) -> tuple[BlockManager, Scheduler]:
        """A block manager over the whole KV cache (its prefix cache empty) and a scheduler."""
        blocks = BlockManager(self.runner.num_kv_blocks, self.runner.block_size,
                              self.prefix_caching)
        speculator = self.runner.speculator
        scheduler = Scheduler(
            self.config.scheduler, blocks, self.runner.num_speculative_tokens,
            self.max_model_len,
            num_lookahead_tokens=speculator.num_lookahead_tokens if speculator else 0,
            table_windows=getattr(self.runner, "kv_table_windows", (None,)),
        )
        scheduler.late_token_masks = (bool(getattr(self.runner, "late_token_masks", False))
                                      and os.environ.get(LATE_TOKEN_MASKS_ENV, "1") != "0")
        if self.config.lora.enable_lora:
            scheduler.max_loras = self.config.lora.max_loras
        if self.state_snapshot_slots:
            scheduler.snapshots = StateSnapshots(self.state_snapshot_slots,
                                                 self.runner.block_size)
        return blocks, scheduler

    def _check_kv_capacity(self) -> None:
        """Refuse to start (vLLM's rule) when a KV cache sized from memory cannot hold one
        request of ``max_model_len`` tokens (:meth:`Scheduler.check_capacity`);
        ``num_gpu_blocks_override`` is the caller's own count, as in vLLM: not checked."""
        if self.config.cache.num_gpu_blocks_override is None:
            self.scheduler.check_capacity(
                self.max_model_len, kv_budget_knob(self.config.cache, self.runner.device))

    def reset_after_warmup(self) -> None:
        """Forget what :func:`~mrv2.engine.warmup.warm_up`'s requests left: a new block
        manager (every block free, the prefix cache empty, its counters at zero), a new
        scheduler and zeroed speculation counts. The engine must be idle."""
        if self.has_unfinished() or self._flight.requests:
            raise RuntimeError("reset_after_warmup needs an idle engine: requests are in flight")
        self.block_manager, self.scheduler = self._new_scheduler()
        self._drafted_hist = [0] * len(self._drafted_hist)
        self._accepted_hist = [0] * len(self._accepted_hist)
        self.num_prompt_tokens = self.num_generation_tokens = 0

    def shutdown(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel workers) and
        release the device memory it holds (the model, the KV cache...), even while the
        engine is still referenced; requests still running are dropped. The engine takes no
        requests and no steps afterwards. Idempotent."""
        self._flight.clear_steps()
        self.runner.shutdown()
        self._shut_down = True

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("the engine is shut down (shutdown(), or the end of a `with "
                               "LLM(...)` block): build a new one")

    def has_unfinished(self) -> bool:
        """True while any request waits, runs or has output in flight."""
        return self.scheduler.num_unfinished > 0 or bool(self._flight.steps)

    def wants_step(self) -> bool:
        """Whether :meth:`step` has work: outputs a pause held, or requests to run while the
        engine may run them (not paused, asleep, or waiting for weights after
        ``sleep(level=2)``: they wait)."""
        return bool(self._held) or (self.has_unfinished() and self._may_step())

    def _may_step(self) -> bool:
        return not self._paused and self._discarded is None and not self.runner.asleep

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the oldest step whose output is due.

        Returns the final output of every request that finished, and an output per new token
        of every streaming request.
        """
        self._check_open()
        outputs, self._held = self._held, []  # (finished while pausing: pause_generation)
        if not self._may_step():
            return outputs
        scheduled = self.scheduler.schedule()
        if self._guided and scheduled.num_scheduled_tokens:
            self._fill_bitmasks(scheduled)
        if scheduled.num_scheduled_tokens:
            self._flight.steps.append(self.runner.execute(scheduled))
        else:
            self.runner.remove_requests(scheduled.finished_req_ids)
        keep = 1 if self.config.scheduler.async_scheduling and scheduled.num_scheduled_tokens else 0
        self._process_steps(outputs, keep)
        if not self.has_unfinished():
            self.runner.remove_requests(self.scheduler.take_finished_ids())  # idle: free now
        if self._draining:  # (pause_generation("wait"): paused once the started are done)
            self._drain_if_done()
            outputs, self._held = outputs + self._held, []
        return outputs

    def _process_steps(self, outputs: list[RequestOutput], keep: int = 0) -> None:
        """Process the oldest steps in flight until ``keep`` are left, each one's outputs
        appended to ``outputs`` (a step that fails leaves those of the steps before it)."""
        steps = self._flight.steps
        while len(steps) > keep:
            outputs.extend(self._process(steps.popleft()))

    def _process(self, step: AsyncStepOutput) -> list[RequestOutput]:
        try:
            return self._process_step(step)
        finally:  # (a step that failed too: no later step holds an ended request's results)
            self._flight.processed(step)

    def _process_step(self, step: AsyncStepOutput) -> list[RequestOutput]:
        live = self._flight.live  # (None: the id's request ended; its results are its own)
        sampled = step.result()
        logprobs = step.logprobs()
        for req_id, vector in step.pooled().items():  # (embedding requests)
            tracked = live(req_id)
            if tracked is None:
                continue
            pooling, n = tracked.request.pooling_params, tracked.request.num_prompt_tokens
            if pooling is not None and pooling.per_token:  # a chunk of rows; after a
                # preemption the prompt's rows come again: its last pass is what counts
                tracked.embedding = ((tracked.embedding or []) + vector)[-n:]
            else:
                tracked.embedding = vector
        for req_id, drafts in step.drafts().items():  # (structured outputs with speculation)
            tracked = live(req_id)
            if tracked is not None:
                tracked.drafts = drafts
        for req_id, first, ids, values, ranks in step.prompt_logprobs():
            tracked = live(req_id)
            k = tracked.request.sampling_params.prompt_logprobs if tracked else None
            if tracked is not None and tracked.logprobs is not None and k is not None:
                add_prompt_logprobs(tracked.logprobs, k, first, ids, values, ranks,
                                    self.tokenizer, tracked.request.num_prompt_tokens)
        outputs = []
        interval = self.config.scheduler.stream_interval
        for req_id, tokens in sampled.items():
            tracked = live(req_id)
            drafted = step.drafted.get(req_id)
            if drafted is not None:
                self._count_drafts(drafted.num_drafts, len(tokens) - 1)
            if tracked is None:
                continue  # aborted or finished: its extra tokens are discarded
            request = tracked.request
            if drafted is not None:
                self.scheduler.correct(request, drafted.num_drafts, len(tokens) - 1)
            request.num_pending -= len(tokens)
            if request.finished:
                continue
            before = len(request.output_token_ids)
            if before == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            for j, token in enumerate(tokens):
                request.output_token_ids.append(token)
                k = request.sampling_params.logprobs
                if k is not None and tracked.logprobs is not None and req_id in logprobs:
                    add_sample_logprobs(tracked.logprobs, k, logprobs[req_id][j],
                                        self.tokenizer)
                self._check_stop(tracked, token)
                if request.finished:
                    break  # tokens past a stop are discarded
            if request.pooling_params is None:  # (a pooling request's token is nobody's)
                self.num_generation_tokens += len(request.output_token_ids) - before
            if request.finished and tracked.detokenizer is not None:
                tracked.detokenizer.flush()  # release text held back for an incomplete char
            if request.finished:
                outputs.append(tracked.output())
                self._flight.remove(req_id)
            elif tracked.stream and (
                    not tracked.sent_tokens
                    or len(request.output_token_ids) - tracked.sent_tokens >= interval):
                outputs.append(tracked.output())
        merged = [self._flight.fanout.merge(o) for o in outputs]
        return [o for o in merged if o is not None]

    def _fill_bitmasks(self, scheduled: SchedulerOutput) -> None:
        """The allowed next tokens of the step's structured-output requests that sample, into
        ``scheduled.token_bitmasks`` for the sampler: now when their matchers have every
        earlier token, else (a token of theirs in flight: the runner is in this process)
        during the step's forward, by ``scheduled.fill_token_bitmasks``."""
        guided, late = [], False
        num_drafts = scheduled.num_draft_tokens
        for req_id in list(self._guided):
            tracked = self._flight.requests.get(req_id)
            if tracked is None:  # finished or aborted
                self._guided.discard(req_id)
            elif tracked.guide is not None and self.scheduler.samples_now(req_id):
                guided.append(tracked)
                # this step's token and drafts, and a token of a step before?
                late = late or tracked.request.num_pending > 1 + num_drafts.get(req_id, 0)
        if not guided:
            return
        assert guided[0].guide is not None
        # the drafts proposed after this step are the next step's: to the host with its tokens
        scheduled.copy_drafts = self.runner.num_speculative_tokens > 0
        rows = [1 + num_drafts.get(t.request.req_id, 0) for t in guided]
        masks = np.empty((sum(rows), guided[0].guide.owner.words), dtype=np.int32)
        starts = np.cumsum([0, *rows])
        scheduled.token_bitmasks = {t.request.req_id: masks[starts[i] : starts[i + 1]]
                                    for i, t in enumerate(guided)}
        if not late:
            self._write_bitmasks(guided, masks, scheduled)
            return

        def fill() -> None:  # the forward is launched: the tokens in flight, then the masks
            for tracked in guided:
                guide, request = tracked.guide, tracked.request
                if guide is None or request.finished:
                    continue
                in_flight = [token for step in self._flight.steps_of(request.req_id)
                             for token in step.result().get(request.req_id, ())]
                for token in in_flight[guide.consumed - len(request.output_token_ids):]:
                    guide.advance(token)  # (the step's processing, later, skips these)
            self._write_bitmasks(guided, masks, scheduled)

        scheduled.fill_token_bitmasks = fill

    def _write_bitmasks(self, guided: list[TrackedRequest], masks: np.ndarray,
                        scheduled: SchedulerOutput) -> None:
        """``guided``'s masks into ``masks`` (``scheduled.token_bitmasks``' rows; every step
        before theirs arrived): one row a request, or with drafts one a logits row, over the
        drafts its newest step proposed; a finished request's allow every token."""
        guides = [None if t.request.finished else t.guide for t in guided]
        num_drafts = scheduled.num_draft_tokens
        ids = [t.request.req_id for t in guided]
        if not any(num_drafts.get(i, 0) for i in ids):  # one row each, filled at once
            fill_bitmasks(guides, masks)
            return
        drafts = [self._drafts_of(t, num_drafts.get(t.request.req_id, 0)) for t in guided]
        fill_draft_bitmasks(guides, drafts, [scheduled.token_bitmasks[i] for i in ids])

    def _drafts_of(self, tracked: TrackedRequest, count: int) -> list[int]:
        """The ``count`` drafts a constrained request verifies this step: those proposed
        after the newest step of it (in flight, or processed)."""
        if not count:
            return []
        req_id, drafts = tracked.request.req_id, tracked.drafts
        for step in reversed(self._flight.steps_of(req_id)):
            if req_id in step.result():
                drafts = step.drafts().get(req_id)
                break
        if drafts is None or len(drafts) < count:
            raise RuntimeError(f"the drafts of {req_id!r} did not reach the host "
                               "(SchedulerOutput.copy_drafts); its masks cannot be built")
        return drafts[:count]

    def _structured_outputs(self) -> StructuredOutputs:
        """The structured-outputs side (built at the first constrained request); ValueError
        where this engine cannot hold a request to one."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a tokenizer; this "
                                 "model has none")
            self._structured = StructuredOutputs(self.tokenizer.hf, self.vocab_size,
                                                 sorted(self.eos_token_ids),
                                                 self.config.structured_outputs)
        return self._structured

    def _check_stop(self, tracked: TrackedRequest, token: int) -> None:
        request = tracked.request
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        guide = tracked.guide
        if guide is not None and guide.consumed < num_out:  # (else consumed during a step)
            guide.advance(token)
        stop_id = num_out >= params.min_tokens and (
            token in (params.stop_token_ids or ()) or token in request.eos_token_ids)
        # A stop token's (EOS's) text is not the answer's, as vLLM's, even when special tokens
        # are kept (skip_special_tokens=False): only include_stop_str_in_output keeps it.
        if tracked.detokenizer is not None and (
                not stop_id or params.include_stop_str_in_output):
            tracked.detokenizer.add_tokens([token])
        if stop_id:
            # vLLM's: the tokenizer's EOS stops with no stop_reason; a stop token, and an EOS
            # only the model's configs name (vLLM adds those to the stop tokens: Llama 3.1's
            # <|eom_id|>), with its id
            primary = self.tokenizer.eos_token_id if self.tokenizer is not None else None
            if token == primary and token in request.eos_token_ids:
                self.scheduler.finish(request, "stop")
            else:
                self.scheduler.finish(request, "stop", token)
            return
        # the structured output is complete with this token (the late masks may have taken
        # the guide past it, over the rest of its step's tokens)
        if guide is not None and guide.done_at is not None and guide.done_at <= num_out:
            self.scheduler.finish(request, "stop")
            return
        # stop strings (vLLM's rule): one that ends in the text of the first min_tokens
        # tokens does not count; one that begins there and ends later does
        if params.stop and tracked.detokenizer is not None:
            if num_out > params.min_tokens:
                hit = tracked.detokenizer.check_stop(list(params.stop),
                                                     params.include_stop_str_in_output)
                if hit is not None:
                    self.scheduler.finish(request, "stop", hit)
                    return
            elif num_out == params.min_tokens:
                tracked.detokenizer.skip_stop_check()
        if num_out >= request.max_tokens:
            self.scheduler.finish(request, "length")

    # -- introspection -----------------------------------------------------------------------

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self._drafted_hist[num_drafts] += 1
            self._accepted_hist[num_accepted] += 1

    def stats(self) -> dict[str, Any]:
        """Counters: running/waiting requests, KV usage, prefix cache, preemptions, blocks
        freed out of sliding windows (:mod:`mrv2.engine.block_tables`), prompt
        tokens (of requests past their first token) and generated tokens so far, whether the
        engine sleeps or is paused (1 or 0), the LoRA
        adapters of running and waiting requests, and with
        speculation the drafts verified and accepted, overall and per draft position
        (``spec_acceptance_rate_per_pos[j]``: of the drafts at position ``j``, the fraction
        kept), and the mean accepted length (tokens a verifying step yields: 1 + accepted
        drafts per request-step with drafts)."""
        blocks = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_usage": blocks.usage,
            "kv_free_blocks": blocks.num_free_blocks,
            "kv_num_blocks": blocks.num_blocks,
            "prefix_cache_queries": blocks.num_queried_tokens,
            "prefix_cache_hits": blocks.num_hit_tokens,
            "prefix_cache_hit_rate": blocks.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_window_freed_blocks": self.scheduler.tables.num_freed,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "is_sleeping": int(self.is_sleeping()),
            "is_paused": int(self._paused),
            **spec_stats(self._drafted_hist, self._accepted_hist),
            **lora_stats(self.config, self.scheduler),
        }
