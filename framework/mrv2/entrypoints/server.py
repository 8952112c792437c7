"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine: an
:class:`LLMEngine` on an :class:`EngineThread` of this process, or a :class:`RemoteEngine`
whose engine steps in a process of its own (``mrv2 serve``'s default).

``create_app(engine)`` builds the app and its worker; ``mrv2 serve`` runs it
(:mod:`mrv2.entrypoints.server_run`).
Routes: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (each streams by
server-sent events), ``/v1/embeddings``, ``/v1/models``, ``/health``, ``/metrics``
(Prometheus text).

This module assembles the app: the engine's worker, the middleware, the error handlers and
the informational routes; the helpers the routes share are a :class:`~mrv2.entrypoints.
serving.Serving`, and each group of routes is added by a module of its own:
:mod:`~mrv2.entrypoints.completion_routes` (completions and chat),
:mod:`~mrv2.entrypoints.responses_routes` (the Responses API),
:mod:`~mrv2.entrypoints.openai_scoring` (embeddings, pooling, scores) and
:mod:`~mrv2.entrypoints.dev_routes` (``MRV2_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mrv2.contract.lora import LoRARequest
from mrv2.engine.engine import LLMEngine
from mrv2.entrypoints.completion_routes import add_completion_routes
from mrv2.entrypoints.dev_routes import add_dev_routes
from mrv2.entrypoints.engine_calls import dev_mode
from mrv2.entrypoints.engine_process import EngineProcess, RemoteEngine
from mrv2.entrypoints.engine_thread import EngineThread
from mrv2.entrypoints.http_options import HTTPOptions
from mrv2.entrypoints.lora_modules import LoRAModules, model_cards, runtime_updating
from mrv2.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from mrv2.entrypoints.openai_errors import error_body
from mrv2.entrypoints.openai_scoring import add_pooling_routes
from mrv2.entrypoints.openai_tokenize import DetokenizeRequest, TokenizeRequest
from mrv2.entrypoints.reasoning import check_reasoning_parser
from mrv2.entrypoints.responses import APIError
from mrv2.entrypoints.responses_routes import add_responses_routes
from mrv2.entrypoints.responses_store import store_from_env
from mrv2.entrypoints.serve_options import (
    LoadTracker,
    RequestIdHeader,
    ServeOptions,
    tokenizer_info,
)
from mrv2.entrypoints.serve_plugins import add_middleware, load_reasoning_parser_plugin
from mrv2.entrypoints.serving import Serving
from mrv2.entrypoints.stats_logger import StatsLogger, log_stats_forever
from mrv2.entrypoints.tool_calls import get_tool_parser
from mrv2.entrypoints.tracing import RequestTracer

#: Default bound on a request's ``n`` (``mrv2 serve --max-n``); OpenAI's own API allows 128.
DEFAULT_MAX_N = 64
logger = logging.getLogger(__name__)


#: The routes ``--api-key`` leaves open: they read nothing of a request's and change nothing.
OPEN_ROUTES = frozenset({"/health", "/metrics", "/version", "/tokenize", "/detokenize",
                         "/load", "/tokenizer_info"})


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
               trust_request_chat_template: bool = False,
               options: ServeOptions | None = None,
               middleware: Sequence[Any] = ()) -> FastAPI:
    """The app; its worker (the engine thread, or the engine process's link) starts with the
    app and stops with it (``app.state.engine_thread``).

    The server holds at most ``max_pending`` sequences (a request counts ``n`` per prompt)
    and answers 503 past that; a request's ``n`` may be at most ``max_n`` (and never more than
    ``max_pending``, or it could never run). With ``log_stats_interval`` (seconds), a stats
    line every interval while the engine has work (:mod:`mrv2.entrypoints.stats_logger`).
    ``served_model_name``: the name requests give (default: the model's path), or several
    (vLLM's aliases): requests may give any, answers and metrics carry the first.
    ``reasoning_parser`` (:mod:`mrv2.entrypoints.reasoning`; or the engine config's
    ``structured_outputs.reasoning_parser``, which may not differ; its
    ``reasoning_parser_plugin`` file is imported first): chat answers carry the
    model's ``<think>`` text (gpt-oss: its ``analysis`` channel) as ``reasoning_content``.
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
    ``--trust-request-chat-template``; without it, such a request is a 400.
    ``options`` (:mod:`mrv2.entrypoints.serve_options`): vLLM's frontend flags of the
    answers (the response role, forced usage, default template variables, request id
    headers, ``/load``, ``/tokenizer_info``, OpenTelemetry spans: ``app.state.tracer``).
    ``middleware``: ``--middleware``'s classes
    and functions (:mod:`mrv2.entrypoints.serve_plugins`), added outermost."""
    http = http or HTTPOptions()
    options = options or ServeOptions()
    http.check()
    structured = getattr(getattr(engine, "config", None), "structured_outputs", None)
    if structured is not None:  # (structured_outputs_config.reasoning_parser, vLLM's too)
        if structured.reasoning_parser_plugin:  # (its parsers, before the name is checked)
            load_reasoning_parser_plugin(structured.reasoning_parser_plugin)
        reasoning_parser = structured.server_reasoning_parser(reasoning_parser)
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

    tracer = None  # (--otlp-traces-endpoint: spans exported until the server stops)
    if options.otlp_traces_endpoint is not None:
        tracer = RequestTracer.start(options.otlp_traces_endpoint,
                                     options.collect_detailed_traces)
    app = FastAPI(title="mrv2", on_startup=[worker.start, start_stats_lines],
                  on_shutdown=[stop_stats_lines, worker.stop, metrics.close,
                               *([tracer.shutdown] if tracer is not None else [])],
                  **http.fastapi_kwargs())
    app.state.tracer = tracer
    load = [0]  # (--enable-server-load-tracking: the requests in flight, GET /load)
    if options.enable_server_load_tracking:
        app.add_middleware(LoadTracker, counter=load)
    if api_key is not None:
        app.add_middleware(_CheckKey, api_key=api_key)
    if options.enable_request_id_headers:  # (a 401 carries it too)
        app.add_middleware(RequestIdHeader)
    http.add_cors(app)  # preflights answered before the key is asked for
    add_middleware(app, middleware)  # (--middleware: outermost, as vLLM adds them last)
    app.state.engine_thread = worker
    app.state.model_name = model_name
    created = int(time.time())

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        if options.log_error_stack:
            logger.error("%s %s: %d %s", request.method, request.url.path, error.status,
                         error.message, exc_info=error)
        return error.response()

    @app.exception_handler(Exception)
    async def on_error(request: Request, error: Exception) -> JSONResponse:
        if options.log_error_stack:
            logger.error("%s %s: internal error", request.method, request.url.path,
                         exc_info=error)
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

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        """vLLM's: the generation and pooling requests in flight (always 0 without
        ``--enable-server-load-tracking``)."""
        return {"server_load": load[0]}

    if options.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict[str, Any]:
            """vLLM's: the tokenizer's settings and the chat template."""
            tok = tokenizer()
            return tokenizer_info(tok.hf, tok.chat_template)

    serving = Serving(engine, worker, names, adapters, max_pending=max_pending, max_n=max_n,
                      reasoning_parser=reasoning_parser, tool_parser=tool_parser,
                      prompt_tokens_details=enable_prompt_tokens_details,
                      trust_request_chat_template=trust_request_chat_template,
                      options=options, tracer=tracer)
    json_object, parse, tokenizer = serving.json_object, serving.parse, serving.tokenizer

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

    add_completion_routes(app, serving)
    add_responses_routes(app, serving, stored)
    add_pooling_routes(app, engine, worker, parse, serving.lora_of, tokenizer, model_name,
                       serving.chat_ids)
    if dev_mode():
        add_dev_routes(app, worker, json_object)

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
            ids, _ = await serving.chat_ids(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                body.continue_final_message, body.tools, own_template=body.chat_template,
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
