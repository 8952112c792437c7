"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: text in, text out.

A request's ``instructions`` and ``input`` (a string, or message items whose content is a
string or ``input_text`` / ``output_text`` / ``input_image`` parts, images for a
vision-language model as the chat route takes them) become chat messages through the model's
chat template; ``max_output_tokens``, ``temperature``, ``top_p`` and ``text.format``
(``json_schema``, ``json_object``: a structured output) map to the chat request's fields;
``top_logprobs`` (0 to 20) or ``include: ["message.output_text.logprobs"]`` asks for the
message text's logprobs (the chat route's, on the ``output_text`` part and each streamed
delta; which tokens the message's are: :class:`_Split`); ``include``'s other values are
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

from mrv2.engine.media import TEXT_PARTS, joined_text, part_text
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request_inputs import check_cache_salt
from mrv2.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ReasoningEffort,
    chat_logprobs,
    null_is_default,
)
from mrv2.entrypoints.reasoning import ReasoningStream
from mrv2.entrypoints.responses import Stream, drain
from mrv2.entrypoints.responses_context import (
    TemplateMessage,
    current_reasoning,
    cut,
    for_harmony,
    truncation_cuts,
)
from mrv2.entrypoints.responses_store import ResponseStore

__all__ = ["ResponsesRequest", "ResponsesStream"]

#: The content parts read as text (vLLM's chat_utils': ``refusal`` ones too, as an
#: assistant's output sent back may hold).
_TEXT_PARTS = tuple(TEXT_PARTS)
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
    #: The message text's logprobs, with this many top tokens a position (0 to 20); with
    #: ``include: ["message.output_text.logprobs"]`` too (k = 0 when this is unset).
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
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
            _add_items(messages, self.input)
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
            "cache_salt": self.cache_salt}
        if self.top_logprobs is not None or LOGPROBS in (self.include or ()):
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            fields["tools"] = [_chat_tool(t) for t in self.tools]
        # (without tools too: the chat request refuses a forced call of none, as OpenAI)
        fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            fields["response_format"] = _response_format(fmt)
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def _kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else type(item).__name__


def _add_items(messages: list[dict[str, Any]], items: list[Any]) -> None:
    """Input items onto the chat messages (:func:`_add_item`); a reasoning item (an earlier
    answer's, sent back as the API asks) is the ``reasoning`` of the assistant message the
    next item makes or adds to (a message of the assistant's, a function call; several
    joined by newlines), dropped where another role's message comes first."""
    thoughts: list[str] = []
    for item in items:
        if _kind(item) == "reasoning":
            text = _reasoning_text(item)
            if text:
                thoughts.append(text)
            continue
        _add_item(messages, item)
        last = messages[-1]
        if thoughts and last["role"] == "assistant" and _kind(item) in ("message",
                                                                         "function_call"):
            earlier = [last["reasoning"]] if last.get("reasoning") else []
            messages[-1] = {**last, "reasoning": "\n".join(earlier + thoughts)}  # (a copy)
        thoughts = []


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts' (else, as vLLM's, its summary's:
    another server's item), joined by newlines; encrypted content is not read."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(
            p.get("text"), str) and p["text"]] if isinstance(parts, list) else []
        if texts:
            return "\n".join(texts)
    return ""


