"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: text in, text out.

A request's ``instructions`` and ``input`` (a string, or message items whose content is a
string or ``input_text`` / ``output_text`` / ``input_image`` parts, images for a
vision-language model as the chat route takes them) become chat messages through the model's
chat template; ``max_output_tokens``, ``temperature``, ``top_p`` and ``text.format``
(``json_schema``, ``json_object``: a structured output) map to the chat request's fields;
``top_logprobs`` (0 up to ``--max-logprobs``, 20 by default) or ``include:
["message.output_text.logprobs"]`` asks for the message text's logprobs (the chat route's,
on the ``output_text`` part and each streamed delta; which tokens the message's are:
:class:`~mrv2.entrypoints.responses_output.AnswerSplit`); ``include``'s other values are
taken (:data:`INCLUDABLE`), what is none of the API's is refused.
The answer is a ``response`` object whose ``output`` holds a ``message`` item (and, behind
``--reasoning-parser``, a ``reasoning`` item before it; gpt-oss's harmony messages, which may
come in any order, are an item per run of a kind in the order written, whole or streamed
alike); ``status`` is ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"`` when the answer was cut by the limit.
Streamed (``"stream": true``), it comes as the API's typed server-sent events:
``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
its text's deltas (``response.reasoning_text.delta`` or ``response.content_part.added`` then
``response.output_text.delta``) and their ``.done`` events, ``response.output_item.done``,
then ``response.completed`` (``response.incomplete`` for a cut answer). With the store on
(:mod:`mrv2.entrypoints.responses_store`) answers are kept and ``previous_response_id``
continues a conversation; without it that field is refused. ``reasoning.effort`` is the chat
template's ``reasoning_effort`` (gpt-oss); a reasoning ``summary`` is taken and ignored (no
summary is written), as vLLM's; ``background``, uploaded files and other input items are
refused by name. Function tools work as in chat
(``--tool-call-parser``, or a forced ``tool_choice``): the model's calls come back as
``function_call`` items (streamed whole when the answer ends), and ``function_call`` /
``function_call_output`` input items become the chat messages of an earlier call (on the
assistant message before it, if any: one turn) and its result; ``reasoning`` input items (an
earlier answer's output sent back) are the ``reasoning`` of the assistant message after them,
kept, as by the store, only for the turn under way: the reasoning before its calls, which
gpt-oss's harmony format renders back as the analysis before each call
(:mod:`mrv2.entrypoints.responses_context`). ``truncation: "auto"`` drops whole messages from
the conversation's beginning (after its system messages) until the prompt leaves room for the
answer; ``"disabled"``, the default, refuses a conversation too long for the context.

Here: the request (:class:`ResponsesRequest`) and the answer (:class:`ResponsesStream`). The
input items as chat messages: :mod:`mrv2.entrypoints.responses_input`; the answer's output
items and their events: :mod:`mrv2.entrypoints.responses_output`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request_inputs import check_cache_salt
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, ReasoningEffort, null_is_default
from mrv2.entrypoints.responses import Stream, drain
from mrv2.entrypoints.responses_context import (
    TemplateMessage,
    current_reasoning,
    cut,
    for_harmony,
    truncation_cuts,
)
from mrv2.entrypoints.responses_input import (
    add_items,
    chat_call,
    chat_response_format,
    chat_tool,
    chat_tool_choice,
    reasoning_text,
)
from mrv2.entrypoints.responses_output import AnswerSplit, OutputItems
from mrv2.entrypoints.responses_store import ResponseStore

__all__ = ["ResponsesRequest", "ResponsesStream"]

#: The ``include`` value that asks for the message text's logprobs.
LOGPROBS = "message.output_text.logprobs"
#: ``include``'s values, the API's: the logprobs are given; the others ask for what this
#: server's answers never hold (built-in tools' results, input images' URLs, encrypted
#: reasoning: the reasoning item is in plain text) and are taken, as vLLM takes them.
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content",
              "message.input_image.image_url", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs")
#: The chat request's fields that errors name, as the Responses API calls them.
RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "messages": "input", "prompt": "input"}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``' body (the fields mrv2 takes; others are ignored, those it
    cannot honour are refused)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None
    store: bool = True
    user: str | None = None
    #: vLLM's: only requests of the same salt share prefix-cache blocks (a non-empty string).
    cache_salt: str | None = None
    #: vLLM's: lower runs first under ``--scheduling-policy priority`` (0 under ``fcfs``).
    priority: int = 0
    #: The message text's logprobs, with this many top tokens a position (0 up to the
    #: engine's ``max_logprobs``, ``--max-logprobs``, which the engine checks: vLLM's protocol
    #: sets no bound of its own); with ``include: ["message.output_text.logprobs"]`` too
    #: (k = 0 when this is unset).
    top_logprobs: int | None = Field(default=None, ge=0)
    include: list[str] | None = None
    #: ``auto``: a conversation too long for the context loses its first items
    #: (:meth:`truncation_cuts`); ``disabled``: it is refused (a 400), as OpenAI's.
    truncation: Literal["auto", "disabled"] = "disabled"

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, value: str | None) -> str | None:
        return check_cache_salt(value)

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if name not in INCLUDABLE:
                raise ValueError(f"{name!r} is not an include value; allowed values are "
                                 f"{', '.join(INCLUDABLE)}")
        return value

    _null_is_the_default = field_validator("stream", "store", "background", "truncation",
                                           "parallel_tool_calls", mode="before")(null_is_default)

    def conversation(self, previous: list[dict[str, Any]] | None = None
                     ) -> list[dict[str, Any]]:
        """The chat messages of the conversation so far: ``previous`` (a stored response's)
        and this request's input, without its instructions."""
        messages = list(previous or [])
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            add_items(messages, self.input)
        return messages

    def truncation_cuts(self, previous: list[dict[str, Any]] | None = None) -> list[int]:
        """The ``drop`` values :meth:`as_chat` takes, fewest first (``truncation: "auto"``
        tries them: whole messages from the conversation's beginning)."""
        return truncation_cuts(self.conversation(previous))

    def as_chat(self, previous: list[dict[str, Any]] | None = None, harmony: bool = False,
                drop: int = 0) -> ChatCompletionRequest:
        """The chat request this one is (after the conversation ``previous``, a stored
        response's, when ``previous_response_id`` names one; ``drop``: without its first
        messages, one of :meth:`truncation_cuts`), its messages as gpt-oss's template reads
        them with ``harmony``; ValueError naming the field it cannot take."""
        reasoning = self.reasoning or {}
        effort = reasoning.get("effort")
        if self.background:
            raise ValueError("SamplingParams.background is invalid: this server does not "
                             "support it in the Responses API (it runs no responses in the "
                             "background)")
        # (vLLM's: effort is the chat template's reasoning_effort; a summary is taken and
        # ignored, as Codex CLI asks for one)
        efforts, summaries = get_args(ReasoningEffort), ("auto", "concise", "detailed")
        if effort is not None and effort not in efforts:
            raise ValueError(f"SamplingParams.reasoning is invalid: effort {effort!r} is none "
                             f"of {', '.join(map(repr, efforts))}")
        for key in ("summary", "generate_summary"):
            if reasoning.get(key) not in (None, *summaries):
                raise ValueError(f"SamplingParams.reasoning is invalid: {key} "
                                 f"{reasoning[key]!r} is none of "
                                 f"{', '.join(map(repr, summaries))}")
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        conversation = current_reasoning(self.conversation(previous))
        if drop:
            conversation = cut(conversation, drop)
        messages += for_harmony(conversation) if harmony else conversation
        if not messages:
            raise ValueError("SamplingParams.input is invalid: no message in it")
        fields: dict[str, Any] = {
            "messages": [TemplateMessage(**m) for m in messages], "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls, "reasoning_effort": effort,
            "cache_salt": self.cache_salt, "priority": self.priority}
        if self.top_logprobs is not None or LOGPROBS in (self.include or ()):
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            fields["tools"] = [chat_tool(t) for t in self.tools]
        # (without tools too: the chat request refuses a forced call of none, as OpenAI)
        fields["tool_choice"] = chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            fields["response_format"] = chat_response_format(fmt)
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


