"""Engine-side sampling extras: a request's tracking and its outputs (:class:`TrackedRequest`),
its params' engine-derived fields (bad words as token ids: :class:`BadWords`), logprob
bookkeeping and ``n > 1`` fan-out / merge.

Kept out of ``engine.py`` so the loop stays short. Logprobs arrive with the sampled tokens
(``AsyncStepOutput.logprobs()``) as ``(ids, values, rank)`` where ``ids[0]`` is the sampled
token and ``ids[1:]`` the batch's top-k; each request keeps its own ``k``.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mrv2.contract.params import RequestOutputKind, SamplingParams
from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from mrv2.engine.request import Request
from mrv2.engine.structured_outputs import Guide
from mrv2.engine.tokenizer import Tokenizer

#: Separator of a parent request id and the sample index in its sub-request ids.
CHILD_SEP = "#n"

#: The bad-word lists whose token ids :class:`BadWords` keeps (the newest asked for).
BAD_WORDS_KEPT = 64


@dataclass
class LogprobState:
    """Logprobs gathered so far for one request."""

    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative: float = 0.0
    prompt: list[PositionLogprobs | None] = field(default_factory=lambda: [None])


@dataclass
class TrackedRequest:
    """What the engine keeps of a request beside the scheduler's :class:`Request`: its
    detokenizer, structured output's matcher and logprobs, and what its outputs sent."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    stream: bool = False
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_any: bool = False  # an output of it went out (prompt logprobs go with a delta's first)
    holdback: int = 0  # text kept back while it runs: a stop string cut there would take it
    logprobs: LogprobState | None = None
    guide: Guide | None = None  # a structured output's matcher
    #: (structured outputs with speculation) the drafts proposed after its last processed
    #: step: the ones its next step verifies when no step of it is in flight
    drafts: list[int] | None = None
    #: An embedding request's pooled state, once its prompt is computed (a per-token
    #: request's: a row per prompt token, as they are computed).
    embedding: list[Any] | None = None

    def output(self) -> RequestOutput:
        """The request's output now: what is new since its previous output, and (but for a
        DELTA request) everything so far. O(new) for a delta: a long stream costs O(length)
        in all, where cumulative outputs cost O(length) each."""
        request = self.request
        params = request.sampling_params
        delta = params.output_kind == RequestOutputKind.DELTA
        # a pooling request's one sampled token is the engine's, nobody's output
        pooling = request.pooling_params is not None
        detok = None if pooling else self.detokenizer
        ids = [] if pooling else request.output_token_ids
        new_tokens = ids[self.sent_tokens :]
        new_text = "" if detok is None else detok.stream_delta(request.finished, self.holdback)
        completion = CompletionOutput(
            index=0,
            text=new_text if delta or detok is None else detok.streamed_text,
            token_ids=new_tokens if delta else list(ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            lora_request=request.lora_request,
        )
        lp = self.logprobs
        if lp is not None and params.logprobs is not None:
            completion.logprobs = (lp.logprobs[self.sent_logprobs :] if delta
                                   else list(lp.logprobs))
            completion.cumulative_logprob = lp.cumulative
            self.sent_logprobs = len(lp.logprobs)
        output = RequestOutput(
            request_id=request.req_id,
            prompt=self.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.finished,
            new_token_ids=new_tokens,
            new_text=new_text,
            num_cached_tokens=request.num_cached_tokens,
            delta=delta,
            embedding=self.embedding,
            lora_request=request.lora_request,
        )
        if request.finished and request.scheduled_time is not None:
            output.time_in_queue = request.scheduled_time - request.arrival_time
        if lp is not None and params.prompt_logprobs is not None and not (
                delta and self.sent_any):
            output.prompt_logprobs = list(lp.prompt)
        self.sent_tokens, self.sent_any = len(ids), True
        return output


def prepare_params(params: SamplingParams, eos: frozenset[int], bad_words: list[list[int]],
                   num_prompt_tokens: int, vocab_size: int | None = None) -> SamplingParams:
    """A copy of ``params`` (the caller's object may be shared by many requests) with the
    engine-derived fields: EOS ids for ``min_tokens`` (masked until it is reached, with or
    without ``ignore_eos``), the bad words' token ids (``bad_words``: those of
    :func:`bad_words_token_ids`, copied), prompt length. With ``vocab_size`` (the model's
    logits), EOS ids past it are left out: such an EOS is never sampled (the sampler's masks
    index the logits by id).
    """
    # a deep copy: the caller may change or reuse its lists and dicts (logit_bias,
    # allowed_token_ids, ...) while the request runs; ``replace`` validates the copy again
    params = dataclasses.replace(copy.deepcopy(params))
    params._num_prompt_tokens = num_prompt_tokens
    # (under ignore_eos too, as vLLM's ``all_stop_token_ids``: min_tokens masks the EOS)
    params._eos_token_ids = sorted(t for t in eos if vocab_size is None or t < vocab_size)
    params._bad_words_token_ids = [list(ids) for ids in bad_words]
    return params


def bad_words_token_ids(params: SamplingParams, tokenizer: Tokenizer | None,
                        vocab_size: int | None = None) -> list[list[int]]:
    """``params.bad_words`` as token-id sequences to ban; raises ``ValueError`` for a word
    vLLM refuses.

    A bad word is tokenized without its leading whitespace and, where that is as many tokens
    with another first token, with one space before it (vLLM's ``update_from_tokenizer``),
    each variant banned separately; a word of no tokens, or of ids past the tokenizer's, is
    refused. With ``vocab_size`` (the model's logits), ids past it (a tokenizer's added
    tokens the model has no logit for) are left out: a variant that holds one is never
    completed (the sampler's masks index the logits by id)."""
    words: list[list[int]] = []
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this model has none")
        for word in params.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain or not spaced:
                raise ValueError(f"SamplingParams.bad_words={params.bad_words!r} is invalid: "
                                 f"{word!r} is no tokens")
            # vLLM's rule: the spaced variant only when it is a word token of its own
            variants = [plain] + ([spaced] if len(spaced) == len(plain)
                                  and spaced[0] != plain[0] else [])
            for ids in variants:
                if max(ids) > tokenizer.max_token_id:
                    raise ValueError(
                        f"SamplingParams.bad_words={params.bad_words!r} is invalid: {word!r} "
                        f"is token ids {ids}, past the tokenizer's {tokenizer.max_token_id}")
            words.extend(ids for ids in variants if ids not in words
                         and (vocab_size is None or max(ids) < vocab_size))
    return words


class BadWords:
    """:func:`bad_words_token_ids` for one engine's tokenizer and vocabulary, remembered
    for the :data:`BAD_WORDS_KEPT` word lists asked for last: a request's words are tokenized
    once, though :meth:`~mrv2.engine.engine.LLMEngine.validate` (the server's and ``LLM``'s
    call, then ``add_request``'s own) and each sample of an ``n > 1`` request need them. A
    list refused is not kept (each asking raises the same error). Thread-safe: the server
    validates in its event loop's thread while the engine adds requests in its own."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._kept: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    def token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``params.bad_words``' token-id sequences (kept ones: do not change them)."""
        if not params.bad_words:
            return []
        key = tuple(params.bad_words)
        with self._lock:
            words = self._kept.get(key)
            if words is not None:
                self._kept.move_to_end(key)
                return words
        words = bad_words_token_ids(params, self.tokenizer, self.vocab_size)
        with self._lock:
            self._kept[key] = words
            if len(self._kept) > BAD_WORDS_KEPT:
                self._kept.popitem(last=False)
        return words


def _decode(tokenizer: Tokenizer | None, token: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)


def _position(
    ids: list[int], values: list[float], rank: int, k: int, tokenizer: Tokenizer | None
) -> PositionLogprobs:
    # vLLM's (``append_logprobs_for_next_position``): the chosen token first, then the top k
    # with ranks 1..k; a chosen token among them keeps its place and takes its top-k rank
    # (at a tie, not its count rank).
    entry = {ids[0]: Logprob(values[0], rank, _decode(tokenizer, ids[0]))}
    for j in range(1, min(k, len(ids) - 1) + 1):
        held = entry.get(ids[j])
        entry[ids[j]] = Logprob(values[j], j, held.decoded_token if held is not None
                                else _decode(tokenizer, ids[j]))
    return entry


def add_sample_logprobs(
    state: LogprobState, k: int, row: tuple[list[int], list[float], int],
    tokenizer: Tokenizer | None,
) -> None:
    """Record one generated token's logprobs (its own, and the top ``k``)."""
    ids, values, rank = row
    state.logprobs.append(_position(ids, values, rank, k, tokenizer))
    state.cumulative += values[0]


def add_prompt_logprobs(
    state: LogprobState, k: int, first: int, ids: list[list[int]], values: list[list[float]],
    ranks: list[int], tokenizer: Tokenizer | None, prompt_len: int,
) -> None:
    """Record prompt logprobs of positions ``first ..``; positions already held are skipped,
    and so are positions past the prompt (a preempted request recomputes its prompt and its
    outputs as one prefill)."""
    for i in range(len(ids)):
        if first + i == len(state.prompt) < prompt_len:
            state.prompt.append(_position(ids[i], values[i], ranks[i], k, tokenizer))


def child_id(parent: str, index: int) -> str:
    """Request id of sample ``index`` of parent ``parent``."""
    return f"{parent}{CHILD_SEP}{index}"


class FanOut:
    """Merges the outputs of ``n > 1`` sub-requests into one ``RequestOutput`` per parent (a
    streamed DELTA parent's output holds the one child whose output it is)."""

    def __init__(self) -> None:
        self.parents: dict[str, tuple[int, bool]] = {}  # parent id -> (n, stream)
        self.child_parent: dict[str, tuple[str, int]] = {}
        self.latest: dict[str, dict[int, RequestOutput]] = {}
        self.done: dict[str, set[int]] = {}
        self.started: set[str] = set()  # parents with an output out

    def add(self, parent: str, n: int, stream: bool) -> list[str]:
        """Register a parent; returns its children's ids."""
        children = [child_id(parent, i) for i in range(n)]
        self.parents[parent] = (n, stream)
        self.latest[parent] = {}
        self.done[parent] = set()
        for i, child in enumerate(children):
            self.child_parent[child] = (parent, i)
        return children

    def merge(self, output: RequestOutput) -> RequestOutput | None:
        """The output to return for a child's ``output`` (``None``: nothing yet), or ``output``
        itself for a request that is no child."""
        key = self.child_parent.get(output.request_id)
        if key is None:
            return output
        parent, index = key
        n, stream = self.parents[parent]
        self.latest[parent][index] = output
        if output.finished:
            self.done[parent].add(index)
        finished = len(self.done[parent]) == n
        if not (stream or finished):
            return None
        latest = self.latest[parent]
        delta = stream and output.delta  # (streamed deltas: this child's news alone)
        outs = []
        for i in [index] if delta else sorted(latest):
            o = latest[i].outputs[0]
            outs.append(CompletionOutput(i, o.text, o.token_ids, o.finish_reason, o.stop_reason,
                                         o.cumulative_logprob, o.logprobs, o.lora_request))
        prompt_logprobs = latest[0].prompt_logprobs if 0 in latest else output.prompt_logprobs
        if delta:  # a delta request's prompt logprobs go with its first output only
            prompt_logprobs = None if parent in self.started else output.prompt_logprobs
        self.started.add(parent)
        merged = RequestOutput(
            request_id=parent, prompt=output.prompt, prompt_token_ids=output.prompt_token_ids,
            outputs=outs, finished=finished,
            new_token_ids=output.new_token_ids if stream else [],
            new_text=output.new_text if stream else "",
            num_cached_tokens=min(o.num_cached_tokens for o in latest.values()),
            prompt_logprobs=prompt_logprobs, delta=output.delta,
            lora_request=output.lora_request,
        )
        if finished:
            queued = [o.time_in_queue for o in latest.values() if o.time_in_queue is not None]
            merged.time_in_queue = min(queued, default=None)
            self.discard(parent)
        return merged

    def discard(self, parent: str) -> list[str]:
        """Forget ``parent`` (finished or aborted); returns its children's ids."""
        if parent not in self.parents:
            return []
        n, _ = self.parents.pop(parent)
        children = [child_id(parent, i) for i in range(n)]
        for child in children:
            del self.child_parent[child]
        del self.latest[parent], self.done[parent]
        self.started.discard(parent)
        return children
