"""The OpenAI server's answers: a request's outputs as one JSON body or as server-sent
events (:class:`Stream`), and the error every route raises (:class:`APIError`).

The server's requests ask for deltas (``RequestOutputKind.DELTA``), streamed or not, so each
output costs O(new tokens) however long the answer grows. A stream writes, in one write,
everything queued since its last one (a request's deltas folded into one), one choice a
chunk as OpenAI streams ``n > 1``; with ``--reasoning-parser`` a chat choice's text is split
into ``content`` and ``reasoning_content`` as it arrives (:mod:`mrv2.entrypoints.reasoning`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mrv2.contract.params import SamplingParams
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.entrypoints.engine_process import EngineProcess
from mrv2.entrypoints.engine_thread import EngineThread
from mrv2.entrypoints.openai_errors import error_body
from mrv2.entrypoints.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from mrv2.entrypoints.reasoning import ReasoningStream, split_reasoning
from mrv2.entrypoints.tool_calls import ToolCalling
from mrv2.entrypoints.tool_stream import ToolCallStream

__all__ = ["APIError", "Echo", "Stream", "disconnected", "drain"]


class APIError(Exception):
    """An error answer: the HTTP status and OpenAI's error JSON (message, type, param)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.status),
                            status_code=self.status)


@dataclass
class Echo:
    """``echo``: each prompt's text before its answers (a chat request's: the last message's
    text, or nothing), and with a completion's ``logprobs`` its tokens' (the request's
    prompt logprobs; the first token has none) before theirs."""

    texts: list[str]
    """Per prompt, in the request's order."""
    token_text: Callable[[int], str] | None = None
    """A token's text (a completion's first prompt token's, which has no logprobs entry to
    name it)."""
    only: bool = False
    """A completion's ``max_tokens: 0``: the prompt alone (its one generated token, which
    the usage counts as vLLM's does, is not shown)."""


class _Choice:
    """Streaming bookkeeping of one choice: what was sent already."""

    def __init__(self, index: int, reasoning: str | None = None,
                 tools: ToolCalling | None = None) -> None:
        self.index, self.offset, self.done, self.started = index, 0, False, False
        self.tokens = 0  # its tokens so far (continuous usage)
        #: The choice's ``--reasoning-parser`` split, as its text arrives (chat only).
        self.reasoning = ReasoningStream(reasoning) if reasoning else None
        #: Its tool calls' split (a chat request with tools).
        self.tool_calls = (ToolCallStream(tools.parser, tools.tools) if tools is not None
                           else None)


