"""What the server's routes share (:class:`Serving`): the engine and its worker, the names
the server answers to, and the request helpers every route group uses: a JSON body parsed
and its ``model`` checked, a request's sampling parameters and prompt room checked against
the engine, chat messages through the chat template, a beam search's answer, and the
submission of a request's prompts answered as one body or an SSE stream.

:func:`mrv2.entrypoints.server.create_app` builds one and hands it to the route groups
(:mod:`mrv2.entrypoints.completion_routes`, :mod:`mrv2.entrypoints.responses_routes`...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.beam_search import BeamSearch
from mrv2.engine.engine import LLMEngine
from mrv2.engine.generation_defaults import max_tokens_limit
from mrv2.engine.media import split_chat_media
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request_inputs import check_priority, check_truncation, truncation_room
from mrv2.engine.structured_outputs import StructuredOutputs
from mrv2.engine.tokenizer import check_template_kwargs
from mrv2.entrypoints.content_format import log_content_format, template_in_use
from mrv2.entrypoints.engine_process import EngineProcess, RemoteEngine
from mrv2.entrypoints.engine_thread import EngineThread, QueueFullError
from mrv2.entrypoints.lora_modules import LoRAModules
from mrv2.entrypoints.openai_errors import validation_error_body
from mrv2.entrypoints.openai_messages import ChatMessage
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, value_error_param
from mrv2.entrypoints.reasoning import harmony_format
from mrv2.entrypoints.responses import APIError, Echo, Stream
from mrv2.entrypoints.responses_context import harmony_messages
from mrv2.entrypoints.serve_options import ServeOptions
from mrv2.entrypoints.tool_calls import ToolCalling, ToolParser
from mrv2.entrypoints.tracing import RequestTracer, warn_untraced
from mrv2.entrypoints.whole_answers import (
    beam_answer_body,
    beam_search_through,
    unless_disconnected,
)

__all__ = ["Serving"]


class Serving:
    """One app's engine, worker and settings (:func:`~mrv2.entrypoints.server.create_app`'s
    arguments, checked there), and the helpers its routes share; each raises an
    :class:`APIError` (the answer's status and message) for what it refuses."""

    def __init__(self, engine: LLMEngine | RemoteEngine, worker: EngineThread | EngineProcess,
                 names: list[str], adapters: LoRAModules, *, max_pending: int, max_n: int,
                 reasoning_parser: str | None, tool_parser: ToolParser | None,
                 prompt_tokens_details: bool, trust_request_chat_template: bool,
                 options: ServeOptions | None = None,
                 tracer: RequestTracer | None = None) -> None:
        self.engine, self.worker = engine, worker
        #: ``--otlp-traces-endpoint``'s: a span per finished generation request (or None)
        self.tracer = tracer
        #: ``mrv2 serve``'s answer flags (:mod:`~mrv2.entrypoints.serve_options`)
        self.options = options or ServeOptions()
        self._structured: StructuredOutputs | None = None
        self.names, self.model_name = names, names[0]
        self.adapters = adapters
        self.max_pending, self.max_n = max_pending, max_n
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser
        #: gpt-oss's harmony format (its reasoning parser or tool parser): a call's reasoning
        #: goes to its template as the message's thinking (:func:`harmony_messages`).
        self.harmony = harmony_format(reasoning_parser) or bool(
            tool_parser is not None and tool_parser.harmony)
        self.prompt_tokens_details = prompt_tokens_details
        self.trust_request_chat_template = trust_request_chat_template
        if self.options.chat_template_content_format == "auto" and engine.tokenizer is not None:
            log_content_format(engine.tokenizer.chat_template)  # (vLLM's line, once)
        #: An override's (or a generation config directory's) max_new_tokens: vLLM's limit on
        #: every request's max_tokens (:func:`~mrv2.engine.generation_defaults.max_tokens_limit`).
        self.limit = max_tokens_limit(engine.config.model.generation_config,
                                      engine.config.model.override_generation_config,
                                      engine.sampling_defaults)

    async def json_object(self, request: Request) -> dict[str, Any]:
        """The request's body, a JSON object (else a 400)."""
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
            raise APIError(400, f"the body is not valid JSON: {error}") from None
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        return data

    async def parse(self, request: Request, cls: type[Any]) -> Any:
        """The request's body as ``cls`` (a 400 naming the bad field), its ``model`` one this
        server serves (else a 404); its ``priority`` 0 unless the scheduling policy is
        ``"priority"`` (vLLM's 400), before any work."""
        data = await self.json_object(request)
        try:
            body = cls.model_validate(data)
        except ValidationError as error:
            err = validation_error_body(error)["error"]
            raise APIError(400, err["message"], param=err["param"]) from None
        names, adapters = self.names, self.adapters
        if (body.model is not None and body.model not in names
                and body.model not in adapters.by_name):
            raise APIError(404, f"the model {body.model!r} does not exist; this server has "
                           f"{', '.join(map(repr, [*names, *adapters.by_name]))}",
                           "not_found_error", "model")
        try:
            check_priority(getattr(body, "priority", 0), self.engine.config.scheduler.policy)
        except ValueError as error:
            raise APIError(400, str(error), param="priority") from None
        self._server_defaults(body)
        return body

    def _server_defaults(self, body: Any) -> None:
        """The server's flags where the request leaves them to it (vLLM's): the answer's
        role, token ids as logprobs' tokens, a stream's forced usage, the chat template's
        default variables (under the request's own)."""
        options = self.options
        if isinstance(body, ChatCompletionRequest):
            body._response_role = options.response_role
        if getattr(body, "return_tokens_as_token_ids", False) is None:
            body.return_tokens_as_token_ids = options.return_tokens_as_token_ids
        if options.enable_force_include_usage and hasattr(body, "_force_usage"):
            body._force_usage = True
        if options.default_chat_template_kwargs and hasattr(body, "chat_template_kwargs"):
            own = body.chat_template_kwargs
            if own is None or isinstance(own, dict):  # (else: chat_ids' 400 names it)
                body.chat_template_kwargs = {**options.default_chat_template_kwargs,
                                             **(own or {})}

    def lora_of(self, body: Any) -> LoRARequest | None:
        """The adapter the request's ``model`` names (None: the base model); a 404 if it was
        unloaded since :meth:`parse` found it (never the base model's answer instead)."""
        if body.model is None or body.model in self.names:
            return None
        lora = self.adapters.get(body.model)
        if lora is None:
            raise APIError(404, f"the LoRA adapter {body.model!r} was unloaded",
                           "not_found_error", "model")
        return lora

    def field_error(self, error: ValueError, body: Any, params_only: bool = False) -> APIError:
        """A 400 naming the request's field ``error`` is about, its message led by that
        field's name where the message names another (a ``SamplingParams`` field the request
        calls otherwise); ``params_only``: only a ``SamplingParams`` message is led so."""
        message, param = str(error), value_error_param(str(error), body)
        if param is not None and f"SamplingParams.{param}" not in message and (
                not params_only or "SamplingParams." in message):
            message = f"{param}: {message}"  # (the request's name for the field)
        return APIError(400, message, param=param)

    def params_of(self, body: Any) -> SamplingParams:
        """The request's sampling parameters (the model's defaults under them, max_tokens
        at most :attr:`limit`); its ``n`` at most ``max_n``."""
        limit = self.limit
        try:
            params: SamplingParams = body.sampling_params(self.engine.sampling_defaults)
            if params.max_tokens is not None and limit is not None and params.max_tokens > limit:
                params = dataclasses.replace(params, max_tokens=limit)  # (vLLM's: min of both)
        except ValueError as error:
            raise self.field_error(error, body) from None
        if (n := body.sequences(params)) > self.max_n:
            raise APIError(400, f"n={n} is invalid: this server allows 1 <= n <= "
                           f"{self.max_n} (mrv2 serve --max-n, --max-pending)", param="n")
        return params

    def room(self, body: Any, params: SamplingParams) -> int:
        """What ``truncate_prompt_tokens: -1`` keeps (vLLM's): the context less the request's
        max_tokens (a model default's none: the engine caps it at the context left), at most
        the longest prompt the engine takes (``max_model_len - 1``)."""
        engine = self.engine
        own = 0 if body.max_tokens_from_model(engine.sampling_defaults) else params.max_tokens
        return truncation_room(engine.max_model_len, own)

    def check_truncation(self, body: Any, params: SamplingParams) -> None:
        """vLLM's bound on a generation request's ``truncate_prompt_tokens``: at most the
        context less the request's own max_tokens (none, or a model default's: the context),
        else a 400 naming it, however short the prompt. A max_tokens above the context is
        left to :meth:`validate`'s 400 (vLLM refuses it first)."""
        engine = self.engine
        own = (0 if body.max_tokens_from_model(engine.sampling_defaults)
               else params.max_tokens or 0)
        if own > engine.max_model_len:
            return
        try:
            check_truncation(body.truncate_prompt_tokens, engine.max_model_len, own,
                             body.request_field("max_tokens"))
        except ValueError as error:
            raise APIError(400, str(error), param="truncate_prompt_tokens") from None

    def validate(self, ids: list[int], params: SamplingParams, body: Any) -> None:
        """A 503 while the engine takes no requests; a 400 for a prompt the engine refuses,
        or one whose max_tokens does not fit the context."""
        engine, worker = self.engine, self.worker
        if worker.unavailable is not None:  # (asleep: the engine would refuse it)
            raise APIError(503, worker.unavailable, "service_unavailable")
        try:
            engine.validate(ids, params, self.lora_of(body))
        except ValueError as error:  # (the engine's own "prompt + max_tokens = ...": as sent)
            raise self.field_error(error, body, params_only=True) from None
        limit, num = engine.max_model_len, len(ids)
        if body.max_tokens_from_model(engine.sampling_defaults):
            return  # the model's max_new_tokens: the engine caps it at the context left
        if params.max_tokens is not None and num + params.max_tokens > limit:
            name = body.request_field("max_tokens")  # (or the chat's max_completion_tokens)
            raise APIError(
                400, f"{name}={params.max_tokens} is too large: this model's maximum "
                f"context length is {limit} tokens and the prompt has {num} tokens "
                f"({params.max_tokens} > {limit} - {num}); ask for at most {limit - num}",
                param=name)

    def tokenizer(self, param: str = "prompt") -> Any:
        """The model's tokenizer (a 400 naming ``param`` when none loaded: the model has none,
        or ``--skip-tokenizer-init``; chat messages need its template)."""
        if self.engine.tokenizer is None:
            why = ("--skip-tokenizer-init loads no tokenizer"
                   if self.engine.config.model.skip_tokenizer_init
                   else "this model has no tokenizer")
            use = ("chat messages need the chat template" if param == "messages"
                   else "text prompts need a tokenizer")
            raise APIError(400, f"{use} and {why}: send /v1/completions prompts as token id "
                           "lists", param=param)
        return self.engine.tokenizer

    async def chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                       template_kwargs: dict[str, Any] | None, continue_final: bool = False,
                       tools: list[dict[str, Any]] | None = None,
                       documents: list[dict[str, Any]] | None = None,
                       own_template: str | None = None, add_special_tokens: bool = False
                       ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids through the chat template (the tokenizer's special tokens
        added on top with ``add_special_tokens``), and its images' items; a template of the
        request's own (``own_template``) is rendered instead of the model's with
        ``trust_request_chat_template``, else a 400 (vLLM's ``--trust-request-chat-template``)."""
        if own_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template: this server renders the model's chat template "
                           "(or mrv2 serve --chat-template), not one sent with the request "
                           "(unless started with --trust-request-chat-template)",
                           param="chat_template")
        try:
            kwargs = check_template_kwargs(template_kwargs)
        except ValueError as error:
            raise APIError(400, str(error), param="chat_template_kwargs") from None
        if continue_final:
            if add_generation_prompt:
                raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                               param="continue_final_message")
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = tools
        if documents:
            kwargs["documents"] = documents
        if own_template is not None:
            kwargs["chat_template"] = own_template
        if self.harmony:
            messages = harmony_messages(messages)  # (gpt-oss: a call's reasoning, its thinking)
        engine = self.engine
        if any(m.has_media for m in messages):
            allow_remote = engine.config.multimodal.allow_remote_media
            try:  # decoding and preprocessing images is CPU work: off the event loop
                return await asyncio.to_thread(
                    _chat_with_media, engine, self.tokenizer("messages"),
                    [m.with_parts() for m in messages], add_generation_prompt, allow_remote,
                    {**kwargs, "add_special_tokens": add_special_tokens})
            except (ValueError, TypeError) as error:
                raise APIError(400, str(error), param="messages") from None
        tokenizer = self.tokenizer("messages")
        template = (own_template if own_template is not None
                    else template_in_use(tokenizer.chat_template, bool(tools)))
        try:
            return tokenizer.apply_chat_template(
                self.options.content_parts([m.as_dict() for m in messages],
                                           [m.content for m in messages], template),
                add_generation_prompt,
                add_special_tokens=add_special_tokens, **kwargs), []
        except (ValueError, TypeError) as error:
            raise APIError(400, f"could not apply the chat template: {error}",
                           param="messages") from None

    async def prompt_ids(self, body: ChatCompletionRequest
                         ) -> tuple[list[int], list[MultiModalItem]]:
        """A chat request's prompt (:meth:`chat_ids` of its fields; no tools for
        ``tool_choice: "none"`` with ``--exclude-tools-when-tool-choice-none``)."""
        tools = body.tools
        if body.tool_choice == "none" and self.options.exclude_tools_when_tool_choice_none:
            tools = None
        return await self.chat_ids(body.messages, body.add_generation_prompt,
                                   body.template_kwargs(), body.continue_final_message,
                                   tools, body.documents, body.chat_template,
                                   body.add_special_tokens)

    async def beam_answer(self, request: Request, body: Any, params: SamplingParams,
                          prompts: list[list[int]], chat: bool, reasoning: str | None
                          ) -> Response:
        """A request's answer by beam search (``use_beam_search``; ``n`` beams); stopped, its
        requests aborted, the moment the client leaves; read by the reasoning parser
        ``reasoning`` (None: none)."""
        engine = self.engine
        try:
            beams = body.beam_search_params(params, engine.max_model_len - max(
                len(p) for p in prompts))
        except ValueError as error:
            raise APIError(400, str(error), param=value_error_param(str(error))) from None
        lora = self.lora_of(body)
        try:  # (a structured output's grammar, checked against the tokenizer here)
            search = BeamSearch(prompts, beams, engine.eos_token_ids, engine.max_model_len,
                                self._beam_grammars() if beams.structured_outputs else None)
        except ValueError as error:
            raise self.field_error(error, body) from None
        outputs = await unless_disconnected(request, beam_search_through(
            self.worker, search, lora, body.cache_salt, body.priority))
        if outputs is None:
            return Response(status_code=499)  # (as Stream.collect: nobody reads it)
        return JSONResponse(beam_answer_body(outputs, prompts, engine.tokenizer,
                                             lora.lora_name if lora else self.model_name, chat,
                                             reasoning, getattr(body, "answer_role",
                                                                "assistant")))

    def _beam_grammars(self) -> StructuredOutputs:
        """The grammar states of beam search's beams (:class:`StructuredOutputs` over the
        engine's tokenizer, this process's own: built at the first constrained search)."""
        if self._structured is None:
            engine = self.engine
            if engine.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a tokenizer; this "
                                 "model has none")
            self._structured = StructuredOutputs(engine.tokenizer.hf, engine.vocab_size,
                                                 sorted(engine.eos_token_ids))
        return self._structured

    async def serve(self, request: Request, kind: str, model: str,
                    encoded: list[tuple[list[int], str | None]], params: SamplingParams,
                    body: Any, chat: bool, mm_items: list[MultiModalItem] | None = None,
                    reasoning: str | None = None, tools: ToolCalling | None = None,
                    prompt_tokens_details: bool = False, echo: Echo | None = None,
                    stream_cls: type[Stream] = Stream, extra: dict[str, Any] | None = None,
                    lora: LoRARequest | None = None,
                    prompt_items: list[list[MultiModalItem]] | None = None) -> Response:
        """Submit every prompt (with ``mm_items``: one chat prompt's images, or
        ``prompt_items``: each prompt's items; through adapter ``lora``, if any); answer with
        one JSON body or an SSE stream."""
        worker = self.worker
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        base = f"{kind}-{uuid.uuid4().hex}"
        req_ids = [f"{base}-{i}" for i in range(len(encoded))]
        submitted: list[str] = []
        tracer, context = self.tracer, None
        if tracer is None:
            warn_untraced(request.headers)
        else:
            context = tracer.context_of(request.headers)
        try:
            for i, (req_id, (ids, text)) in enumerate(zip(req_ids, encoded, strict=True)):
                trace = None if tracer is None else tracer.request(req_id, model, params,
                                                                   context)
                items = prompt_items[i] if prompt_items is not None else mm_items
                await worker.admit(req_id, ids, params, text, sink, loop, items, lora,
                                   cache_salt=body.cache_salt, priority=body.priority,
                                   trace=trace)
                submitted.append(req_id)
        except QueueFullError as error:
            for req_id in submitted:
                worker.abort(req_id)
            raise APIError(503, str(error), "service_unavailable") from None
        except ValueError as error:  # the engine in its own process refused it
            for req_id in submitted:
                worker.abort(req_id)
            raise APIError(400, str(error), param=value_error_param(str(error), body)) from None
        except asyncio.CancelledError:  # the client left before the answer began
            for req_id in submitted:
                worker.abort(req_id)
            raise
        stream = stream_cls(worker, base, model, chat, params, body, req_ids, encoded,
                            reasoning, tools, getattr(body, "parallel_tool_calls", True),
                            prompt_tokens_details, echo, **(extra or {}))
        if body.stream:
            return StreamingResponse(stream.events(sink), media_type="text/event-stream")
        return await stream.collect(sink, request)


def _chat_with_media(engine: LLMEngine | RemoteEngine, tokenizer: Any,
                     messages: list[dict[str, Any]], add_generation_prompt: bool,
                     allow_remote: bool, template_kwargs: dict[str, Any]
                     ) -> tuple[list[int], list[MultiModalItem]]:
    """Token ids and multimodal items of chat messages with image or audio parts (ValueError
    on bad input: the caller answers 400)."""
    template_messages, mm_data = split_chat_media(
        messages, allow_remote, engine.config.multimodal.limit_mm_per_prompt,
        engine.config.multimodal.allowed_local_media_path)
    ids = tokenizer.apply_chat_template(template_messages, add_generation_prompt,
                                        **template_kwargs)
    return engine.process_multimodal(ids, mm_data)
