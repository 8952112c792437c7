"""``SamplingParams``: per-request sampling settings, with vLLM's names and meanings.

Validation happens at construction, so a bad request fails before any work starts, with a
message naming the field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import enum
import json as _json
import logging
from dataclasses import dataclass, field
from typing import Any, TypeGuard

logger = logging.getLogger(__name__)

_GREEDY_EPS = 1e-5
#: The lowest temperature above 0 (vLLM's ``_MAX_TEMP``): one in (0, 0.01) is raised to it, with
#: a warning, as vLLM's ``SamplingParams`` does (dividing logits by less risks inf and NaN).
MIN_TEMPERATURE = 0.01
#: The highest temperature (vLLM's and OpenAI's range is [0, 2]).
MAX_TEMPERATURE = 2.0
#: Most top-k logprobs a request may ask for by default (vLLM's default ``max_logprobs``;
#: ``EngineConfig.model.max_logprobs`` sets the engine's).
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a streamed request holds (vLLM's names and values).

    ``CUMULATIVE``: everything so far (each output copies the whole answer: O(length) a
    step). ``DELTA``: only what is new since the request's previous output, so a long stream
    costs O(length) in all (``mrv2 serve`` asks for this). ``FINAL_ONLY``: one output, when the
    request finishes, even from a streamed ``add_request``.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (``json``: a dict or its text), any JSON object (``json_object=True``), a regular
    expression (``regex``), one of several strings (``choice``), a grammar (``grammar``: Lark,
    or EBNF / GBNF as llama.cpp and xgrammar write it: ``root ::= ...``), or structural tags
    (``structural_tag``: vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}``, a dict or its JSON text: free text in which each ``begin`` opens a JSON value of
    its ``schema``, closed by its ``end``). Options of the JSON kinds (a structural tag's
    schemas included): ``disable_any_whitespace`` makes JSON compact, ``whitespace_pattern``
    (a regex) is the whitespace allowed between JSON tokens, ``disable_additional_properties``
    closes every object that lists its properties (``additionalProperties: false`` where the
    schema says nothing). The engine masks, at every step, the tokens that cannot continue a
    match (:mod:`mrv2.engine.structured_outputs`), and the request stops when the match is
    complete."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    #: (None, vLLM's default, is False)
    json_object: bool | None = False
    #: JSON without whitespace between tokens (compact separators); by default any
    #: whitespace may appear there, as vLLM's default.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.json_object is None:
            self.json_object = False
        for flag in ("json_object", "disable_any_whitespace",  # ("false" is no False)
                     "disable_additional_properties"):
            _check(isinstance(getattr(self, flag), bool), f"structured_outputs.{flag}",
                   getattr(self, flag), "true or false")
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs is invalid: expected exactly one of json, "
                "json_object, regex, choice, grammar, structural_tag (got "
                f"{', '.join(kinds) or 'none'})")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as error:
                    raise ValueError(f"SamplingParams.structured_outputs.{name} is invalid: "
                                     f"expected {_JSON_OF[name]} ({error})") from None
                if name == "structural_tag" and not isinstance(value, dict):
                    raise ValueError("SamplingParams.structured_outputs.structural_tag is "
                                     f"invalid: expected {_JSON_OF[name]}")
            elif value is not None and not isinstance(value, dict):
                raise ValueError(f"SamplingParams.structured_outputs.{name} is invalid: "
                                 f"expected {_JSON_OF[name]} (a dict or its text)")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and bool(value)),
                   f"structured_outputs.{name}", value, "a non-empty string")
        choice = self.choice
        _check(choice is None or (isinstance(choice, list) and len(choice) > 0 and all(
            isinstance(c, str) and c for c in choice)), "structured_outputs.choice", choice,
               "a non-empty list of non-empty strings")

    def kinds(self) -> list[str]:
        """The constraint kinds set (valid params have one)."""
        set_ = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                if getattr(self, name) is not None]
        return set_ + (["json_object"] if self.json_object else [])


_JSON_OF = {"json": "a JSON schema",
            "structural_tag": 'a structural tag, {"structures": [...], "triggers": [...]}'}


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, per request (vLLM's names).

    ``temperature == 0`` is greedy; a temperature in (0, 0.01) is raised to 0.01 with a warning
    and one above 2 refused (vLLM's rules); a greedy request has ``n == 1`` (vLLM refuses
    ``n > 1`` copies of one greedy answer). ``top_k`` of 0 or -1 disables top-k; ``top_p == 1``
    disables top-p. ``seed`` (any int64; -1 is none, as vLLM's) makes the request's samples
    reproducible whatever else is in the batch.

    Penalties (vLLM's meanings): ``repetition_penalty`` divides positive / multiplies negative
    logits of tokens seen in the prompt or the output; ``frequency_penalty`` subtracts
    ``count * f`` and ``presence_penalty`` subtracts ``p`` for tokens of the output.
    ``logit_bias`` adds to chosen logits (any finite bias, as vLLM's ``SamplingParams``; its
    server and mrv2's clamp a request's to OpenAI's [-100, 100]); ``allowed_token_ids`` masks
    every other token;
    ``bad_words`` (strings, tokenized by the engine) ban a word's last token when its other
    tokens end the output; ``min_tokens`` masks EOS and ``stop_token_ids`` until that many
    tokens are out. ``logprobs=k`` returns the top-k plus the sampled token's logprob and rank
    per generated token, ``prompt_logprobs=k`` the same per prompt token (``k=0``: only the
    actual token). Logprobs are those of the raw model distribution (before penalties,
    processors and temperature), as vLLM returns by default. ``structured_outputs``
    (:class:`StructuredOutputsParams`) constrains the output to a JSON schema, a regular
    expression, a choice or a grammar. ``output_kind`` (:class:`RequestOutputKind`) says whether
    a streamed request's outputs are cumulative or deltas.
    ``n > 1`` runs ``n`` independent samples (seeds derived from ``seed`` and the index).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: False: no text (``CompletionOutput.text`` is ""), the token ids only (vLLM's); stop
    #: strings need the text and are refused with it.
    detokenize: bool = True
    #: Keep the prompt's last k tokens (``LLM.generate`` / ``LLM.chat``; vLLM's); -1: as many
    #: as the context leaves beside ``max_tokens`` (at most ``max_model_len - 1``).
    truncate_prompt_tokens: int | None = None
    #: vLLM's opaque extra arguments (for custom logits processors): kept, never read by mrv2.
    extra_args: dict[str, Any] | None = None
    #: vLLM's: False (with ``skip_special_tokens=False``) drops the space a decoder (WordPiece's)
    #: puts before an added token that follows an added token, as vLLM's fast detokenizer does;
    #: a no-op otherwise (byte-level BPE and sentencepiece decoders put none there).
    spaces_between_special_tokens: bool = True
    # Filled in by the engine (not user-facing): EOS ids masked by min_tokens, bad words as ids.
    _eos_token_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False,
                                                  compare=False)
    # The original prompt length: a request resumed after preemption re-enters the runner
    # with prompt + outputs as its prefill, and penalties / min_tokens / bad words need the
    # boundary. None: the whole prefill is the prompt.
    _num_prompt_tokens: int | None = field(default=None, repr=False, compare=False)
    # The server's reasoning parser ("qwen3", "deepseek_r1", "openai_gptoss"): the grammar
    # holds only after the thinking block (gpt-oss: after <|channel|>final<|message|>).
    _reasoning: str | None = field(default=None, repr=False, compare=False)
    # Beam search's steps (:mod:`mrv2.engine.beam_search`): the prompt's last k tokens are a
    # beam's output so far, already held to ``structured_outputs``; the grammar consumes them
    # before the first sample (the thinking block is looked for in the tokens before them).
    _grammar_prefix: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
               self.stop, "a non-empty string or a list of non-empty strings")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if _is_number(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("SamplingParams.temperature=%s is below %s, which risks inf or NaN "
                           "in the sampler: raised to %s (as vLLM does)", self.temperature,
                           MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.seed == -1 and _is_int(self.seed):  # vLLM's: -1 is no seed (a random one)
            self.seed = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if (type(self.output_kind) is int
                and self.output_kind in RequestOutputKind._value2member_map_):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n",
               self.n, "an integer >= 1")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               "temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}] (0 "
               "means greedy)")
        _check(self.n == 1 or not self.greedy, "n", self.n,
               "1 with greedy sampling (temperature 0: every sample would be the same)")
        _check(_is_number(self.top_p) and F32_TINY <= self.top_p <= 1.0, "top_p", self.top_p,
               "a number in (0, 1] (at least 1.2e-38, float32's smallest normal)")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "an integer >= 1, or 0 / -1 to disable")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
               "a number in [0, 1]")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
               "seed", self.seed, "None or an integer in [-2**63, 2**63) (-1: none)")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "None or an integer >= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"an integer <= max_tokens ({self.max_tokens})")
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a non-empty string or a list of non-empty strings")
        _check(all(_is_token(t) for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, value,
                   "a number in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", self.repetition_penalty,
               "a finite number > 0 (1 disables; at most 3.4e38)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                     and value >= 0),
                   name, value, "None or an integer >= 0 (at most the engine's max_logprobs, "
                   f"{MAX_LOGPROBS} by default)")
        bias = self.logit_bias  # (any finite bias, as vLLM's: only its server clamps them)
        _check(bias is None or (isinstance(bias, dict) and all(
            _is_token(k) and _is_number(v) for k, v in bias.items())),
               "logit_bias", bias, "None or a dict {token id >= 0: a finite number}")
        allowed = self.allowed_token_ids
        _check(allowed is None or (isinstance(allowed, list) and len(allowed) > 0
                                   and all(_is_token(t) for t in allowed)),
               "allowed_token_ids", allowed, "None or a non-empty list of token ids >= 0")
        words = self.bad_words
        _check(words is None or (isinstance(words, list)
                                 and all(isinstance(w, str) and w for w in words)),
               "bad_words", words, "None or a list of non-empty strings")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs,
               "None or a StructuredOutputsParams")
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        _check(isinstance(self.detokenize, bool), "detokenize", self.detokenize,
               "true or false")
        _check(self.detokenize or not self.stop, "detokenize", self.detokenize,
               "true with stop strings (they are matched in the text)")
        keep = self.truncate_prompt_tokens
        _check(keep is None or (_is_int(keep) and (keep >= 1 or keep == -1)),
               "truncate_prompt_tokens", keep, "None, an integer >= 1, or -1 (the context "
               "less max_tokens)")
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args",
               self.extra_args, "None or a dict")
        _check(isinstance(self.spaces_between_special_tokens, bool),
               "spaces_between_special_tokens", self.spaces_between_special_tokens,
               "true or false")

    @property
    def greedy(self) -> bool:
        """True when the request picks the most likely token (temperature near 0)."""
        return self.temperature < _GREEDY_EPS

    def prompt_len(self, prefill_len: int) -> int:
        """Tokens of a ``prefill_len``-token prefill that are prompt (the rest: outputs)."""
        n = self._num_prompt_tokens
        return prefill_len if n is None else min(n, prefill_len)

    @property
    def uses_penalties(self) -> bool:
        """True when any of the three penalties is active."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id named by these params is outside the model's vocabulary."""
        assert isinstance(self.stop_token_ids, list)
        named = (("stop_token_ids", self.stop_token_ids),
                 ("logit_bias", list(self.logit_bias or {})),
                 ("allowed_token_ids", self.allowed_token_ids or []))
        for name, tokens in named:
            for token in tokens:
                _check(token < vocab_size, name, token, f"token ids in [0, {vocab_size})")

    def check_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """Raise if ``logprobs`` or ``prompt_logprobs`` asks for more than the engine's
        ``max_logprobs`` (vLLM's; -1: the whole vocabulary)."""
        most = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value <= most, name, value,
                   f"None or an integer in [0, {most}] (the engine's max_logprobs"
                   + (" = -1: the vocabulary's size)" if max_logprobs == -1 else ")"))

    def child(self, index: int, seed: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n > 1`` request: ``n=1`` and its own seed."""
        child = dataclasses.replace(self, n=1, seed=seed)
        child._eos_token_ids = list(self._eos_token_ids)
        child._bad_words_token_ids = [list(w) for w in self._bad_words_token_ids]
        return child


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of an ``n > 1`` request: index 0 keeps ``seed``."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 29)) & (2**63 - 1)


def _is_int(value: object) -> TypeGuard[int]:
    """An int, not a bool (``True`` is no count of tokens)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: object) -> bool:
    return _is_int(value) and value >= 0


#: float32's largest finite value: the sampler keeps every float parameter in float32, so a
#: larger one (1e39, JSON's Infinity) would become inf there and sample token 0.
F32_MAX = 3.4028234663852886e38
#: float32's smallest normal value: a top_p below it would round to 0 there.
F32_TINY = 1.1754943508222875e-38


def _is_number(value: object) -> bool:
    """An int or float (not a bool) that float32 holds as a finite number."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and abs(value) <= F32_MAX)  # (False for NaN and infinities too)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed}")
