"""``mrv2 serve``'s flags of vLLM's for user extensions and its API-server processes:

- ``--tool-parser-plugin PATH``: a Python file imported before the flags are checked, which
  registers tool-call formats with :func:`mrv2.entrypoints.tool_calls.register_tool_parser`;
  ``--tool-call-parser NAME`` then accepts their names (vLLM's flag: its files call
  ``ToolParserManager.register_module``; mrv2's register a
  :class:`~mrv2.entrypoints.tool_calls.ToolParser`, markers plus a function
  ``(text, tools) -> list[ToolCall]``)::

      from mrv2.entrypoints.tool_calls import ToolCall, ToolParser, register_tool_parser

      def calls(text, tools):  # the answer from the first marker on
          name, _, arguments = text.removeprefix("CALL ").partition(" ")
          return [ToolCall(name, arguments)]

      register_tool_parser(ToolParser("my_format", ("CALL ",), calls))

- ``--middleware module.attr`` (repeatable): an ASGI middleware added to the app, as vLLM's: a
  class is added with ``app.add_middleware(cls)``, a function with
  ``app.middleware("http")(function)`` (``async def f(request, call_next)``).
- ``--disable-frontend-multiprocessing``: vLLM's server and engine in one process: mrv2's
  ``--no-engine-process`` (the engine on a thread of the server's process).
- ``--api-server-count N``: 1 only (mrv2 runs one API server process).
- ``--headless``: refused (mrv2 has no multi-node engine without an API server).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_plugin_args", "add_middleware", "engine_process_choice",
           "load_middleware", "load_tool_parser_plugin", "preload_tool_parser_plugins"]

_LOADED: set[str] = set()  # the plugin files imported (their real paths)


def load_tool_parser_plugin(path: str) -> None:
    """Import the ``--tool-parser-plugin`` file ``path`` (its module named after the file,
    as vLLM's), once a process; ValueError naming the flag when it is missing or fails to
    import."""
    flag = f"--tool-parser-plugin={path}"
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file")
    if os.path.realpath(path) in _LOADED:  # (main() again in one process: imported once)
        return
    name = os.path.splitext(os.path.basename(path))[0] or "tool_parser_plugin"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # (any error of the user's file, named with the flag)
        sys.modules.pop(name, None)
        raise ValueError(f"{flag}: failed to import: {type(error).__name__}: {error}"
                         ) from error
    _LOADED.add(os.path.realpath(path))


def preload_tool_parser_plugins(argv: Sequence[str]) -> None:
    """Import the ``--tool-parser-plugin`` file of a ``serve`` command line before its parser
    is built, so ``--tool-call-parser`` offers the names it registers."""
    if "serve" not in argv:
        return
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--tool-parser-plugin", default=None)
    known, _ = pre.parse_known_args(list(argv))
    if known.tool_parser_plugin:
        load_tool_parser_plugin(known.tool_parser_plugin)


def load_middleware(paths: Sequence[str]) -> list[Any]:
    """The ``--middleware`` objects of their ``module.attr`` paths (ValueError naming the
    flag for a path that does not import, or names neither a class nor a function)."""
    loaded = []
    for path in paths:
        module_name, _, attr = path.rpartition(".")
        if not module_name or not attr:
            raise ValueError(f"--middleware={path}: expected an import path module.attr")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # (any error of the user's module)
            raise ValueError(f"--middleware={path}: cannot import {module_name}: "
                             f"{type(error).__name__}: {error}") from error
        if not hasattr(module, attr):
            raise ValueError(f"--middleware={path}: {module_name} has no {attr}")
        value = getattr(module, attr)
        if not (inspect.isclass(value) or inspect.iscoroutinefunction(value)):
            raise ValueError(f"--middleware={path}: expected an ASGI middleware class or an "
                             "async function (request, call_next)")
        loaded.append(value)
    return loaded


def add_middleware(app: Any, middleware: Sequence[Any]) -> None:
    """Add the :func:`load_middleware` objects to the FastAPI ``app``, as vLLM does."""
    for value in middleware:
        if inspect.isclass(value):
            app.add_middleware(value)
        else:
            app.middleware("http")(value)


def engine_process_choice(args: argparse.Namespace) -> bool | None:
    """``--engine-process`` as set, ``--disable-frontend-multiprocessing`` (its ``--no-``)
    and the refused ``--api-server-count`` / ``--headless`` (ValueError naming the flag)."""
    if args.api_server_count is not None and args.api_server_count != 1:
        raise ValueError(f"--api-server-count={args.api_server_count}: mrv2 runs one API "
                         "server process (expected 1)")
    if args.headless:
        raise ValueError("--headless: mrv2 has no multi-node engine to run without its API "
                         "server (leave the flag out)")
    if args.disable_frontend_multiprocessing:
        if args.engine_process:
            raise ValueError("--disable-frontend-multiprocessing runs the engine in the "
                             "server's process: leave --engine-process out")
        return False
    return args.engine_process


def add_plugin_args(parser: argparse.ArgumentParser) -> None:
    """``mrv2 serve``'s flags of the module doc (vLLM's names)."""
    group = parser.add_argument_group("extensions and processes (vLLM's flags)")
    group.add_argument("--tool-parser-plugin", default=None, metavar="PATH",
                       help="a Python file registering tool-call formats "
                       "(mrv2.entrypoints.tool_calls.register_tool_parser) whose names "
                       "--tool-call-parser then takes")
    group.add_argument("--middleware", action="append", default=[], metavar="MODULE.ATTR",
                       help="an ASGI middleware class, or an async function (request, "
                       "call_next), added to the app (repeatable)")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true",
                       help="the engine in the server's process (as --no-engine-process)")
    group.add_argument("--api-server-count", type=int, default=None, metavar="N",
                       help="API server processes: 1 only")
    group.add_argument("--headless", action="store_true",
                       help="vLLM's multi-node flag: refused (mrv2 serves from one node)")
