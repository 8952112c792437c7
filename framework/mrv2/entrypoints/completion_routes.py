"""OpenAI's text generation routes: ``POST /v1/completions`` (prompts as text or token ids,
or vLLM's ``prompt_embeds``) and ``POST /v1/chat/completions`` (messages through the chat
template, with tool calls and the reasoning parser); each answers with one body or streams by
server-sent events, or by beam search (``use_beam_search``). :func:`run_chat` is the chat
path, which the Responses API (:mod:`mrv2.entrypoints.responses_routes`) takes too."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from mrv2.contract.params import StructuredOutputsParams
from mrv2.contract.requests import MultiModalItem
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from mrv2.entrypoints.prompt_embeds_http import load_prompt_embeds
from mrv2.entrypoints.reasoning import PLUGINS as REASONING_PLUGINS
from mrv2.entrypoints.reasoning import (
    grammar_mark,
    keeps_special_tokens,
    prompt_reasoning,
    request_parser,
    structured_refusal,
)
from mrv2.entrypoints.responses import APIError, Echo, Stream
from mrv2.entrypoints.serving import Serving
from mrv2.entrypoints.tool_calls import PARSERS, ToolCalling, forced_tool_choice

__all__ = ["add_completion_routes", "run_chat"]


def add_completion_routes(app: FastAPI, serving: Serving) -> None:
    """Add ``/v1/completions`` and ``/v1/chat/completions`` to ``app``, over ``serving``'s
    engine and helpers."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await serving.parse(request, CompletionRequest)
        params = serving.params_of(body)
        serving.check_truncation(body, params)
        if ((mark := grammar_mark(serving.reasoning_parser))
                and params.structured_outputs is not None):
            # as a chat request's, as vLLM's (whose grammar waits for the parser's end of the
            # reasoning on every request): the prompt tells the engine where the block stands
            params = dataclasses.replace(params, _reasoning=mark)
        try:
            prompts = body.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        n, max_pending = body.sequences(params), serving.max_pending
        embeds = body.prompt_embeds
        total = len(prompts) + (len(embeds) if isinstance(embeds, list) else embeds is not None)
        if total * n > max_pending:  # it could never run: not a 503 (retry)
            raise APIError(400, f"prompt: {total} prompts x n={n} are "
                           f"{total * n} sequences, more than this server ever "
                           f"holds at once ({max_pending}: mrv2 serve --max-pending); send "
                           "fewer prompts per request", param="prompt")
        given = await _given_embeds(serving, body)  # (answered first, as vLLM's)
        encoded: list[tuple[list[int], str | None]] = [(ids, None) for ids, _ in given]
        keep = serving.room(body, params)  # (the same for every prompt of the request)
        for p in prompts:
            if isinstance(p, str):
                full = serving.tokenizer().encode(p, body.add_special_tokens)
                ids = body.truncate(full, keep)
                encoded.append((ids, p if ids is full else None))  # (the text: untruncated)
            else:
                encoded.append((body.truncate(list(p), keep), None))
        for ids, _ in encoded:
            serving.validate(ids, params, body)
        if body.use_beam_search:
            return await serving.beam_answer(request, body, params,
                                             [ids for ids, _ in encoded], False,
                                             serving.reasoning_parser)
        echo = None
        if body.echo:  # each prompt as given, or its ids' text
            tok = serving.tokenizer()
            echo = Echo([text if text is not None else tok.decode(ids, False)
                         for ids, text in encoded],
                        lambda token: tok.decode([token], False), body.echo_only)
        lora = serving.lora_of(body)
        items = ([[item] for _, item in given] + [[] for _ in prompts]) if given else None
        return await serving.serve(request, "cmpl",
                                   lora.lora_name if lora else serving.model_name,
                                   encoded, params, body, False,
                                   prompt_tokens_details=serving.prompt_tokens_details,
                                   echo=echo, lora=lora, prompt_items=items)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatCompletionRequest = await serving.parse(request, ChatCompletionRequest)
        return await run_chat(serving, request, body)


async def _given_embeds(serving: Serving, body: CompletionRequest
                        ) -> list[tuple[list[int], MultiModalItem]]:
    """The request's ``prompt_embeds`` (none: empty), loaded and checked off the event loop
    (decoding and hashing a large tensor takes a while); a 400 naming the field for a bad one,
    or one with what needs prompt tokens (echo, beam search, a truncation, prompt logprobs)."""
    if body.prompt_embeds is None:
        return []
    for name, bad in (("echo", body.echo), ("use_beam_search", body.use_beam_search),
                      ("truncate_prompt_tokens", body.truncate_prompt_tokens is not None),
                      ("prompt_logprobs", body.prompt_logprobs is not None)):
        if bad:
            raise APIError(400, f"{name}: not with prompt_embeds (a prompt given as "
                           "embeddings has no tokens)", param=name)
    try:
        return await asyncio.to_thread(load_prompt_embeds, body.prompt_embeds, serving.engine)
    except ValueError as error:
        raise APIError(400, str(error), param="prompt_embeds") from None


