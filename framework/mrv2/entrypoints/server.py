"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine: an
:class:`LLMEngine` on an :class:`EngineThread` of this process, or a :class:`RemoteEngine`
whose engine steps in a process of its own (``mrv2 serve``'s default).

``create_app(engine)`` builds the app and its worker; ``mrv2 serve`` runs it
(:mod:`mrv2.entrypoints.server_run`).
Routes: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (each streams by
server-sent events), ``/v1/embeddings``, ``/v1/models``, ``/health``, ``/metrics``
(Prometheus text).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams, StructuredOutputsParams
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.engine import LLMEngine
from mrv2.engine.generation_defaults import max_tokens_limit
from mrv2.engine.media import split_chat_media
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request_inputs import truncation_room
from mrv2.engine.tokenizer import check_template_kwargs
from mrv2.entrypoints.dev_routes import add_dev_routes
from mrv2.entrypoints.engine_calls import dev_mode
from mrv2.entrypoints.engine_process import EngineProcess, RemoteEngine
from mrv2.entrypoints.engine_thread import EngineThread, QueueFullError
from mrv2.entrypoints.http_options import HTTPOptions
from mrv2.entrypoints.lora_modules import LoRAModules, model_cards, runtime_updating
from mrv2.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from mrv2.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_error_body,
    value_error_param,
)
from mrv2.entrypoints.openai_responses import RENAMED, ResponsesRequest, ResponsesStream
from mrv2.entrypoints.openai_scoring import add_pooling_routes
from mrv2.entrypoints.reasoning import (
    check_reasoning_parser,
    grammar_mark,
    keeps_special_tokens,
    prompt_reasoning,
)
from mrv2.entrypoints.responses import APIError, Echo, Stream
from mrv2.entrypoints.responses_store import STORE_ENV, store_from_env
from mrv2.entrypoints.stats_logger import StatsLogger, log_stats_forever
from mrv2.entrypoints.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCalling,
    forced_tool_choice,
    get_tool_parser,
)
from mrv2.entrypoints.whole_answers import (
    beam_answer_body,
    beam_search_through,
    unless_disconnected,
)

#: Default bound on a request's ``n`` (``mrv2 serve --max-n``); OpenAI's own API allows 128.
DEFAULT_MAX_N = 64
logger = logging.getLogger(__name__)


#: The routes ``--api-key`` leaves open: they read nothing of a request's and change nothing.
OPEN_ROUTES = frozenset({"/health", "/metrics", "/version", "/tokenize", "/detokenize"})


