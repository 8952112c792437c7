"""Running :mod:`mrv2.entrypoints.server`'s app: the listening socket (bound before the
engine loads, so a port in use fails at once), uvicorn's server, and ``mrv2 serve``'s loop
until an interrupt or the engine's fatal failure."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from mrv2.contract.lora import LoRARequest
from mrv2.engine.engine import LLMEngine
from mrv2.engine.gc_pauses import freeze_startup_heap
from mrv2.entrypoints.engine_process import EngineProcess, RemoteEngine
from mrv2.entrypoints.engine_thread import EngineThread
from mrv2.entrypoints.http_options import HTTPOptions
from mrv2.entrypoints.serve_options import ServeOptions
from mrv2.entrypoints.server import DEFAULT_MAX_N, create_app
from mrv2.entrypoints.stack_sampler import PROFILE_ENV_VAR, StackSampler
from mrv2.entrypoints.stats_logger import log_stats_interval

__all__ = ["FATAL_GRACE_S", "listen_socket", "make_server", "run_server"]

#: Seconds a server whose engine failed for good keeps answering 503 before it exits.
FATAL_GRACE_S = 1.0

logger = logging.getLogger(__name__)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), for
    :func:`run_server`; OSError (the port in use, an unknown host) before anything loads.
    IPv6 only for an IPv6 address (``::``, ``::1``): a name such as ``localhost`` binds its
    IPv4 address, as vLLM's server does, whatever order the resolver lists them in."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock



def make_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                access_log: bool = True, http: HTTPOptions | None = None,
                options: ServeOptions | None = None) -> Any:
    """uvicorn's server for ``app`` (the root path and TLS from ``http``; the bound on a
    request's head from ``options``), which logs where it listens also when handed a socket
    bound already (uvicorn says so for its own only)."""
    import uvicorn

    http = http or HTTPOptions()
    scheme = http.scheme

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if sockets and self.started:
                name = sockets[0].getsockname()
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", scheme,
                    f"[{name[0]}]" if ":" in str(name[0]) else name[0], name[1])

    h11_size = (options or ServeOptions()).h11_max_incomplete_event_size
    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                 access_log=access_log, h11_max_incomplete_event_size=h11_size,
                                 **http.uvicorn_kwargs()))


def run_server(engine: LLMEngine | RemoteEngine, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | Sequence[str] | None = None,
               api_key: str | None = None,
               max_pending: int = 1024, max_n: int = DEFAULT_MAX_N,
               log_stats: bool = True, uvicorn_log_level: str = "info",
               access_log: bool = True, sock: socket.socket | None = None,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               http: HTTPOptions | None = None,
               enable_prompt_tokens_details: bool = False,
               lora_modules: Sequence[LoRARequest] = (),
               trust_request_chat_template: bool = False,
               options: ServeOptions | None = None, middleware: Sequence[Any] = ()) -> int:
    """Serve until interrupted (returns 0), or until the engine fails for good (a
    tensor-parallel worker died: the server answers 503 for a moment, then stops and returns
    1). ``log_stats``: a stats line every :func:`~mrv2.entrypoints.stats_logger.log_stats_interval`
    seconds while the engine has work. ``uvicorn_log_level`` and ``access_log``: uvicorn's
    (a line per HTTP request unless ``access_log`` is False). ``sock``: a socket bound to
    ``host:port`` already (:func:`listen_socket`, which ``mrv2 serve`` calls before the
    engine loads, so a port in use fails at once); None binds it here. ``http``: CORS, the
    root path, TLS, the docs pages (:class:`~mrv2.entrypoints.http_options.HTTPOptions`).
    ``lora_modules``: the adapters served by name (``--lora-modules``).
    ``trust_request_chat_template``: a request's own ``chat_template`` is rendered
    (``--trust-request-chat-template``), not refused. ``options``: vLLM's frontend flags
    (:mod:`~mrv2.entrypoints.serve_options`). ``middleware``: ``--middleware``'s
    (:func:`~mrv2.entrypoints.serve_plugins.load_middleware`), added to the app."""
    http = http or HTTPOptions()
    if engine.tokenizer is not None:
        engine.tokenizer.warm_up()  # the chat template compiled before the first request
    # This process lives as long as the server; frozen before the app (and its count of the
    # collector's pauses) exists, so /metrics does not count this one full collection.
    freeze_startup_heap()
    app = create_app(engine, served_model_name, api_key, max_pending, max_n,
                     log_stats_interval() if log_stats else None, reasoning_parser,
                     tool_call_parser, http, enable_prompt_tokens_details, lora_modules,
                     trust_request_chat_template, options, middleware)
    server = make_server(app, host, port, uvicorn_log_level, access_log, http, options)
    worker: EngineThread | EngineProcess = app.state.engine_thread

    def stop_soon(error: BaseException) -> None:
        logger.error("stopping the server: %s", error)
        threading.Timer(FATAL_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    worker.on_fatal.append(stop_soon)
    profile = os.environ.get(PROFILE_ENV_VAR, "").strip()
    sampler = StackSampler() if profile else None
    if sampler is not None:
        sampler.start()
    try:
        # re-raises a captured SIGINT once the server has stopped (as uvicorn.run)
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:
        pass
    finally:
        if sampler is not None:
            sampler.stop()
            sampler.write(profile)
        engine.shutdown()
    if worker.fatal is not None:
        print(f"mrv2 serve: {worker.fatal}", file=sys.stderr, flush=True)
        return 1
    return 0
