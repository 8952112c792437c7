"""Beam search over the engine, as vLLM's ``LLM.beam_search`` runs it: each step every live
beam of every prompt is a one-token request asking for its top ``2 * beam_width`` logprobs
(the prefix cache holds the beams' common tokens, so a step computes one token a beam), the
candidates are ranked by cumulative logprob and the best ``beam_width`` go on; a candidate
ending in EOS is complete. At the end the complete and the live beams are ranked by
``cum_logprob / len(tokens) ** length_penalty`` (``tokens``: prompt and output, EOS not
counted) and the best ``beam_width`` returned, best first.

With a structured output (``BeamSearchParams.structured_outputs``, vLLM's) each beam keeps its
own grammar state (a :class:`~mrv2.engine.structured_outputs.Guide`; a candidate forks its
beam's): a step's request carries the constraint and the beam's output so far
(``SamplingParams._grammar_prefix``: the engine's matcher replays it, as vLLM's beam search
does, O(output) a step), so its top logprobs are those of the tokens the grammar allows (the
masked distribution's, as every constrained request's); a candidate the grammar refuses is
dropped, and one that completes the match ends its beam (``stop``), as EOS does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import (
    F32_MAX,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    SamplingParams,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from mrv2.engine.structured_outputs import Guide, StructuredOutputs

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "beam_search"]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters (``beam_width`` at most ``MAX_LOGPROBS // 2``: a step
    reads each beam's top ``2 * beam_width`` tokens); ``structured_outputs`` holds every beam
    to a JSON schema, regex, choice or grammar (vLLM's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    #: The server's reasoning parser's mark (``SamplingParams._reasoning``): the grammar holds
    #: what follows the thinking block.
    _reasoning: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        top = MAX_LOGPROBS // 2
        for name, value, ok, allowed in (
                ("beam_width", self.beam_width, isinstance(self.beam_width, int)
                 and 1 <= self.beam_width <= top, f"an integer in [1, {top}]"),
                ("max_tokens", self.max_tokens, isinstance(self.max_tokens, int)
                 and self.max_tokens >= 1, "an integer >= 1"),
                ("temperature", self.temperature, isinstance(self.temperature, int | float)
                 and 0 <= self.temperature <= MAX_TEMPERATURE,  # (its steps' SamplingParams')
                 f"a number in [0, {MAX_TEMPERATURE:g}]"),
                ("length_penalty", self.length_penalty,
                 isinstance(self.length_penalty, int | float)
                 and abs(self.length_penalty) <= F32_MAX, "a finite number")):
            if not ok or isinstance(value, bool):
                raise ValueError(f"BeamSearchParams.{name}={value!r} is invalid: expected "
                                 f"{allowed}")
        if not (self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams)):
            raise ValueError(f"BeamSearchParams.structured_outputs={self.structured_outputs!r} "
                             "is invalid: expected None or a StructuredOutputsParams")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` (the prompt's, then the output's), the output's per-token logprob,
    their sum, the decoded text of ``tokens`` and why it ended ("stop": EOS, "length")."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    #: The beam's grammar state (a structured output's; None: free), dropped at the end.
    guide: Guide | None = field(default=None, repr=False, compare=False)

    @property
    def output_tokens(self) -> list[int]:
        """The tokens after the prompt."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """A prompt's best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def _score(beam: BeamSearchSequence, eos: frozenset[int],
           length_penalty: float) -> tuple[int, float]:
    """A sort key (larger: better) ranking as ``cum_logprob / length ** length_penalty`` does,
    taken in log space: ``length ** length_penalty`` of a large penalty overflows (or, of a
    negative one, underflows to 0) as a float."""
    length = len(beam.tokens) - (1 if beam.finish_reason == "stop" and beam.tokens
                                 and beam.tokens[-1] in eos else 0)
    cum, log_length = beam.cum_logprob, math.log(length) * length_penalty
    if cum < 0:  # (the usual case) nearer 0 is better: a smaller log of the score's size
        return 0, log_length - math.log(-cum)
    return (1, 0.0) if cum == 0 else (2, math.log(cum) - log_length)


