"""``mrv2 serve``'s flags of vLLM's frontend that change the server's answers, with vLLM's
names and meanings (:class:`ServeOptions`):

- ``--response-role ROLE`` (default ``assistant``): a chat answer's role when the request
  asks for a generation prompt (without one, the last message's role, as vLLM's).
- ``--return-tokens-as-token-ids``: logprobs name their tokens ``token_id:N`` unless the
  request's own ``return_tokens_as_token_ids`` says otherwise.
- ``--enable-force-include-usage``: every stream ends with its usage chunk, as though the
  request asked for ``stream_options.include_usage`` (whole answers always carry it).
- ``--default-chat-template-kwargs JSON``: a JSON object under each request's own
  ``chat_template_kwargs`` (the request's keys win).
- ``--chat-template-content-format auto|string|openai``: how a message's text content
  reaches the chat template: ``string`` (a text, the parts a line each) or ``openai`` (a
  list of ``{"type": "text", "text": ...}`` parts); ``auto``, vLLM's, ``openai`` for a
  template that loops over a message's content, else ``string``
  (:mod:`~mrv2.entrypoints.content_format`; messages with images or audio always pass their
  parts).
- ``--exclude-tools-when-tool-choice-none``: ``tool_choice: "none"`` leaves the tools out of
  the prompt (else the template still lists them, as vLLM's default).
- ``--enable-request-id-headers``: every answer carries ``X-Request-Id`` (the request's own
  header, else a fresh id).
- ``--max-log-len N``: accepted for vLLM's scripts: mrv2 logs no prompt to truncate.
- ``--enable-tokenizer-info-endpoint``: ``GET /tokenizer_info``, the tokenizer's settings
  and chat template.
- ``--log-error-stack``: an error answer's stack logged.
- ``--enable-server-load-tracking``: ``GET /load`` counts the generation and pooling
  requests in flight (``{"server_load": N}``; 0 without the flag, as vLLM's).
- ``--h11-max-incomplete-event-size BYTES``: uvicorn's bound on an HTTP request's head
  (vLLM's default, 4 MiB).
- ``--otlp-traces-endpoint URL``: an OpenTelemetry ``llm_request`` span per finished
  completion or chat request, exported by OTLP to ``URL`` (:mod:`~mrv2.entrypoints.tracing`;
  needs ``mrv2[tracing]``, checked at start-up).
- ``--collect-detailed-traces model|worker|all`` (several, or comma-separated): vLLM's
  per-request model forward and execute times. Accepted (it needs
  ``--otlp-traces-endpoint``, as vLLM's), and the spans stay the same: mrv2 times no model
  forward per request, which would take a device sync a step; the spans' prefill, decode
  and inference times (from the scheduler's first step and the tokens' arrival) are what
  mrv2 measures of the model.
"""

from __future__ import annotations

import argparse
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mrv2.engine.content_format import resolve_content_format, text_parts
from mrv2.entrypoints.tracing import DETAILED_TRACE_MODULES, check_tracing_available

if TYPE_CHECKING:  # (the CLI imports this module without the server's packages)
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["H11_MAX_INCOMPLETE_EVENT_SIZE", "LOAD_ROUTES", "LoadTracker", "RequestIdHeader",
           "ServeOptions", "add_serve_args", "tokenizer_info"]

#: vLLM's default ``--h11-max-incomplete-event-size`` (bytes).
H11_MAX_INCOMPLETE_EVENT_SIZE = 4 * 1024 * 1024
#: The routes ``--enable-server-load-tracking`` counts (vLLM's load-aware routes).
LOAD_ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/pooling", "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
    "/v2/rerank"})
