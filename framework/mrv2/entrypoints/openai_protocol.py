"""Pydantic models of the OpenAI-compatible API's completion and chat requests (their
SamplingParams), and the request field an error is about (:func:`value_error_param`).

Validation is strict, as OpenAI's: ``"stream": "yes"`` or ``"n": "2"`` is a 400 naming the
field, not a coercion (an int is still a valid float). A chat message:
:mod:`~mrv2.entrypoints.openai_messages`; error bodies: :mod:`~mrv2.entrypoints.openai_errors`;
logprobs: :mod:`~mrv2.entrypoints.openai_logprobs`; ``/tokenize`` and ``/detokenize``:
:mod:`~mrv2.entrypoints.openai_tokenize`."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
)

from mrv2.contract.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.engine.request_inputs import check_cache_salt, last_tokens
from mrv2.entrypoints.openai_embeddings import truncation
from mrv2.entrypoints.openai_messages import ChatMessage

#: The values of ``reasoning_effort`` (a chat request's) and ``reasoning.effort`` (a
#: Responses request's), vLLM's and OpenAI's: the chat template's ``reasoning_effort``.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

#: Fields OpenAI's API types "... or null" whose null mrv2 took as a 400: null is the default.
NULL_IS_DEFAULT = ("n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "echo",
                   "parallel_tool_calls")


def null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A ``mode="before"`` field validator: OpenAI's ``null`` for a field it types "... or
    null" is the field's default, as OpenAI and vLLM take it."""
    assert info.field_name is not None
    return cls.model_fields[info.field_name].default if value is None else value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    _null_is_the_default = field_validator(*NULL_IS_DEFAULT, mode="before",
                                           check_fields=False)(null_is_default)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    #: vLLM's: False (with skip_special_tokens false) drops the space a decoder puts between
    #: two added tokens (:class:`mrv2.engine.detokenizer.IncrementalDetokenizer`).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    #: Keep only the prompt's last k tokens (vLLM's ``truncate_prompt_tokens``; -1: as many
    #: as the context leaves beside the request's max_tokens).
    truncate_prompt_tokens: int | None = None
    #: vLLM's: completions by beam search, ``n`` beams (:mod:`mrv2.engine.beam_search`).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    #: vLLM's: the prompt's and each choice's token ids beside the text (streamed: the
    #: prompt's in the first chunk, each chunk its new ids).
    return_token_ids: bool = False
    #: vLLM's: logprobs name their tokens ``token_id:N`` (for tokens no text can stand for);
    #: unset: the server's ``--return-tokens-as-token-ids``.
    return_tokens_as_token_ids: bool | None = None
    #: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    #: "schema", "strict"}}`` (and vLLM's ``"structural_tag"``, ``{"type", "structures",
    #: "triggers"}``); vLLM's ``structured_outputs`` (``StructuredOutputsParams``' fields)
    #: and its older ``guided_*`` fields (vLLM dropped them in 0.12 and ignores them since;
    #: here they still hold): one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: (vLLM's older fields too, until 0.12: a structural tag's JSON text, and the whitespace
    #: a JSON constraint allows, whichever field gave it)
    structural_tag: str | None = None
    guided_whitespace_pattern: str | None = None
    #: vLLM's: mixed into the hash of the prompt's first prefix-cache block, so only requests
    #: of the same salt share cached blocks (a non-empty string).
    cache_salt: str | None = None
    #: vLLM's: lower runs first under ``--scheduling-policy priority``; any but 0 is refused
    #: under ``fcfs`` (:meth:`~mrv2.entrypoints.serving.Serving.parse`).
    priority: int = 0
    #: ``--enable-force-include-usage``: a stream ends with its usage, asked for or not.
    _force_usage: bool = PrivateAttr(default=False)

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        return check_cache_salt(value)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        return truncation(value)

    def beam_search_params(self, params: SamplingParams, room: int) -> BeamSearchParams:
        """The beam search of a ``use_beam_search`` request: ``n`` beams of ``params``'
        ``max_tokens`` (``room``, the context left, when unset); ValueError naming the
        field."""
        try:
            return BeamSearchParams(beam_width=self.n,
                                    max_tokens=params.max_tokens or max(room, 1),
                                    ignore_eos=self.ignore_eos,
                                    temperature=params.temperature,
                                    length_penalty=self.length_penalty,
                                    structured_outputs=params.structured_outputs,
                                    _reasoning=params._reasoning)
        except ValueError as error:
            name = "n" if "beam_width" in str(error) else "length_penalty"
            raise ValueError(f"SamplingParams.{name}: {error}") from None

    def beam_search_ignores(self) -> list[str]:
        """The fields the request gives that beam search does not honour (it takes ``n``,
        ``max_tokens``, ``ignore_eos``, ``temperature``, ``length_penalty`` and a structured
        output): constraints on the tokens (stops, biases, penalties) and per-token extras."""
        given = {"stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids),
                 "logit_bias": bool(self.logit_bias), "bad_words": bool(self.bad_words),
                 "allowed_token_ids": self.allowed_token_ids is not None,
                 "presence_penalty": self.presence_penalty != 0,
                 "frequency_penalty": self.frequency_penalty != 0,
                 "repetition_penalty": self.repetition_penalty not in (None, 1),
                 "min_tokens": self.min_tokens != 0,
                 "prompt_logprobs": self.prompt_logprobs is not None,
                 "return_token_ids": self.return_token_ids}
        return [name for name, bad in given.items() if bad]

    def sequences(self, params: SamplingParams) -> int:
        """The sequences each prompt of the request runs at once: ``n`` (a beam search's
        beams; ``params``, the request's, say 1 for it)."""
        return self.n if self.use_beam_search else params.n

    def request_field(self, name: str) -> str:
        """The request's field that the ``SamplingParams`` field ``name`` came from."""
        return name

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  defaults: dict[str, Any] | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("SamplingParams.stream_options is invalid: it needs stream: true")
        if self.use_beam_search and (ignored := self.beam_search_ignores()):
            raise ValueError(f"SamplingParams.{ignored[0]} is invalid with use_beam_search: "
                             f"beam search does not honour {', '.join(ignored)} (it takes n, "
                             "max_tokens, ignore_eos, temperature, length_penalty and a "
                             "structured output)")
        d = defaults or {}  # the model's (generation_config.json) for the fields left unset

        def pick(name: str, value: Any, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        bias = None
        if self.logit_bias:
            try:
                # each bias clamped to OpenAI's [-100, 100], as vLLM's server does
                # (``SamplingParams.from_optional``) rather than refusing it
                bias = {int(k): min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError(
                    f"SamplingParams.logit_bias={self.logit_bias!r} is invalid: "
                    "expected token ids as keys") from None
        return SamplingParams(
            # (a beam search's n is its beam width, which beam_search_params reads: vLLM builds
            # it no SamplingParams, so a greedy one of n beams is no greedy n > 1 to refuse)
            n=1 if self.use_beam_search else self.n,
            temperature=pick("temperature", self.temperature, 1.0),
            top_p=pick("top_p", self.top_p, 1.0),
            top_k=pick("top_k", self.top_k, 0),
            min_p=pick("min_p", self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, 1.0),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=pick("max_tokens", max_tokens, None),
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(),
            # deltas, streamed or not: a request's every output costs O(new tokens), and the
            # server's workers count TTFT and tokens from them (responses.Stream reads deltas)
            output_kind=RequestOutputKind.DELTA,
        )

    def _structured_fields(self) -> list[str]:
        """The structured-output fields the request gives (``response_format`` of type
        ``text`` is none), in the order they are read."""
        fmt = self.response_format
        names = [] if fmt is None or fmt.get("type") == "text" else ["response_format"]
        return names + [name for name in ("structured_outputs", *_GUIDED)
                        if getattr(self, name) is not None]

    def structured_source(self) -> str | None:
        """The field the request's structured output came from (None: it has none)."""
        return next(iter(self._structured_fields()), None)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint of ``response_format``, ``structured_outputs`` or a ``guided_*``
        field (at most one of them); ValueError naming the field otherwise."""
        names = self._structured_fields()
        given = [self._structured_field(name) for name in names]
        if len(given) > 1:
            raise ValueError(f"SamplingParams.{names[1]} is invalid: give one of "
                             f"{', '.join(names)}, not several")
        if given and self.guided_whitespace_pattern is not None:  # (none: ignored, as vLLM's)
            try:
                return dataclasses.replace(given[0],
                                           whitespace_pattern=self.guided_whitespace_pattern)
            except ValueError as error:
                raise ValueError(str(error).replace("structured_outputs.whitespace_pattern",
                                                    "guided_whitespace_pattern")) from None
        return given[0] if given else None

    def _structured_field(self, name: str) -> StructuredOutputsParams:
        """The constraint the field ``name`` (given) states; ValueError naming it."""
        if name == "response_format":
            assert self.response_format is not None
            return _response_format(self.response_format)
        if name == "structured_outputs":
            assert self.structured_outputs is not None
            unknown = sorted(set(self.structured_outputs) - _STRUCTURED_KEYS)
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs is invalid: unknown "
                                 f"{', '.join(unknown)} (allowed: "
                                 f"{', '.join(sorted(_STRUCTURED_KEYS))})")
            # (a null is the field's default, as vLLM's dataclass takes it: a client that
            # sends every field of vLLM's StructuredOutputsParams sends the unset ones so)
            return StructuredOutputsParams(**{k: v for k, v in self.structured_outputs.items()
                                              if v is not None})
        return StructuredOutputsParams(**{_GUIDED[name]: getattr(self, name)})

    def truncate(self, ids: list[int], room: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` ids (all of them when unset; -1:
        ``room``, what the context leaves beside the answer: vLLM's max_model_len minus the
        request's max_tokens)."""
        return last_tokens(ids, self.truncate_prompt_tokens, room)

    def max_tokens_from_model(self, defaults: dict[str, Any] | None) -> bool:
        """Whether :meth:`sampling_params` takes ``max_tokens`` from the model's defaults (the
        request set none): the server then caps it at the context left, as vLLM does, rather
        than refuse a prompt too long for it."""
        return bool(defaults and "max_tokens" in defaults and self._requested_max() is None)

    def _requested_max(self) -> int | None:
        """The request's own ``max_tokens`` (None: unset)."""
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        """The top-k logprobs to return per prompt token (vLLM's ``prompt_logprobs``)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        """A stream's usage chunk: ``stream_options.include_usage``, or the server's
        ``--enable-force-include-usage``."""
        return bool(self.stream and (self._force_usage or (
            self.stream_options and self.stream_options.include_usage)))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats``: usage in every chunk (with
        ``include_usage``)."""
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    #: vLLM's: every chunk carries its choice's usage so far (with ``include_usage``).
    continuous_usage_stats: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    #: vLLM's: prompts given as embeddings, each the base64 of a ``torch.save``'d
    #: ``[length, hidden_size]`` tensor (``--enable-prompt-embeds``); answered before ``prompt``.
    prompt_embeds: str | list[str] | None = None
    #: 0 only with ``echo`` (OpenAI's and vLLM's): the prompt alone, no answer
    #: (:attr:`echo_only`).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    #: vLLM's: the tokenizer's special tokens (a BOS) added to a text prompt; false for a
    #: prompt that already has them (a chat template rendered by the client).
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if p is None:
            if self.prompt_embeds is None:
                raise ValueError("prompt is required (or prompt_embeds)")
            return []
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` (the model's sampling defaults) fill the
        fields it leaves unset; ``max_tokens`` left out is OpenAI's 16, as vLLM's (the model's
        ``max_new_tokens`` only for one sent as null)."""
        _unsupported("suffix", self.suffix, None)
        if self.best_of is not None and self.best_of != self.n:
            _unsupported("best_of", self.best_of, f"None or n ({self.n})")
        max_tokens = self._requested_max()
        if max_tokens == 0:
            if not self.echo:
                raise ValueError("SamplingParams.max_tokens=0 is invalid: expected an integer "
                                 ">= 1 (0 only with echo: the prompt alone)")
            max_tokens = 1  # (vLLM's: one token is generated, and not shown)
        if self.use_beam_search:
            for name, value, allowed in (("stream", self.stream, False),
                                         ("logprobs", self.logprobs, None),
                                         ("echo", self.echo, False)):
                if value != allowed:
                    raise ValueError(f"SamplingParams.{name}={value!r} is invalid with "
                                     f"use_beam_search: expected {allowed!r}")
        return self._sampling(max_tokens, self.logprobs, defaults)

    def _requested_max(self) -> int | None:
        return self.max_tokens  # (16 when left out, as OpenAI's and vLLM's; None: sent null)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (OpenAI's legacy scoring of a text): each choice is
        the prompt, with its logprobs, and no answer."""
        return self.echo and self.max_tokens == 0

    def _prompt_logprobs(self) -> int | None:
        # ``echo`` with ``logprobs``: the prompt's tokens get theirs too (vLLM's rule)
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    #: The chat template's own variables (vLLM's field): ``{"enable_thinking": false}``.
    chat_template_kwargs: dict[str, Any] | None = None
    #: OpenAI's field: the chat template's ``reasoning_effort`` (gpt-oss's "Reasoning: low /
    #: medium / high" line; a template without the variable ignores it); vLLM's values.
    reasoning_effort: ReasoningEffort | None = None
    #: Continue the last (assistant) message instead of opening a new one (vLLM's field;
    #: needs ``add_generation_prompt: false``).
    continue_final_message: bool = False
    #: Offered to the model through its chat template; a server with a tool-call parser
    #: (``--enable-auto-tool-choice``) parses its calls, one without refuses them.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    #: vLLM's: documents the chat template may ground the answer in (a RAG template's
    #: ``documents``, each a dict such as ``{"title": ..., "text": ...}``).
    documents: list[dict[str, Any]] | None = None
    #: vLLM's: a chat template of the request's own; refused, as vLLM refuses it without
    #: ``--trust-request-chat-template`` (the server renders the model's or --chat-template).
    chat_template: str | None = None
    parallel_tool_calls: bool = True
    #: vLLM's: the answer starts with the last message's content when that message has the
    #: answer's role (``continue_final_message``: the assistant text it continues).
    echo: bool = False
    #: vLLM's: the tokenizer's special tokens (a BOS) added to the rendered template, on top
    #: of those the template writes (off by default, as the template writes them).
    add_special_tokens: bool = False
    #: The server's ``--response-role``.
    _response_role: str = PrivateAttr(default="assistant")

    @property
    def answer_role(self) -> str:
        """The answer's role (vLLM's): the server's ``--response-role`` with a generation
        prompt, else the last message's."""
        return self._response_role if self.add_generation_prompt else self.messages[-1].role

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` added (where set and not set
        there already)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def echo_text(self) -> str:
        """What ``echo`` puts before the answer: the last message's text if it is the
        answer's role (:attr:`answer_role`), else nothing."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        return str(last.as_dict()["content"] or "") if last.role == self.answer_role else ""

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` (the model's sampling defaults) fill the
        fields it leaves unset."""
        if isinstance(self.tool_choice, str) and self.tool_choice not in (
                "none", "auto", "required"):
            raise ValueError(f"SamplingParams.tool_choice={self.tool_choice!r} is invalid: "
                             "expected 'none', 'auto', 'required' or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}")
        # ("required" with an empty tools list is "none", as OpenAI's and vLLM's)
        if self.tool_choice not in (None, "none", "auto") and not self.tools and not (
                self.tool_choice == "required" and self.tools == []):
            raise ValueError(f"SamplingParams.tool_choice={self.tool_choice!r} is invalid: "
                             "a forced call needs tools")
        if self.tools is not None and not all(  # (parameters: a JSON schema object, or none)
                isinstance(t, dict) and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)
                and isinstance(t["function"].get("parameters", {}), (dict, type(None)))
                for t in self.tools):
            raise ValueError("SamplingParams.tools is invalid: expected [{\"type\": "
                             "\"function\", \"function\": {\"name\": ..., \"parameters\": "
                             "{...}}}]")
        max_tokens = self._requested_max()
        if self.top_logprobs not in (None, 0) and not self.logprobs:  # (0: vLLM takes it)
            raise ValueError("SamplingParams.top_logprobs is invalid: needs logprobs=true")
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, k, defaults)

    def _requested_max(self) -> int | None:
        return (self.max_tokens if self.max_completion_tokens is None
                else self.max_completion_tokens)

    def structured_source(self) -> str | None:
        """The field the request's structured output came from; a forced call's (``tool_choice``
        ``"required"`` or named) is its tools' ``parameters`` schema: ``tools``."""
        source = super().structured_source()
        if source is None and self.tools and self.tool_choice not in (None, "none", "auto"):
            return "tools"
        return source

    def request_field(self, name: str) -> str:
        if name == "logprobs" and self.top_logprobs is not None:
            return "top_logprobs"  # (the chat request's logprobs is a bool; k is this field)
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return name