async def run_chat(serving: Serving, request: Request, body: ChatCompletionRequest,
                   stream_cls: type[Stream] = Stream,
                   extra: dict[str, Any] | None = None) -> Response:
    """A chat request's answer (``stream_cls``, given ``extra``: the answer's form, chat
    completions' by default): its tools (a forced call a structured output), the reasoning
    parser's marks, its prompt truncated and checked, then run or beam searched."""
    params = serving.params_of(body)
    serving.check_truncation(body, params)
    # (deepseek_v3, glm45...: the template's thinking switch says how the answer reads)
    kwargs = body.template_kwargs()
    tool_parser = serving.tool_parser
    reasoning_parser = request_parser(serving.reasoning_parser, kwargs)
    forced = body.tools and body.tool_choice not in (None, "none", "auto")
    if body.tools and tool_parser is None and not forced and body.tool_choice != "none":
        raise APIError(400, "tools: this server parses no tool calls; start it with "
                       "--enable-auto-tool-choice --tool-call-parser NAME (one of "
                       f"{', '.join(PARSERS)}), or force a call with "
                       "tool_choice", param="tools")
    calling = None
    if forced:  # "required" or named: a structured output (vLLM's way), read back as calls
        assert body.tools is not None and body.tool_choice is not None
        if params.structured_outputs is not None:
            raise APIError(400, "tool_choice: a forced call is a structured output, and "
                           "the request gives another (response_format, structured_outputs "
                           "or guided_*)", param="tool_choice")
        call_ids = None if tool_parser is None else tool_parser.forced_id or tool_parser.call_id
        try:
            parser, schema = forced_tool_choice(  # (ids: the server's parser's, vLLM's)
                body.tool_choice, body.tools, body.parallel_tool_calls, call_ids,
                sum(m.tool_call_count for m in body.messages))
        except ValueError as error:
            raise APIError(400, str(error), param="tool_choice") from None
        params = dataclasses.replace(params,
                                     structured_outputs=StructuredOutputsParams(json=schema))
        calling = ToolCalling(parser, body.tools)
    elif body.tools and body.tool_choice != "none" and tool_parser is not None:
        calling = ToolCalling(tool_parser, body.tools)
        if tool_parser.special_tokens:  # its markers are special tokens: keep them
            params = dataclasses.replace(params, skip_special_tokens=False)
    if keeps_special_tokens(reasoning_parser):  # (harmony's markers, likewise)
        params = dataclasses.replace(params, skip_special_tokens=False)
    if params.structured_outputs is not None and (
            refused := structured_refusal(reasoning_parser, kwargs)):
        raise APIError(400, refused, param=None if reasoning_parser in REASONING_PLUGINS
                       else "chat_template_kwargs")
    if (mark := grammar_mark(reasoning_parser)) and params.structured_outputs is not None:
        # the grammar holds what follows the thinking block (vLLM's reasoning-aware way)
        params = dataclasses.replace(params, _reasoning=mark)
    ids, items = await serving.prompt_ids(body)
    if items and body.truncate_prompt_tokens is not None:
        raise APIError(400, "truncate_prompt_tokens is not supported with images (it could "
                       "cut an image's rows)", param="truncate_prompt_tokens")
    ids = body.truncate(ids, serving.room(body, params))
    serving.validate(ids, params, body)
    reasoning = prompt_reasoning(  # (qwen3's thinking models open the block in the prompt)
        reasoning_parser, ids, lambda text: serving.tokenizer().encode(text, False))
    if body.use_beam_search:
        # (stop strings, biases...: refused with the params; a structured output holds the
        # beams)
        for name, bad in (("stream", body.stream), ("logprobs", body.logprobs),
                          ("tools", bool(body.tools)), ("echo", body.echo)):
            if bad:
                raise APIError(400, f"{name}: not with use_beam_search", param=name)
        return await serving.beam_answer(request, body, params, [ids], True, reasoning)
    echo = Echo([body.echo_text()]) if body.echo else None
    lora = serving.lora_of(body)
    return await serving.serve(request, "chatcmpl",
                               lora.lora_name if lora else serving.model_name,
                               [(ids, None)], params, body, True, items, reasoning, calling,
                               serving.prompt_tokens_details, echo, stream_cls, extra, lora)