ContentFormat = Literal["auto", "string", "openai"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """The server flags of the module doc, checked by :meth:`from_args` (a ValueError naming
    the flag)."""

    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template_content_format: ContentFormat = "auto"
    exclude_tools_when_tool_choice_none: bool = False
    enable_request_id_headers: bool = False
    max_log_len: int | None = None
    enable_tokenizer_info_endpoint: bool = False
    log_error_stack: bool = False
    enable_server_load_tracking: bool = False
    h11_max_incomplete_event_size: int = H11_MAX_INCOMPLETE_EVENT_SIZE
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        """The options of ``mrv2 serve``'s parsed flags (:func:`add_serve_args`)."""
        kwargs: dict[str, Any] = {}
        text = args.default_chat_template_kwargs
        if text is not None:
            try:
                kwargs = json.loads(text)
            except ValueError:
                kwargs = None  # type: ignore[assignment]
            if not isinstance(kwargs, dict):
                raise ValueError(f"--default-chat-template-kwargs={text!r}: expected a JSON "
                                 "object, such as '{\"enable_thinking\": false}'")
        if not args.response_role:
            raise ValueError("--response-role: expected a role name, such as assistant")
        if args.max_log_len is not None and args.max_log_len < 0:
            raise ValueError(f"--max-log-len={args.max_log_len}: expected >= 0")
        if args.h11_max_incomplete_event_size < 1:
            raise ValueError(f"--h11-max-incomplete-event-size="
                             f"{args.h11_max_incomplete_event_size}: expected >= 1 byte")
        endpoint = args.otlp_traces_endpoint or None
        detailed = tuple(value for given in args.collect_detailed_traces or ()
                         for value in given.split(",") if value)
        for value in detailed:
            if value not in DETAILED_TRACE_MODULES:
                raise ValueError(f"--collect-detailed-traces={value!r}: expected "
                                 f"{', '.join(DETAILED_TRACE_MODULES)}")
        if detailed and endpoint is None:  # (vLLM's rule)
            raise ValueError("--collect-detailed-traces requires --otlp-traces-endpoint")
        if endpoint is not None:
            check_tracing_available()  # (the packages named now, before the engine loads)
        return cls(
            response_role=args.response_role,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            enable_force_include_usage=args.enable_force_include_usage,
            default_chat_template_kwargs=kwargs,
            chat_template_content_format=args.chat_template_content_format,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            enable_request_id_headers=args.enable_request_id_headers,
            max_log_len=args.max_log_len,
            enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            log_error_stack=args.log_error_stack,
            enable_server_load_tracking=args.enable_server_load_tracking,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            otlp_traces_endpoint=endpoint, collect_detailed_traces=detailed)

    def content_parts(self, messages: list[dict[str, Any]], contents: list[Any],
                      template: str | None = None) -> list[dict[str, Any]]:
        """Text-only messages (``messages``, their content a string) as the chat template
        ``template`` reads them: with ``openai`` (``auto``'s for a template that loops over
        a message's content: :func:`~mrv2.entrypoints.content_format.detect_content_format`)
        each content (``contents``, as sent) a list of text parts, empty ones dropped; else
        as given."""
        if resolve_content_format(self.chat_template_content_format, template) != "openai":
            return messages
        return [{**m, "content": text_parts(content)}
                for m, content in zip(messages, contents, strict=True)]


class RequestIdHeader:
    """``--enable-request-id-headers``: ``X-Request-Id`` on every HTTP answer, the
    request's own header's value, else a fresh hex id (vLLM's). A plain ASGI middleware."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        value = given or uuid.uuid4().hex.encode()

        async def with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, with_header)


class LoadTracker:
    """``--enable-server-load-tracking``: counts the requests to :data:`LOAD_ROUTES` from
    their arrival until their answer (a stream's last event) is sent, in ``counter[0]``,
    which ``GET /load`` reads."""

    def __init__(self, app: ASGIApp, counter: list[int]) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in LOAD_ROUTES:
            await self.app(scope, receive, send)
            return
        self.counter[0] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter[0] -= 1


def tokenizer_info(hf_tokenizer: Any, chat_template: Any) -> dict[str, Any]:
    """``GET /tokenizer_info``'s body (vLLM's): the tokenizer's settings as it was loaded
    (its files' paths left out), its class name and the server's chat template."""
    config = dict(getattr(hf_tokenizer, "init_kwargs", None) or {})
    for key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(key, None)
    config = _jsonable(config)
    config["tokenizer_class"] = type(hf_tokenizer).__name__
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)  # (an AddedToken: its text)
    return content if isinstance(content, str) else str(value)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``mrv2 serve``'s flags of :class:`ServeOptions` (vLLM's names)."""
    group = parser.add_argument_group("answers (vLLM's frontend flags)")
    group.add_argument("--response-role", default="assistant",
                       help="a chat answer's role when the request asks for a generation "
                       "prompt (default assistant)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name their tokens token_id:N (a request's own "
                       "return_tokens_as_token_ids wins)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with its usage, as with stream_options "
                       "include_usage")
    group.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                       help="a JSON object of chat template variables under each request's "
                       "chat_template_kwargs, e.g. '{\"enable_thinking\": false}'")
    group.add_argument("--chat-template-content-format", default="auto",
                       choices=["auto", "string", "openai"],
                       help="a message's text content in the chat template: string (one "
                       "text) or openai (a list of {type: text, text} parts); auto: openai "
                       "where the template loops over a message's content, else string")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="tool_choice \"none\" leaves the tools out of the prompt")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="answers carry X-Request-Id (the request's own, else a new id)")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="vLLM's flag, accepted for its launch scripts: mrv2 logs no "
                       "prompt text or ids (no effect)")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="GET /tokenizer_info: the tokenizer's settings and chat template")
    group.add_argument("--log-error-stack", action="store_true",
                       help="log the stack of every error answer")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load counts the generation and pooling requests in flight")
    group.add_argument("--h11-max-incomplete-event-size", type=int,
                       default=H11_MAX_INCOMPLETE_EVENT_SIZE, metavar="BYTES",
                       help="uvicorn's bound on an HTTP request's head (default 4 MiB, "
                       "vLLM's)")
    group = parser.add_argument_group("tracing (vLLM's OpenTelemetry flags)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send an OpenTelemetry span (llm_request: ids, sampling "
                       "parameters, token counts, finish reasons, queue / first-token / "
                       "prefill / decode / end-to-end times) per finished completion or chat "
                       "request to this OTLP collector (gRPC; OTEL_EXPORTER_OTLP_TRACES_"
                       "PROTOCOL=http/protobuf for HTTP); a traceparent header makes it a "
                       "child of the caller's span. Needs pip install 'mrv2[tracing]'")
    group.add_argument("--collect-detailed-traces", nargs="+", default=None,
                       metavar="{model,worker,all}",
                       help="vLLM's per-request model forward / execute times; accepted "
                       "(needs --otlp-traces-endpoint) but the spans stay the same: mrv2 "
                       "times no model forward per request (that would sync the device every "
                       "step); the spans' prefill / decode / inference times are what it "
                       "measures")