_STRUCTURED_KEYS = frozenset(field.name for field in dataclasses.fields(StructuredOutputsParams))
#: vLLM's older fields -> the ``StructuredOutputsParams`` field each sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "structural_tag": "structural_tag"}


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    """OpenAI's ``response_format`` (not ``text``) as a constraint."""
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("SamplingParams.response_format is invalid: json_schema needs "
                             "{\"name\": ..., \"schema\": {...}}")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":  # (vLLM's: the format itself is the tag)
        return StructuredOutputsParams(structural_tag=fmt)
    raise ValueError(f"SamplingParams.response_format={fmt!r} is invalid: expected type "
                     "text, json_object, json_schema or structural_tag")


def _unsupported(name: str, value: object, allowed: object) -> None:
    """Refuse a field this server does not implement rather than silently ignore it."""
    if value != allowed:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed!r} "
                         "(other values are not supported by this server)")


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


_PARAM = re.compile(r"SamplingParams\.(\w+)")


def value_error_param(message: str, body: Any = None) -> str | None:
    """The request's field a ``SamplingParams`` / ``LLMEngine.validate`` error is about (with
    ``body``: the field it came from, as a structured output's ``response_format`` or
    ``guided_*``, a chat request's ``top_logprobs`` or ``max_completion_tokens``)."""
    match = _PARAM.search(message)
    name = None
    if match:
        name = match.group(1)
        if name == "structured_outputs" and isinstance(body, _Request):
            name = body.structured_source() or name
    elif "prompt" in message:
        name = "prompt" if "max_tokens" not in message else "max_tokens"
    return body.request_field(name) if name and isinstance(body, _Request) else name