class BeamSearch:
    """The beams of some prompts, step by step, whoever runs the steps' requests
    (:func:`beam_search` on an engine; ``mrv2 serve`` through its worker); a structured
    output's grammar states come from ``structured`` (the engine's tokenizer's; required
    with ``params.structured_outputs``, whose bad grammar is a ValueError here)."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], max_model_len: int,
                 structured: StructuredOutputs | None = None) -> None:
        self.params = params
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.max_model_len = max_model_len
        #: Each step's requests: one token, the top ``2 * beam_width`` logprobs (with a
        #: structured output: the constraint, and the beams' outputs so far to replay).
        self.step_params = SamplingParams(temperature=params.temperature, max_tokens=1,
                                          ignore_eos=True, logprobs=2 * params.beam_width,
                                          seed=0, structured_outputs=params.structured_outputs,
                                          _reasoning=params._reasoning)
        self.live = [[BeamSearchSequence(list(p), len(p))] for p in prompts]
        if params.structured_outputs is not None:
            if structured is None:
                raise ValueError("BeamSearchParams.structured_outputs needs the engine's "
                                 "structured outputs (its tokenizer)")
            for beams in self.live:
                beams[0].guide = structured.guide(self.step_params, beams[0].tokens)
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self._asked: list[tuple[int, BeamSearchSequence]] = []

    def requests(self) -> list[list[int]]:
        """The token ids of this step's requests (none: the search is over)."""
        self._asked = []
        if self.steps >= self.params.max_tokens:
            return []
        if self.params.structured_outputs is not None:  # (every live beam has steps tokens)
            self.step_params = dataclasses.replace(self.step_params,
                                                   _grammar_prefix=self.steps)
        for i, beams in enumerate(self.live):
            for beam in beams:
                if len(beam.tokens) >= self.max_model_len:
                    beam.finish_reason = "length"
                    self.done[i].append(beam)
                else:
                    self._asked.append((i, beam))
            self.live[i] = [b for b in beams if b.finish_reason is None]
        return [beam.tokens for _, beam in self._asked]

    @property
    def asked_prompts(self) -> list[int]:
        """The prompt (its index) of each of the step's :meth:`requests`."""
        return [i for i, _ in self._asked]

    def advance(self, tops: list[dict[int, Any]]) -> None:
        """The step's top logprobs (``{token: Logprob}``), one per request, in order."""
        width = self.params.beam_width
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (i, beam), top in zip(self._asked, tops, strict=True):
            for token, lp in top.items():
                guide = None
                if beam.guide is not None:  # (a token the mask refused has logprob -inf)
                    if lp.logprob == -math.inf:
                        continue
                    guide = beam.guide.fork()
                    guide.advance(token)
                    if guide.broken:
                        continue
                grown = BeamSearchSequence(beam.tokens + [token], beam.num_prompt_tokens,
                                           beam.logprobs + [lp.logprob],
                                           beam.cum_logprob + lp.logprob, guide=guide)
                if token in self.eos or (guide is not None and guide.done):
                    grown.finish_reason = "stop"  # (EOS, or the match complete)
                    self.done[i].append(grown)
                else:
                    candidates[i].append(grown)
        self.live = [sorted(c, key=lambda b: b.cum_logprob, reverse=True)[:width]
                     for c in candidates]
        self.steps += 1

    def outputs(self, tokenizer: Any = None) -> list[BeamSearchOutput]:
        """Each prompt's best ``beam_width`` sequences, best first (texts decoded when a
        tokenizer is given)."""
        outputs = []
        for i, beams in enumerate(self.live):
            for beam in beams:
                beam.finish_reason = beam.finish_reason or "length"
            for beam in self.done[i] + beams:
                beam.guide = None  # (their matchers go)
            ranked = sorted(self.done[i] + beams, reverse=True,
                            key=lambda b: _score(b, self.eos, self.params.length_penalty))
            ranked = ranked[: self.params.beam_width]
            if tokenizer is not None:
                for beam in ranked:
                    beam.text = tokenizer.decode(beam.tokens)
            outputs.append(BeamSearchOutput(ranked))
        return outputs


def beam_search(engine: Any, prompts: list[list[int]], params: BeamSearchParams,
                loras: Sequence[LoRARequest | None] | None = None,
                salts: Sequence[str | None] | None = None) -> list[BeamSearchOutput]:
    """Beam search for each of ``prompts`` (token ids) on ``engine`` (an idle
    :class:`~mrv2.engine.engine.LLMEngine`), each through its adapter of ``loras`` (None:
    the base model) and with its ``cache_salt`` of ``salts`` (None: unsalted); every prompt
    is validated before any runs."""
    mode = engine.config.model.logprobs_mode
    if mode != "raw_logprobs":  # (beams are ranked by their summed log-probabilities)
        raise ValueError(f"beam search needs logprobs_mode='raw_logprobs', the engine's is "
                         f"{mode!r}")
    structured = (engine._structured_outputs() if params.structured_outputs is not None
                  else None)
    search = BeamSearch(prompts, params, frozenset(engine.eos_token_ids), engine.max_model_len,
                        structured)
    adapters = list(loras) if loras is not None else [None] * len(prompts)
    cache_salts = list(salts) if salts is not None else [None] * len(prompts)
    for prompt, lora in zip(prompts, adapters, strict=True):
        engine.validate(list(prompt), search.step_params, lora)
    ids = itertools.count()
    while True:
        requests = search.requests()
        asked: list[str] = []
        top: dict[str, dict[int, Any]] = {}
        try:  # (stopped midway, Ctrl-C or a refusal: its requests must not run in the next call)
            for tokens, i in zip(requests, search.asked_prompts, strict=True):
                asked.append(engine.add_request(tokens, search.step_params,
                                                request_id=f"beam-{id(search)}-{next(ids)}",
                                                lora_request=adapters[i],
                                                cache_salt=cache_salts[i]))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        logprobs = out.outputs[0].logprobs
                        top[out.request_id] = logprobs[0] if logprobs else {}
        except BaseException:
            for req_id in asked:  # (finished ones are ignored)
                engine.abort(req_id)
            raise
        if not asked:
            break
        search.advance([top[req_id] for req_id in asked])
    return search.outputs(engine.tokenizer)