class _Answer:
    """A choice's answer gathered from its deltas, its text joined once at the end (folding
    each delta into one output would copy the answer so far every step)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[Any] | None = None
        self.last: CompletionOutput | None = None
        #: Each delta's token count (beside its text in :attr:`text`): the deltas replayed.
        self.sizes: list[int] = []

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.sizes.append(len(delta.token_ids))
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.last = delta

    def output(self, index: int) -> CompletionOutput:
        last = self.last
        assert last is not None
        return CompletionOutput(index, "".join(self.text), self.token_ids, last.finish_reason,
                                last.stop_reason, last.cumulative_logprob, self.logprobs)


class Stream:
    """Turns RequestOutputs of one HTTP request into OpenAI chunks or a final body."""

    def __init__(self, worker: EngineThread | EngineProcess, base: str, model: str, chat: bool,
                 params: SamplingParams, body: Any, req_ids: list[str],
                 encoded: list[tuple[list[int], str | None]],
                 reasoning: str | None = None, tools: ToolCalling | None = None,
                 parallel_tool_calls: bool = True, prompt_tokens_details: bool = False,
                 echo: Echo | None = None) -> None:
        self.worker, self.base, self.model, self.chat = worker, base, model, chat
        self.reasoning = reasoning if chat else None
        #: Parse the answers' tool calls (``--tool-call-parser`` and the request's tools);
        #: ``parallel_tool_calls`` false keeps the first call only.
        self.tools = tools if chat else None
        self.parallel_tool_calls = parallel_tool_calls
        self.params, self.body, self.req_ids = params, body, req_ids
        self.order = {r: i for i, r in enumerate(req_ids)}
        self.encoded, self.echo = encoded, echo if not chat else None
        #: chat's ``echo``: the last message's text, before the answer's content
        self.chat_echo = echo.texts[0] if chat and echo is not None else ""
        #: a chat answer's role (``--response-role``, or the last message's without a
        #: generation prompt)
        self.role = str(getattr(body, "answer_role", "assistant"))
        #: request id -> its prompt logprobs (they come with its first output)
        self.prompt_lps: dict[str, list[Any] | None] = {}
        self.num_prompt = sum(len(ids) for ids, _ in encoded)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.unfinished = set(req_ids)
        #: (not streamed) request id -> choice index -> its answer so far
        self.answers: dict[str, dict[int, _Answer]] = {}
        self.choices: dict[tuple[str, int], _Choice] = {}
        #: ``usage.prompt_tokens_details.cached_tokens`` (vLLM's
        #: ``--enable-prompt-tokens-details``): the prompts' tokens found in the prefix cache.
        self.prompt_tokens_details = prompt_tokens_details
        self.cached: dict[str, int] = {}

    def _index(self, req_id: str, i: int) -> int:
        return self.order[req_id] * self.params.n + i

    def _logprobs(self, choice: Any, state: _Choice | None, req_id: str,
                  first: bool) -> Any:
        if self.params.logprobs is None or choice.logprobs is None:
            return None
        ids, lps = choice.token_ids, choice.logprobs
        as_ids = bool(getattr(self.body, "return_tokens_as_token_ids", False))
        if self.chat:
            return chat_logprobs(lps, ids, self.params.logprobs, as_ids)
        echo = self.echo
        if echo is not None and echo.only:
            ids, lps = [], []
        if first and echo is not None:  # the prompt's tokens first
            prompt = self.prompt_lps.get(req_id) or []
            ids = self.encoded[self.order[req_id]][0] + ids
            lps = prompt + lps
        body, end = completion_logprobs(lps, ids, state.offset if state else 0,
                                        echo.token_text if echo is not None else None, as_ids,
                                        self.params.logprobs)
        if state is not None:
            state.offset = end
        return body

    def _prompt_fields(self, req_id: str, first: bool, text: str) -> tuple[str, Any]:
        """A choice's text with the echoed prompt before it (its first part only), and its
        ``prompt_logprobs`` (None: not asked for, or not its first part)."""
        if self.echo is not None and self.echo.only:
            text = ""
        if not first:
            return text, None
        if self.echo is not None:
            text = self.echo.texts[self.order[req_id]] + text
        if self.params.prompt_logprobs is None:
            return text, None
        return text, prompt_logprobs_body(self.prompt_lps.get(req_id))

    def _usage(self, completion: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": self.num_prompt,
                                 "completion_tokens": completion,
                                 "total_tokens": self.num_prompt + completion}
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached.values())}
        return usage

    def abort_rest(self) -> None:
        for req_id in self.unfinished:
            self.worker.abort(req_id)

    async def collect(self, sink: asyncio.Queue[RequestOutput | BaseException],
                      request: Request) -> Response:
        """Wait for every request to finish (abort them all the moment the client leaves),
        then answer with one body."""
        left = await self._gather(sink, request)
        return left if left is not None else JSONResponse(self._whole())

    async def _gather(self, sink: asyncio.Queue[RequestOutput | BaseException],
                      request: Request) -> Response | None:
        """Every request's outputs into :attr:`answers` until all finished; the 499 answer
        when the client left first."""
        gone = asyncio.ensure_future(disconnected(request))
        item_task: asyncio.Future[RequestOutput | BaseException] | None = None
        try:
            while self.unfinished:
                item_task = item_task or asyncio.ensure_future(sink.get())
                await asyncio.wait((item_task, gone), return_when=asyncio.FIRST_COMPLETED)
                if not item_task.done():  # the client went away
                    return Response(status_code=499)
                item, item_task = item_task.result(), None
                if isinstance(item, BaseException):
                    raise APIError(500, str(item), "server_error")
                if item.prompt_logprobs is not None:
                    self.prompt_lps[item.request_id] = item.prompt_logprobs
                answers = self.answers.setdefault(item.request_id, {})
                for c in item.outputs:
                    answers.setdefault(c.index, _Answer()).add(c)
                if item.finished:
                    self.unfinished.discard(item.request_id)
                    self.cached[item.request_id] = item.num_cached_tokens
        finally:
            for task in (gone, item_task):
                if task is not None:
                    task.cancel()
            self.abort_rest()
        return None

    def _whole(self) -> dict[str, Any]:
        """The finished answer's body (chat or text completion)."""
        choices, completion = [], 0
        for req_id in self.req_ids:
            answers = self.answers[req_id]
            for out in (answers[i].output(i) for i in sorted(answers)):
                completion += len(out.token_ids)
                choice: dict[str, Any] = {"index": self._index(req_id, out.index),
                                          "finish_reason": out.finish_reason,
                                          "stop_reason": out.stop_reason,
                                          "logprobs": self._logprobs(out, None, req_id, True)}
                text, prompt_lps = self._prompt_fields(req_id, True, out.text)
                if self.chat:
                    choice["message"] = self._message(text, choice)
                else:
                    choice["text"] = text
                    if prompt_lps is not None:
                        choice["prompt_logprobs"] = prompt_lps
                    if self._token_ids:
                        choice["prompt_token_ids"] = self.encoded[self.order[req_id]][0]
                if self._token_ids:
                    choice["token_ids"] = list(out.token_ids)
                choices.append(choice)
        answer = {"id": self.base, "object": self.object, "created": self.created,
                  "model": self.model, "choices": choices, "usage": self._usage(completion)}
        if self.chat and self.params.prompt_logprobs is not None:  # (vLLM's: one prompt)
            answer["prompt_logprobs"] = prompt_logprobs_body(self.prompt_lps.get(self.req_ids[0]))
        if self.chat and self._token_ids:
            answer["prompt_token_ids"] = self.encoded[0][0]
        return answer

    @property
    def _token_ids(self) -> bool:
        """vLLM's ``return_token_ids``."""
        return bool(getattr(self.body, "return_token_ids", False))

    def _message(self, text: str, choice: dict[str, Any]) -> dict[str, Any]:
        """A finished chat choice's message: its text split into reasoning and content, and
        its tool calls parsed out (the choice then finishes with ``tool_calls``); ``echo``'s
        text before the content."""
        message = self._parsed_message(text, choice)
        if self.chat_echo:
            message["content"] = self.chat_echo + (message["content"] or "")
        return message

    def _parsed_message(self, text: str, choice: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.reasoning:
            message["reasoning_content"], message["content"] = split_reasoning(
                self.reasoning, text)
        if self.tools is not None:
            harmony = self.tools.parser.harmony  # (it reads the whole text, markers and all)
            content, calls = self.tools.parse(text if harmony else message["content"] or "")
            if harmony:
                message["content"] = content
            if calls:
                calls = calls if self.parallel_tool_calls else calls[:1]
                message["content"] = content
                message["tool_calls"] = [call.as_dict() for call in calls]
                if not self.tools.parser.named:  # (a named tool_choice's: "stop", OpenAI's)
                    choice["finish_reason"] = "tool_calls"
        return message

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None,
               prompt_token_ids: list[int] | None = None) -> str:
        chunk: dict[str, Any] = {"id": self.base, "created": self.created,
                                 "model": self.model, "choices": choices,
                                 "object": "chat.completion.chunk" if self.chat
                                 else "text_completion"}
        if usage is not None:
            chunk["usage"] = usage
        if prompt_token_ids is not None:  # (return_token_ids: a chat stream's first chunk)
            chunk["prompt_token_ids"] = prompt_token_ids
        return f"data: {json.dumps(chunk)}\n\n"

    async def events(self, sink: asyncio.Queue[RequestOutput | BaseException]
                     ) -> AsyncIterator[str]:
        completion = 0
        try:
            # one choice a chunk, as OpenAI streams n > 1 (clients read choices[0])
            if self.chat:
                yield "".join(self._chunk([{"index": self._index(r, i), "logprobs": None,
                                            "finish_reason": None,
                                            "delta": {"role": self.role, "content": ""}}],
                                          self._running_usage(r, 0),
                                          self.encoded[0][0] if self._token_ids and not (
                                              j or i) else None)
                              for j, r in enumerate(self.req_ids)
                              for i in range(self.params.n))
                if self.chat_echo:  # echo: the last message's text first, as vLLM's
                    yield "".join(self._chunk([{"index": self._index(r, i), "logprobs": None,
                                                "finish_reason": None,
                                                "delta": {"content": self.chat_echo}}],
                                              self._running_usage(r, 0))
                                  for r in self.req_ids for i in range(self.params.n))
            while self.unfinished:
                # Everything queued since the last write, in one write: a request's deltas
                # fold into one (a loop that falls behind sends a few tokens a chunk, not a
                # chunk a token, as vLLM's output collector merges). One send a request a
                # step at most.
                items = await drain(sink)
                latest: dict[str, RequestOutput] = {}
                error = None
                for item in items:
                    if isinstance(item, BaseException):
                        error = item
                        break
                    if item.prompt_logprobs is not None:
                        self.prompt_lps[item.request_id] = item.prompt_logprobs
                    earlier = latest.get(item.request_id)
                    if earlier is None:
                        latest[item.request_id] = item
                    else:
                        earlier.add(item)
                text = ""
                for output in latest.values():
                    choices = self._deltas(output)
                    completion += sum(len(o.token_ids) for o in output.outputs)
                    if output.finished:
                        self.unfinished.discard(output.request_id)
                        self.cached[output.request_id] = output.num_cached_tokens
                    text += "".join(self._chunk([choice], usage) for choice, usage in choices)
                if error is not None:
                    yield text + f"data: {json.dumps(error_body(str(error), 'server_error'))}\n\n"
                    break
                if text:
                    yield text
            if self.body.include_usage:
                yield self._chunk([], self._usage(completion))
            yield "data: [DONE]\n\n"
        finally:
            self.abort_rest()  # the client went away (or an error): stop its requests

    def _running_usage(self, req_id: str, tokens: int) -> dict[str, Any] | None:
        """A chunk's usage under ``continuous_usage_stats``: its prompt's tokens and its
        choice's so far (None: not asked for)."""
        if not self.body.continuous_usage:
            return None
        prompt = len(self.encoded[self.order[req_id]][0])
        return {"prompt_tokens": prompt, "completion_tokens": tokens,
                "total_tokens": prompt + tokens}

    def _deltas(self, item: RequestOutput) -> list[tuple[dict[str, Any], Any]]:
        """Each choice's next chunk, with its usage so far (continuous usage, else None)."""
        choices = []
        for out in item.outputs:  # (a delta: the choices with news, by their own index)
            key = (item.request_id, out.index)
            state = self.choices.setdefault(key, _Choice(self._index(item.request_id,
                                                                     out.index),
                                                         self.reasoning, self.tools))
            if state.done or not (out.token_ids or out.finish_reason):
                continue
            first, state.started = not state.started, True
            state.tokens += len(out.token_ids)
            text, prompt_lps = self._prompt_fields(item.request_id, first, out.text)
            choice: dict[str, Any] = {"index": state.index,
                                      "logprobs": self._logprobs(out, state, item.request_id,
                                                                 first),
                                      "finish_reason": out.finish_reason}
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            if self._token_ids:
                if first and not self.chat:
                    choice["prompt_token_ids"] = self.encoded[self.order[item.request_id]][0]
                choice["token_ids"] = list(out.token_ids)
            if out.finish_reason:
                choice["stop_reason"] = out.stop_reason
                state.done = True
            if self.chat:
                choice["delta"] = self._delta(state, text, choice, bool(out.finish_reason))
            else:
                choice["text"] = text
            choices.append((choice, self._running_usage(item.request_id, state.tokens)))
        return choices


    def _delta(self, state: _Choice, text: str, choice: dict[str, Any], final: bool
               ) -> dict[str, Any]:
        """A chat choice's next delta: reasoning apart, content, and the next pieces of its
        tool calls (a choice whose answer has calls finishes with ``tool_calls``)."""
        delta: dict[str, Any] = {}
        whole = text
        if state.reasoning is not None:
            thought, text = state.reasoning.feed(text, final)
            if thought:
                delta["reasoning_content"] = thought
        if state.tool_calls is not None:
            text, pieces = state.tool_calls.feed(
                whole if state.tool_calls.parser.harmony else text, final)
            pieces = [p for p in pieces if self.parallel_tool_calls or p.index == 0]
            if pieces:
                delta["tool_calls"] = [piece.as_dict() for piece in pieces]
            if final and state.tool_calls.called:
                choice["finish_reason"] = "tool_calls"
        delta["content"] = text
        return delta


async def drain(sink: asyncio.Queue[RequestOutput | BaseException]
                ) -> list[RequestOutput | BaseException]:
    """Everything queued: at least one item (waiting for it), then whatever else is there."""
    items = [await sink.get()]
    while not sink.empty():
        items.append(sink.get_nowait())
    return items


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects. The body is read already, so the next ASGI
    message is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