class ResponsesStream(Stream):
    """The chat path's outputs as a Responses API answer (one request, one choice)."""

    def __init__(self, *args: Any, request: ResponsesRequest,
                 store: ResponseStore | None = None,
                 conversation: list[dict[str, Any]] | None = None) -> None:
        super().__init__(*args)
        self.request = request
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        #: Where the answer is kept (with ``conversation``, its chat messages), if anywhere.
        self.store = store
        self.conversation = conversation or []

    def _keep(self, response: dict[str, Any]) -> dict[str, Any]:
        """Store the final ``response`` with its conversation (the input's chat messages and
        the answer's: one assistant message, its message items' texts joined by newlines as
        the chat route's content, its calls, its reasoning items' texts likewise as its
        ``reasoning``); returns it."""
        if self.store is not None:
            output = response["output"]
            texts = [i["content"][0]["text"] for i in output if i["type"] == "message"]
            answer: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            calls = [chat_call(i) for i in output if i["type"] == "function_call"]
            if calls:
                answer["tool_calls"] = calls
            thoughts = [t for i in output if i["type"] == "reasoning"
                        if (t := reasoning_text(i))]
            if thoughts:
                answer["reasoning"] = "\n".join(thoughts)
            self.store.put(response, [*self.conversation, answer])
        return response

    def _response(self, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None, reason: str | None = None) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output,
            "incomplete_details": {"reason": reason} if reason else None, "error": None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {}, "parallel_tool_calls": r.parallel_tool_calls,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "tool_choice": "auto" if r.tool_choice is None else r.tool_choice,
            "tools": r.tools or [], "store": self.store is not None,
            "previous_response_id": r.previous_response_id, "truncation": r.truncation,
            "text": r.text or {"format": {"type": "text"}}, "usage": usage}

    def _usage_of(self, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
        cached = sum(self.cached.values())
        return {"input_tokens": self.num_prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": self.num_prompt + output_tokens}

    def _split(self) -> AnswerSplit:
        return AnswerSplit(self.reasoning, self.tools, self.parallel_tool_calls,
                      self.params.logprobs)

    def _whole(self) -> dict[str, Any]:
        """The answer's output items as its stream gives them (its deltas split again as
        they came: the same items, in the order the model wrote them)."""
        answer = self.answers[self.req_ids[0]][0]
        out = answer.output(0)
        split, items = self._split(), OutputItems(self.response_id[5:], lambda kind, **data: "")
        start = 0
        for i, (text, size) in enumerate(zip(answer.text, answer.sizes, strict=True)):
            end = start + size
            final = i == len(answer.sizes) - 1  # (the answer is finished)
            runs, found, logprobs = split.feed(
                text, answer.token_ids[start:end],
                None if answer.logprobs is None else answer.logprobs[start:end], final)
            items.feed(runs, logprobs, found)
            start = end
        length = out.finish_reason == "length"  # (the answer, its message, incomplete)
        status = "incomplete" if length else "completed"
        output, _ = items.close(status)
        usage = self._usage_of(len(out.token_ids), split.reasoning_tokens)
        return self._keep(self._response(status, output, usage,
                                         "max_output_tokens" if length else None))

    async def events(self, sink: asyncio.Queue[RequestOutput | BaseException]
                     ) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **data: Any) -> str:
            body = {"type": kind, "sequence_number": next(sequence), **data}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        items = OutputItems(self.response_id[5:], event)
        split = self._split()
        tokens, reason = 0, None
        try:
            yield (event("response.created", response=self._response("in_progress", [], None))
                   + event("response.in_progress",
                           response=self._response("in_progress", [], None)))
            while self.unfinished:
                got = await drain(sink)
                text = ""
                for item in got:
                    if isinstance(item, BaseException):
                        yield text + event("error", code="server_error", message=str(item),
                                           param=None)
                        return
                    for c in item.outputs:
                        tokens += len(c.token_ids)
                        runs, found, logprobs = split.feed(
                            c.text, c.token_ids, c.logprobs, bool(c.finish_reason))
                        text += items.feed(runs, logprobs, found)
                        reason = c.finish_reason or reason
                    if item.finished:
                        self.unfinished.discard(item.request_id)
                        self.cached[item.request_id] = item.num_cached_tokens
                if text:
                    yield text
            length = reason == "length"
            status = "incomplete" if length else "completed"
            output, closing = items.close(status)
            yield closing + event(
                f"response.{status}", response=self._keep(self._response(
                    status, output, self._usage_of(tokens, split.reasoning_tokens),
                    "max_output_tokens" if length else None)))
        finally:
            self.abort_rest()


