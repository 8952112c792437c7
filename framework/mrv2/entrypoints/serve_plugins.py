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

  A parser may also stream its calls (:attr:`~mrv2.entrypoints.tool_calls.ToolParser.stream`,
  :mod:`mrv2.entrypoints.tool_stream`); without it its calls go out when the answer ends.
- ``--reasoning-parser-plugin PATH``: a Python file, imported before ``--reasoning-parser``
  is checked, which registers reasoning parsers with
  :func:`mrv2.entrypoints.reasoning.register_reasoning_parser` (vLLM's flag: its files call
  ``ReasoningParserManager.register_module``); ``--reasoning-parser NAME`` then takes their
  names. A parser is tags (a :class:`~mrv2.entrypoints.reasoning.Block`, split as the
  built-in parsers split theirs) or a class whose ``feed(delta, final)`` returns the
  ``(reasoning, content)`` parts of each delta (the whole answer: one call with ``final``)::

      from mrv2.entrypoints.reasoning import ReasoningParser, register_reasoning_parser

      class Split:  # one for each choice: what precedes the first "=>" is reasoning
          def __init__(self):
              self.held, self.done = "", False

          def feed(self, delta, final=False):
              if self.done:
                  return "", delta
              text = self.held + delta
              before, sep, after = text.partition("=>")
              if sep:
                  self.held, self.done = "", True
                  return before, after
              keep = 0 if final or not text.endswith("=") else 1  # (may begin "=>")
              self.held = text[len(text) - keep:]
              return text[:len(text) - keep], ""

      register_reasoning_parser(ReasoningParser("arrow", splitter=Split))

  A file that registers none is refused; so is a name no file or built-in parser has.
  ``structured_outputs_config``'s ``reasoning_parser_plugin`` is the same (the two may not
  differ).
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
           "load_middleware", "load_reasoning_parser_plugin", "load_tool_parser_plugin",
           "preload_tool_parser_plugins"]

#: The plugin files imported (their real paths), each with the reasoning parsers it
#: registered.
_LOADED: dict[str, tuple[str, ...]] = {}


def _load_plugin(path: str, flag: str) -> tuple[str, ...]:
    """Import the plugin file ``path`` (its module named after the file, as vLLM's), once a
    process: the reasoning parsers it registered; ValueError naming ``flag`` when it is
    missing or fails to import."""
    from mrv2.entrypoints.reasoning import PLUGINS

    flag = f"{flag}={path}"
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file")
    real = os.path.realpath(path)
    if real in _LOADED:  # (main() again in one process, or both flags: imported once)
        return _LOADED[real]
    name = os.path.splitext(os.path.basename(path))[0] or "parser_plugin"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    before = set(PLUGINS)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # (any error of the user's file, named with the flag)
        sys.modules.pop(name, None)
        raise ValueError(f"{flag}: failed to import: {type(error).__name__}: {error}"
                         ) from error
    _LOADED[real] = tuple(n for n in PLUGINS if n not in before)
    return _LOADED[real]


def load_tool_parser_plugin(path: str) -> None:
    """Import the ``--tool-parser-plugin`` file ``path`` (:func:`_load_plugin`)."""
    _load_plugin(path, "--tool-parser-plugin")


def load_reasoning_parser_plugin(path: str) -> tuple[str, ...]:
    """Import the ``--reasoning-parser-plugin`` file ``path`` (:func:`_load_plugin`): the
    reasoning parsers it registered; ValueError naming the flag where it registered none."""
    names = _load_plugin(path, "--reasoning-parser-plugin")
    if not names:
        raise ValueError(f"--reasoning-parser-plugin={path}: the file registered no reasoning "
                         "parser (it calls mrv2.entrypoints.reasoning.register_reasoning_parser"
                         "(ReasoningParser(NAME, ...)))")
    return names


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
    group.add_argument("--reasoning-parser-plugin", default=None, metavar="PATH",
                       help="a Python file registering reasoning parsers "
                       "(mrv2.entrypoints.reasoning.register_reasoning_parser) whose names "
                       "--reasoning-parser then takes")
    group.add_argument("--middleware", action="append", default=[], metavar="MODULE.ATTR",
                       help="an ASGI middleware class, or an async function (request, "
                       "call_next), added to the app (repeatable)")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true",
                       help="the engine in the server's process (as --no-engine-process)")
    group.add_argument("--api-server-count", type=int, default=None, metavar="N",
                       help="API server processes: 1 only")
    group.add_argument("--headless", action="store_true",
                       help="vLLM's multi-node flag: refused (mrv2 serves from one node)")