class _CheckKey:
    """``Authorization: Bearer KEY`` on every route but the informational ones
    (:data:`OPEN_ROUTES`: a Prometheus scrape of ``/metrics`` needs no key, as with vLLM's
    ``--api-key``). Unlike vLLM's, which guards ``/v1/*`` only, the model-serving routes
    outside ``/v1`` (``/pooling``, ``/classify``, ``/score``, ``/rerank``...) and the dev-mode
    routes (``/sleep``, ``/collective_rpc``...) keep the key. A plain ASGI middleware:
    Starlette's ``BaseHTTPMiddleware`` would hide the client's disconnect from the routes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # --root-path: uvicorn puts it in front
            path = path[len(root):]
        if scope["type"] == "http" and path not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # (no timing hint of the key)
                response = APIError(401, "invalid or missing API key (Authorization: Bearer "
                                    "KEY)", "authentication_error").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: LLMEngine | RemoteEngine,
               served_model_name: str | Sequence[str] | None = None,
               api_key: str | None = None, max_pending: int = 1024,
               max_n: int = DEFAULT_MAX_N, log_stats_interval: float | None = None,
               reasoning_parser: str | None = None,
               tool_call_parser: str | None = None,
               http: HTTPOptions | None = None,
               enable_prompt_tokens_details: bool = False,
               lora_modules: Sequence[LoRARequest] = (),
               trust_request_chat_template: bool = False) -> FastAPI:
    """The app; its worker (the engine thread, or the engine process's link) starts with the
    app and stops with it (``app.state.engine_thread``).

    The server holds at most ``max_pending`` sequences (a request counts ``n`` per prompt)
    and answers 503 past that; a request's ``n`` may be at most ``max_n`` (and never more than
    ``max_pending``, or it could never run). With ``log_stats_interval`` (seconds), a stats
    line every interval while the engine has work (:mod:`mrv2.entrypoints.stats_logger`).
    ``served_model_name``: the name requests give (default: the model's path), or several
    (vLLM's aliases): requests may give any, answers and metrics carry the first.
    ``reasoning_parser`` (:mod:`mrv2.entrypoints.reasoning`): chat answers carry the model's
    ``<think>`` text (gpt-oss: its ``analysis`` channel) as ``reasoning_content``.
    ``tool_call_parser``
    (:mod:`mrv2.entrypoints.tool_calls`): chat requests may offer ``tools``, and answers
    carry the model's calls as ``tool_calls``; without one, ``tools`` are refused. ``http``
    (:mod:`mrv2.entrypoints.http_options`): CORS and the docs pages (default: vLLM's, CORS
    for any origin; the root path and TLS are the server's, :func:`make_server`).
    ``enable_prompt_tokens_details``: usage carries ``prompt_tokens_details.cached_tokens``
    (the prompt tokens the prefix cache held), as vLLM's flag of that name.
    ``lora_modules`` (:mod:`mrv2.entrypoints.lora_modules`): LoRA adapters requests name in
    their ``model`` field (the engine built with ``enable_lora``), each checked here.
    ``trust_request_chat_template``: a chat request's (and chat /tokenize's) own
    ``chat_template`` is rendered instead of the model's, as vLLM's
    ``--trust-request-chat-template``; without it, such a request is a 400."""
    http = http or HTTPOptions()
    http.check()
    check_reasoning_parser(reasoning_parser)
    tool_parser = None if tool_call_parser is None else get_tool_parser(tool_call_parser)
    if max_n < 1 or max_pending < 1:
        raise ValueError(f"max_n={max_n}, max_pending={max_pending} are invalid: expected >= 1")
    if log_stats_interval is not None and not log_stats_interval > 0:
        raise ValueError(f"log_stats_interval={log_stats_interval}: expected > 0 seconds")
    max_n = min(max_n, max_pending)
    names = ([served_model_name] if isinstance(served_model_name, str)
             else list(served_model_name or ()))
    if not names:
        names = [str(engine.config.model.model or "mrv2")]
    model_name = names[0]
    adapters = LoRAModules(engine, lora_modules, names)
    stored = store_from_env()  # the Responses API's store (MRV2_ENABLE_RESPONSES_API_STORE)
    worker: EngineThread | EngineProcess
    if isinstance(engine, RemoteEngine):  # the engine's process reports its device's memory
        metrics = ServerMetrics(model_name, "cpu")
        worker = engine.process
        worker.max_pending = max_pending
        worker.bind(metrics)
    else:
        metrics = ServerMetrics(model_name, engine.runner.device)
        worker = EngineThread(engine, max_pending, metrics)
        listen = getattr(engine.runner, "add_failure_listener", None)
        if listen is not None:  # a tensor-parallel worker died: 503 from now on, then exit
            listen(worker.mark_fatal)
    tasks: list[asyncio.Task[None]] = []

    async def start_stats_lines() -> None:
        if log_stats_interval is not None:
            lines = StatsLogger(lambda: metrics.stats)
            tasks.append(asyncio.get_running_loop().create_task(
                log_stats_forever(lines, log_stats_interval)))

    async def stop_stats_lines() -> None:
        for task in tasks:
            task.cancel()

    app = FastAPI(title="mrv2", on_startup=[worker.start, start_stats_lines],
                  on_shutdown=[stop_stats_lines, worker.stop, metrics.close],
                  **http.fastapi_kwargs())
    if api_key is not None:
        app.add_middleware(_CheckKey, api_key=api_key)
    http.add_cors(app)  # outermost: preflights answered before the key is asked for
    app.state.engine_thread = worker
    app.state.model_name = model_name
    created = int(time.time())

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(Exception)
    async def on_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {error}", "server_error", None, 500),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if worker.fatal is None else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "mrv2",
            "root": model_name, "max_model_len": engine.max_model_len} for name in names]
            + model_cards(list(adapters.by_name.values()), model_name, created,
                          engine.max_model_len)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def json_object(request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
            raise APIError(400, f"the body is not valid JSON: {error}") from None
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        return data

    async def parse(request: Request, cls: type[Any]) -> Any:
        data = await json_object(request)
        try:
            body = cls.model_validate(data)
        except ValidationError as error:
            err = validation_error_body(error)["error"]
            raise APIError(400, err["message"], param=err["param"]) from None
        if (body.model is not None and body.model not in names
                and body.model not in adapters.by_name):
            raise APIError(404, f"the model {body.model!r} does not exist; this server has "
                           f"{', '.join(map(repr, [*names, *adapters.by_name]))}",
                           "not_found_error", "model")
        return body

    def lora_of(body: Any) -> LoRARequest | None:
        """The adapter the request's ``model`` names (None: the base model); a 404 if it was
        unloaded since :func:`parse` found it (never the base model's answer instead)."""
        if body.model is None or body.model in names:
            return None
        lora = adapters.get(body.model)
        if lora is None:
            raise APIError(404, f"the LoRA adapter {body.model!r} was unloaded",
                           "not_found_error", "model")
        return lora

    if runtime_updating():
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            """vLLM's: ``{"lora_name", "lora_path"}`` served from now on (checked first)."""
            data = await json_object(request)
            try:
                lora = await asyncio.to_thread(adapters.load, data.get("lora_name"),
                                               data.get("lora_path"))
            except ValueError as error:
                raise APIError(400, str(error), param=str(error).partition(":")[0]) from None
            return Response(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            """vLLM's: ``{"lora_name"}`` no longer served (its running requests finish)."""
            name = (await json_object(request)).get("lora_name")
            try:
                adapters.unload(name)
            except KeyError:
                raise APIError(404, f"the LoRA adapter {name!r} is not loaded",
                               "not_found_error", "lora_name") from None
            return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    #: An override's (or a generation config directory's) max_new_tokens: vLLM's limit on
    #: every request's max_tokens (:func:`~mrv2.engine.generation_defaults.max_tokens_limit`).
    limit = max_tokens_limit(engine.config.model.generation_config,
                             engine.config.model.override_generation_config,
                             engine.sampling_defaults)

    def field_error(error: ValueError, body: Any, params_only: bool = False) -> APIError:
        """A 400 naming the request's field ``error`` is about, its message led by that
        field's name where the message names another (a ``SamplingParams`` field the request
        calls otherwise); ``params_only``: only a ``SamplingParams`` message is led so."""
        message, param = str(error), value_error_param(str(error), body)
        if param is not None and f"SamplingParams.{param}" not in message and (
                not params_only or "SamplingParams." in message):
            message = f"{param}: {message}"  # (the request's name for the field)
        return APIError(400, message, param=param)

    def params_of(body: Any) -> SamplingParams:
        try:
            params: SamplingParams = body.sampling_params(engine.sampling_defaults)
            if params.max_tokens is not None and limit is not None and params.max_tokens > limit:
                params = dataclasses.replace(params, max_tokens=limit)  # (vLLM's: min of both)
        except ValueError as error:
            raise field_error(error, body) from None
        if (n := body.sequences(params)) > max_n:
            raise APIError(400, f"n={n} is invalid: this server allows 1 <= n <= "
                           f"{max_n} (mrv2 serve --max-n, --max-pending)", param="n")
        return params

    def room(body: Any, params: SamplingParams) -> int:
        """What ``truncate_prompt_tokens: -1`` keeps (vLLM's): the context less the request's
        max_tokens (a model default's none: the engine caps it at the context left), at most
        the longest prompt the engine takes (``max_model_len - 1``)."""
        own = 0 if body.max_tokens_from_model(engine.sampling_defaults) else params.max_tokens
        return truncation_room(engine.max_model_len, own)

    def validate(ids: list[int], params: SamplingParams, body: Any) -> None:
        if worker.unavailable is not None:  # (asleep: the engine would refuse it)
            raise APIError(503, worker.unavailable, "service_unavailable")
        try:
            engine.validate(ids, params, lora_of(body))
        except ValueError as error:  # (the engine's own "prompt + max_tokens = ...": as sent)
            raise field_error(error, body, params_only=True) from None
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

    def tokenizer() -> Any:
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token id lists",
                           param="prompt")
        return engine.tokenizer

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await parse(request, CompletionRequest)
        params = params_of(body)
        if (mark := grammar_mark(reasoning_parser)) and params.structured_outputs is not None:
            # as a chat request's, as vLLM's (whose grammar waits for the parser's end of the
            # reasoning on every request): the prompt tells the engine where the block stands
            params = dataclasses.replace(params, _reasoning=mark)
        try:
            prompts = body.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        n = body.sequences(params)
        if len(prompts) * n > max_pending:  # it could never run: not a 503 (retry)
            raise APIError(400, f"prompt: {len(prompts)} prompts x n={n} are "
                           f"{len(prompts) * n} sequences, more than this server ever "
                           f"holds at once ({max_pending}: mrv2 serve --max-pending); send "
                           "fewer prompts per request", param="prompt")
        encoded: list[tuple[list[int], str | None]] = []
        keep = room(body, params)  # (the same for every prompt of the request)
        for p in prompts:
            if isinstance(p, str):
                full = tokenizer().encode(p, body.add_special_tokens)
                ids = body.truncate(full, keep)
                encoded.append((ids, p if ids is full else None))  # (the text: untruncated)
            else:
                encoded.append((body.truncate(list(p), keep), None))
        for ids, _ in encoded:
            validate(ids, params, body)
        if body.use_beam_search:
            return await beam_answer(request, body, params, [ids for ids, _ in encoded],
                                     False)
        echo = None
        if body.echo:  # each prompt as given, or its ids' text
            tok = tokenizer()
            echo = Echo([text if text is not None else tok.decode(ids, False)
                         for ids, text in encoded],
                        lambda token: tok.decode([token], False), body.echo_only)
        lora = lora_of(body)
        return await _serve(request, worker, "cmpl", lora.lora_name if lora else model_name,
                            encoded, params, body, False,
                            prompt_tokens_details=enable_prompt_tokens_details, echo=echo,
                            lora=lora)

    async def chat_ids(messages: list[ChatMessage], add_generation_prompt: bool,
                       template_kwargs: dict[str, Any] | None, continue_final: bool = False,
                       tools: list[dict[str, Any]] | None = None,
                       documents: list[dict[str, Any]] | None = None,
                       own_template: str | None = None, add_special_tokens: bool = False
                       ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's token ids through the chat template (the tokenizer's special tokens
        added on top with ``add_special_tokens``), and its images' items; a template of the
        request's own (``own_template``) is rendered instead of the model's with
        ``trust_request_chat_template``, else a 400 (vLLM's ``--trust-request-chat-template``)."""
        if own_template is not None and not trust_request_chat_template:
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
        if any(m.has_media for m in messages):
            allow_remote = engine.config.multimodal.allow_remote_media
            try:  # decoding and preprocessing images is CPU work: off the event loop
                return await asyncio.to_thread(
                    _chat_with_media, engine, tokenizer(), [m.with_parts() for m in messages],
                    add_generation_prompt, allow_remote,
                    {**kwargs, "add_special_tokens": add_special_tokens})
            except (ValueError, TypeError) as error:
                raise APIError(400, str(error), param="messages") from None
        try:
            return tokenizer().apply_chat_template(
                [m.as_dict() for m in messages], add_generation_prompt,
                add_special_tokens=add_special_tokens, **kwargs), []
        except (ValueError, TypeError) as error:
            raise APIError(400, f"could not apply the chat template: {error}",
                           param="messages") from None

    async def beam_answer(request: Request, body: Any, params: SamplingParams,
                          prompts: list[list[int]], chat: bool,
                          reasoning: str | None = reasoning_parser) -> Response:
        """A request's answer by beam search (``use_beam_search``; ``n`` beams); stopped, its
        requests aborted, the moment the client leaves; a chat's read by ``reasoning``."""
        try:
            beams = body.beam_search_params(params, engine.max_model_len - max(
                len(p) for p in prompts))
        except ValueError as error:
            raise APIError(400, str(error), param=value_error_param(str(error))) from None
        lora = lora_of(body)
        outputs = await unless_disconnected(request, beam_search_through(
            worker, prompts, beams, engine.eos_token_ids, engine.max_model_len, lora,
            body.cache_salt))
        if outputs is None:
            return Response(status_code=499)  # (as Stream.collect: nobody reads it)
        return JSONResponse(beam_answer_body(outputs, prompts, engine.tokenizer,
                                             lora.lora_name if lora else model_name, chat,
                                             reasoning))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        return await run_chat(request, body)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API over the chat path (text in and out; see
        :mod:`mrv2.entrypoints.openai_responses`)."""
        body: ResponsesRequest = await parse(request, ResponsesRequest)
        previous = None
        if body.previous_response_id is not None:
            if stored is None:
                raise APIError(400, "previous_response_id: this server stores no responses "
                               f"(start it with {STORE_ENV}=1)", param="previous_response_id")
            record = stored.get(body.previous_response_id)
            if record is None:
                raise APIError(404, f"no stored response has the id "
                               f"{body.previous_response_id!r}", "not_found_error",
                               "previous_response_id")
            previous = record.messages
        # (gpt-oss: its template reads a call's analysis from the message's thinking)
        harmony = keeps_special_tokens(reasoning_parser) or bool(
            tool_parser is not None and tool_parser.harmony)
        try:
            chat_body = body.as_chat(previous, harmony)
        except ValueError as error:
            raise APIError(400, str(error), param=value_error_param(str(error), body)) from None
        except ValidationError as error:  # a message the chat request refuses
            raise APIError(400, f"input: {error.errors()[0]['msg']}", param="input") from None
        try:
            if body.truncation == "auto":
                chat_body = await truncated(body, previous, harmony, chat_body)
            keep = stored if body.store else None
            return await run_chat(request, chat_body, ResponsesStream, {
                "request": body, "store": keep,
                "conversation": body.conversation(previous) if keep is not None else None})
        except APIError as error:  # the chat request's field names, as this API calls them
            name = error.param or ""
            sent = RENAMED.get(name, name)
            if sent != name and error.message.startswith(f"{name}="):
                error.message = sent + error.message[len(name):]
            error.param = sent if error.param is not None else None
            raise

    add_pooling_routes(app, engine, worker, parse, lora_of, tokenizer, model_name, chat_ids)
    if dev_mode():
        add_dev_routes(app, worker, json_object)

    async def truncated(body: ResponsesRequest, previous: list[dict[str, Any]] | None,
                        harmony: bool, whole: ChatCompletionRequest) -> ChatCompletionRequest:
        """``truncation: "auto"``: the chat request of ``body`` (``whole``: all of its
        conversation) without the fewest first messages (:meth:`ResponsesRequest.
        truncation_cuts`) that leave its prompt room for the answer (what
        ``truncate_prompt_tokens: -1`` keeps). Where none does, the most cut: too long for
        the context even so, a 400 naming ``input``; else :func:`validate` names the
        ``max_output_tokens`` that leaves it no room. Fewer dropped never makes a prompt
        shorter: a binary search."""
        keep = room(whole, params_of(whole))

        async def size(drop: int) -> int:
            chat = whole if drop == 0 else body.as_chat(previous, harmony, drop)
            return len((await prompt_ids(chat))[0])

        cuts = body.truncation_cuts(previous)
        if await size(0) <= keep:
            return whole
        least = await size(cuts[-1])
        if least >= engine.max_model_len:
            raise APIError(400, f"input: too long for this model's context (max_model_len "
                           f"{engine.max_model_len}) even with truncation \"auto\": what it "
                           "keeps (the last message, the instructions and the system messages "
                           f"the conversation opens with) is a prompt of {least} tokens",
                           param="input")
        if least > keep:
            return body.as_chat(previous, harmony, cuts[-1])
        low, high = 1, len(cuts) - 1  # (cuts[high] fits, cuts[0] does not)
        while low < high:
            mid = (low + high) // 2
            if await size(cuts[mid]) <= keep:
                high = mid
            else:
                low = mid + 1
        return body.as_chat(previous, harmony, cuts[high])

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response (the store on: ``MRV2_ENABLE_RESPONSES_API_STORE=1``)."""
        record = stored.get(response_id) if stored is not None else None
        if record is None:
            raise APIError(404, f"no stored response has the id {response_id!r}",
                           "not_found_error", "response_id")
        return record.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        if stored is None or not stored.delete(response_id):
            raise APIError(404, f"no stored response has the id {response_id!r}",
                           "not_found_error", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def run_chat(request: Request, body: ChatCompletionRequest,
                       stream_cls: type[Stream] = Stream,
                       extra: dict[str, Any] | None = None) -> Response:
        params = params_of(body)
        forced = body.tools and body.tool_choice not in (None, "none", "auto")
        if body.tools and tool_parser is None and not forced and body.tool_choice != "none":
            raise APIError(400, "tools: this server parses no tool calls; start it with "
                           "--enable-auto-tool-choice --tool-call-parser NAME (one of "
                           f"{', '.join(TOOL_CALL_PARSERS)}), or force a call with "
                           "tool_choice", param="tools")
        calling = None
        if forced:  # "required" or named: a structured output (vLLM's way), read back as calls
            assert body.tools is not None and body.tool_choice is not None
            if params.structured_outputs is not None:
                raise APIError(400, "tool_choice: a forced call is a structured output, and "
                               "the request gives another (response_format, structured_outputs "
                               "or guided_*)", param="tool_choice")
            try:
                parser, schema = forced_tool_choice(body.tool_choice, body.tools,
                                                    body.parallel_tool_calls)
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
        if (mark := grammar_mark(reasoning_parser)) and params.structured_outputs is not None:
            # the grammar holds what follows the thinking block (vLLM's reasoning-aware way)
            params = dataclasses.replace(params, _reasoning=mark)
        ids, items = await prompt_ids(body)
        if items and body.truncate_prompt_tokens is not None:
            raise APIError(400, "truncate_prompt_tokens is not supported with images (it could "
                           "cut an image's rows)", param="truncate_prompt_tokens")
        ids = body.truncate(ids, room(body, params))
        validate(ids, params, body)
        reasoning = prompt_reasoning(  # (qwen3's thinking models open the block in the prompt)
            reasoning_parser, ids, lambda text: tokenizer().encode(text, False))
        if body.use_beam_search:
            # (a structured output, stop strings, biases...: refused with the params)
            for name, bad in (("stream", body.stream), ("logprobs", body.logprobs),
                              ("tools", bool(body.tools)), ("echo", body.echo)):
                if bad:
                    raise APIError(400, f"{name}: not with use_beam_search", param=name)
            return await beam_answer(request, body, params, [ids], True, reasoning)
        echo = Echo([body.echo_text()]) if body.echo else None
        lora = lora_of(body)
        return await _serve(request, worker, "chatcmpl", lora.lora_name if lora else model_name,
                            [(ids, None)], params, body, True, items, reasoning, calling,
                            enable_prompt_tokens_details, echo, stream_cls, extra, lora)

    async def prompt_ids(body: ChatCompletionRequest) -> tuple[list[int], list[MultiModalItem]]:
        """A chat request's prompt (:func:`chat_ids` of its fields)."""
        return await chat_ids(body.messages, body.add_generation_prompt,
                              body.template_kwargs(), body.continue_final_message,
                              body.tools, body.documents, body.chat_template,
                              body.add_special_tokens)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's: a ``prompt`` (with or without special tokens) or chat ``messages`` (with
        images, their placeholders expanded) as the token ids a request would send."""
        body: TokenizeRequest = await parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt (text) or messages (chat), not both or "
                           "neither", param="prompt")
        if body.prompt is not None:
            ids = tokenizer().encode(body.prompt, body.add_special_tokens is not False)
        else:
            assert body.messages is not None
            ids, _ = await chat_ids(body.messages, body.add_generation_prompt,
                                    body.chat_template_kwargs, body.continue_final_message,
                                    body.tools, own_template=body.chat_template,
                                    add_special_tokens=bool(body.add_special_tokens))
        strs = tokenizer().convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's: ``tokens`` back to text (special tokens kept)."""
        body: DetokenizeRequest = await parse(request, DetokenizeRequest)
        vocab = engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is not a token id of this model (0 <= id < "
                           f"{vocab})", param="tokens")
        return {"prompt": tokenizer().decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    return app


def _version() -> str:
    """The installed mrv2's version (``mrv2.__version__``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mrv2")
    except PackageNotFoundError:
        return "unknown"


def _chat_with_media(engine: LLMEngine | RemoteEngine, tokenizer: Any,
                     messages: list[dict[str, Any]], add_generation_prompt: bool,
                     allow_remote: bool, template_kwargs: dict[str, Any]
                     ) -> tuple[list[int], list[MultiModalItem]]:
    """Token ids and multimodal items of chat messages with image or audio parts (ValueError
    on bad input: the caller answers 400)."""
    template_messages, mm_data = split_chat_media(
        messages, allow_remote, engine.config.multimodal.limit_mm_per_prompt)
    ids = tokenizer.apply_chat_template(template_messages, add_generation_prompt,
                                        **template_kwargs)
    return engine.process_multimodal(ids, mm_data)


async def _serve(request: Request, worker: EngineThread | EngineProcess, kind: str, model: str,
                 encoded: list[tuple[list[int], str | None]], params: SamplingParams,
                 body: Any, chat: bool, mm_items: list[MultiModalItem] | None = None,
                 reasoning: str | None = None, tools: ToolCalling | None = None,
                 prompt_tokens_details: bool = False, echo: Echo | None = None,
                 stream_cls: type[Stream] = Stream, extra: dict[str, Any] | None = None,
                 lora: LoRARequest | None = None) -> Response:
    """Submit every prompt (with ``mm_items``: one chat prompt's images; through adapter
    ``lora``, if any); answer with one JSON body or an SSE stream."""
    loop = asyncio.get_running_loop()
    sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    base = f"{kind}-{uuid.uuid4().hex}"
    req_ids = [f"{base}-{i}" for i in range(len(encoded))]
    submitted: list[str] = []
    try:
        for req_id, (ids, text) in zip(req_ids, encoded, strict=True):
            await worker.admit(req_id, ids, params, text, sink, loop, mm_items, lora,
                               cache_salt=body.cache_salt)
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
    stream = stream_cls(worker, base, model, chat, params, body, req_ids, encoded, reasoning,
                        tools, getattr(body, "parallel_tool_calls", True),
                        prompt_tokens_details, echo, **(extra or {}))
    if body.stream:
        return StreamingResponse(stream.events(sink), media_type="text/event-stream")
    return await stream.collect(sink, request)