def _chat_call(item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call`` item as a chat message's tool call."""
    return {"id": str(item.get("call_id", "")), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """An input item (not reasoning: :func:`_add_items`) onto the chat messages: a message, a
    function call of the model's (onto the assistant message before it, the same turn: its
    ``tool_calls``), a function call's output (a ``tool`` message)."""
    kind = _kind(item)
    if kind == "function_call":
        call = _chat_call(item)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # (a copy: it may be stored)
            messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return
    if kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": _call_output(item.get("output"))})
        return
    messages.append(_message(item))


def _call_output(output: Any) -> str:
    """A ``function_call_output``'s output as the tool message's text: a string, or the text
    of a list of text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        if not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in output):
            raise ValueError("SamplingParams.input is invalid: a function_call_output's "
                             "output must be a string or a list of input_text parts")
        return joined_text(output)
    return json.dumps(output)


def _chat_tool(tool: Any) -> dict[str, Any]:
    """A Responses API function tool (flat) as a chat one (``{"function": {...}}``)."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("name"), str):
        raise ValueError(f"SamplingParams.tools is invalid: {tool!r} (function tools only: "
                         "{\"type\": \"function\", \"name\": ..., \"parameters\": {...}})")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    """The Responses API's ``tool_choice`` as the chat request's."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValueError(f"SamplingParams.tool_choice={choice!r} is invalid: expected 'none', "
                     "'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValueError(f"SamplingParams.input is invalid: items of type {kind!r} are not "
                         "supported (messages, function_call, function_call_output and "
                         "reasoning)")
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"SamplingParams.input is invalid: role {role!r} (expected user, "
                         "assistant, system or developer)")
    if isinstance(content, list):
        kinds = {p.get("type") if isinstance(p, dict) else None for p in content}
        if not kinds <= {*_TEXT_PARTS, "input_image"}:
            raise ValueError(f"SamplingParams.input is invalid: content parts of types "
                             f"{sorted(str(k) for k in kinds - {*_TEXT_PARTS, 'input_image'})}"
                             " are not supported (text and image parts only)")
        if "input_image" in kinds:  # the chat path's parts: it loads the images
            content = [_image_part(p) if p["type"] == "input_image"
                       else {"type": "text", "text": part_text(p)} for p in content]
        else:
            content = joined_text(content)
    if not isinstance(content, (str, list)):
        raise ValueError("SamplingParams.input is invalid: a message's content must be a "
                         "string or a list of text and image parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _image_part(part: dict[str, Any]) -> dict[str, Any]:
    """An ``input_image`` part as the chat request's ``image_url`` part (a URL: a ``data:``
    URI, or a remote one the server fetches only if allowed)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise ValueError("SamplingParams.input is invalid: an input_image part needs an "
                         "image_url (uploaded files are not supported)")
    return {"type": "image_url", "image_url": {"url": url}}


def _response_format(fmt: Any) -> dict[str, Any]:
    """``text.format`` as the chat request's ``response_format``."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise ValueError(f"SamplingParams.text is invalid: format {fmt!r} (expected type "
                         "text, json_object or json_schema)")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {
        "name": fmt.get("name", "answer"), "schema": fmt.get("schema"),
        "strict": fmt.get("strict", False)}}


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
            calls = [_chat_call(i) for i in output if i["type"] == "function_call"]
            if calls:
                answer["tool_calls"] = calls
            thoughts = [t for i in output if i["type"] == "reasoning"
                        if (t := _reasoning_text(i))]
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

    def _split(self) -> _Split:
        return _Split(self.reasoning, self.tools, self.parallel_tool_calls,
                      self.params.logprobs)

    def _whole(self) -> dict[str, Any]:
        """The answer's output items as its stream gives them (its deltas split again as
        they came: the same items, in the order the model wrote them)."""
        answer = self.answers[self.req_ids[0]][0]
        out = answer.output(0)
        split, items = self._split(), _Items(self.response_id[5:], lambda kind, **data: "")
        calls: list[Any] = []
        start = 0
        for i, (text, size) in enumerate(zip(answer.text, answer.sizes, strict=True)):
            end = start + size
            final = i == len(answer.sizes) - 1  # (the answer is finished)
            runs, found, logprobs = split.feed(
                text, answer.token_ids[start:end],
                None if answer.logprobs is None else answer.logprobs[start:end], final)
            calls += found
            items.feed(runs, logprobs)
            start = end
        length = out.finish_reason == "length"  # (the answer, its message, incomplete)
        status = "incomplete" if length else "completed"
        output, _ = items.close(calls, status)
        usage = self._usage_of(len(out.token_ids), split.reasoning_tokens)
        return self._keep(self._response(status, output, usage,
                                         "max_output_tokens" if length else None))

    async def events(self, sink: asyncio.Queue[RequestOutput | BaseException]
                     ) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **data: Any) -> str:
            body = {"type": kind, "sequence_number": next(sequence), **data}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

        items = _Items(self.response_id[5:], event)
        split = self._split()
        calls: list[Any] = []
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
                        calls += found
                        text += items.feed(runs, logprobs)
                        reason = c.finish_reason or reason
                    if item.finished:
                        self.unfinished.discard(item.request_id)
                        self.cached[item.request_id] = item.num_cached_tokens
                if text:
                    yield text
            length = reason == "length"
            status = "incomplete" if length else "completed"
            output, closing = items.close(calls, status)
            yield closing + event(
                f"response.{status}", response=self._keep(self._response(
                    status, output, self._usage_of(tokens, split.reasoning_tokens),
                    "max_output_tokens" if length else None)))
        finally:
            self.abort_rest()


def _message_item(item_id: str, text: str, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


class _Split:
    """One answer's text deltas split as they come: into runs of reasoning
    (``--reasoning-parser``) and of the message's text, in the order the model wrote them
    (harmony's messages may come in any order), the message text's logprobs (``k``: the top
    tokens a position; None: not asked for) and, when the answer ends, tool calls.

    A token's logprob goes with the message text of its delta (the engine's output of a step);
    a delta that shows none (text held back as it may begin a tag, a character's first byte)
    holds its tokens for the next one that does, where it lies past the reasoning; the tokens
    of reasoning (its end tag included: gpt-oss's markers are tokens of their own) and of
    tool calls, and those still held when the answer ends (the end-of-sequence token), are in
    no message's logprobs."""

    def __init__(self, reasoning: str | None, tools: Any, parallel: bool,
                 k: int | None) -> None:
        self.reasoning = ReasoningStream(reasoning) if reasoning else None
        self.calling = tools.stream() if tools is not None else None
        self.parallel, self.k = parallel, k
        self.held_ids: list[int] = []
        self.held: list[Any] = []
        #: The reasoning's tokens so far: a delta's where all the text it shows is reasoning,
        #: or where it shows none in the reasoning (its tags, harmony's ``<|message|>`` and
        #: ``<|end|>`` around the analysis).
        self.reasoning_tokens = 0

    def _in_reasoning(self) -> bool:
        split = self.reasoning
        if split is None:
            return False
        if split.harmony is not None:
            return split.harmony.state == "body" and split.harmony.header.kind == "reasoning"
        return split.state == "reasoning"

    def feed(self, text: str, token_ids: Any, logprobs: Any, final: bool
             ) -> tuple[list[tuple[str, str]], list[Any], list[dict[str, Any]]]:
        """A delta's ``(runs, calls, the message text's logprobs)``: ``runs`` its
        ``("reasoning" | "content", text)`` pieces in order (``final``: the answer's last;
        the calls come then)."""
        split = self.reasoning
        harmony = split.harmony if split is not None else None
        past = split is None or (harmony is None and split.state == "content")
        was_reasoning = self._in_reasoning()
        if harmony is not None:  # (its pieces, in the order written)
            runs = [(p.kind, p.text) for p in harmony.feed(text, final)
                    if p.kind in ("reasoning", "content") and p.text]
        else:
            thought, content = split.feed(text, final) if split is not None else ("", text)
            runs = [r for r in (("reasoning", thought), ("content", content)) if r[1]]
        found: list[Any] = []
        if self.calling is not None:
            if self.calling.parser.harmony:
                said, found = self.calling.feed(text, final)
                if harmony is None:  # (else its content is the reasoning split's, in order)
                    runs = [r for r in runs if r[0] == "reasoning"] + [("content", said)]
            else:
                said, found = self.calling.feed(
                    "".join(t for kind, t in runs if kind == "content"), final)
                runs = [r for r in runs if r[0] == "reasoning"] + [("content", said)]
            runs = [r for r in runs if r[1]]
            found = found if self.parallel else found[:1]
        if (all(kind == "reasoning" for kind, _ in runs) and not found
                and (runs or was_reasoning or self._in_reasoning())):
            self.reasoning_tokens += len(token_ids)
        if self.k is None or logprobs is None:
            return runs, found, []
        ids, lps = self.held_ids + list(token_ids), self.held + list(logprobs)
        self.held_ids, self.held = [], []
        if any(kind == "content" for kind, _ in runs):
            return runs, found, chat_logprobs(lps, ids, self.k)["content"]
        if past and not (runs or found):
            self.held_ids, self.held = ids, lps
        return runs, found, []


def _call_item(item_id: str, call: Any, status: str, arguments: str | None = None
               ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "status": status, "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class _Items:
    """A streamed answer's output items as events: the reasoning item while its text comes,
    then the message (each opened at its first text and closed when the next opens or the
    answer ends; a message is opened at the end if no text came)."""

    def __init__(self, suffix: str, event: Any) -> None:
        self.suffix, self.event = suffix, event
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None  # the open item's: "reasoning" or "message"
        self.item_id = ""  # the open item's (a kind's second item on: its number after it)
        self.text: list[str] = []  # the open item's, joined when it closes
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        self.again = False  # the open item is its kind's second or later, no text yet

    def feed(self, runs: list[tuple[str, str]], logprobs: list[dict[str, Any]]) -> str:
        """A delta's runs of reasoning and message text (:meth:`_Split.feed`), in order; its
        logprobs go with its first run of message text."""
        out = ""
        for kind, text in runs:
            out += self._open("message" if kind == "content" else "reasoning")
            if self.again:  # (harmony's separator of a kind's messages: not in a new item)
                text, self.again = text.removeprefix("\n"), False
            if not text:
                continue
            self.text.append(text)
            if kind == "reasoning":
                out += self.event("response.reasoning_text.delta", item_id=self._id(),
                                  output_index=len(self.output), content_index=0,
                                  delta=text)
                continue
            self.logprobs += logprobs
            out += self.event("response.output_text.delta", item_id=self._id(),
                              output_index=len(self.output), content_index=0, delta=text,
                              logprobs=logprobs)
            logprobs = []
        return out

    def close(self, calls: list[Any], status: str = "completed"
              ) -> tuple[list[dict[str, Any]], str]:
        """The answer's output items, and the events that close them: the open item, then
        a function call item per call; a message item, empty if no content came, where there
        are no calls. The message item closed here has the answer's ``status``
        (``incomplete``: cut by ``max_output_tokens``)."""
        has_message = self.kind == "message" or any(i["type"] == "message"
                                                    for i in self.output)
        out = self._open("message") if not (has_message or calls) else ""
        out += self._close(status)
        for i, call in enumerate(calls):
            index, item_id = len(self.output), f"fc_{self.suffix}_{i}"
            item = _call_item(item_id, call, "completed")
            out += (self.event("response.output_item.added", output_index=index,
                               item=_call_item(item_id, call, "in_progress", ""))
                    + self.event("response.function_call_arguments.delta", item_id=item_id,
                                 output_index=index, delta=call.arguments)
                    + self.event("response.function_call_arguments.done", item_id=item_id,
                                 output_index=index, arguments=call.arguments)
                    + self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        return self.output, out

    def _id(self) -> str:
        return self.item_id

    def _open(self, kind: str) -> str:
        if self.kind == kind:
            return ""
        out = self._close()
        self.kind, self.text, self.logprobs = kind, [], []
        # (harmony's analysis after a preamble: a kind's item again, with an id of its own)
        again = sum(i["type"] == kind for i in self.output)
        self.again = again > 0
        self.item_id = (f"{'rs' if kind == 'reasoning' else 'msg'}_{self.suffix}"
                        + (f"_{again}" if again else ""))
        index = len(self.output)
        if kind == "reasoning":
            item = _reasoning_item(self._id(), "", "in_progress")
            item["content"] = []
            return out + self.event("response.output_item.added", output_index=index,
                                    item=item)
        item = _message_item(self._id(), "", "in_progress")
        item["content"] = []
        return (out + self.event("response.output_item.added", output_index=index, item=item)
                + self.event("response.content_part.added", item_id=self._id(),
                             output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [],
                                   "logprobs": []}))

    def _close(self, status: str = "completed") -> str:
        if self.kind is None:
            return ""
        index, item_id, text = len(self.output), self._id(), "".join(self.text)
        if self.kind == "reasoning":
            item = _reasoning_item(item_id, text, "completed")
            out = self.event("response.reasoning_text.done", item_id=item_id,
                             output_index=index, content_index=0, text=text)
        else:
            item = _message_item(item_id, text, status, self.logprobs)
            part = item["content"][0]
            out = (self.event("response.output_text.done", item_id=item_id,
                              output_index=index, content_index=0, text=text,
                              logprobs=self.logprobs)
                   + self.event("response.content_part.done", item_id=item_id,
                                output_index=index, content_index=0, part=part))
        out += self.event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.kind = None
        return out
