"""The ``mrv2`` command's logging: one stderr handler on the ``mrv2`` logger.

A library does not configure logging for its user, so importing mrv2 leaves the ``mrv2``
logger to the application. The ``mrv2`` command (and the engine process it starts) call
:func:`configure_logging`, so an operator sees the start-up report (weights, KV cache, CUDA
graphs, warm-up) and warnings, as vLLM's command prints its own.
``MRV2_LOGGING_LEVEL`` sets the level (a name such as ``WARNING``, default ``INFO``).
"""

from __future__ import annotations

import logging
import os
import sys

#: The level of the ``mrv2`` command's log (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``).
LEVEL_ENV_VAR = "MRV2_LOGGING_LEVEL"
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Handler(logging.StreamHandler):
    """The handler this module installs (so a second call replaces it, not adds one). It
    writes to the ``sys.stderr`` of the moment, not the one it was made with (a test's
    capture or a redirect made later still gets the lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(level: int | str | None = None) -> int:
    """Log the ``mrv2`` logger's records to stderr at ``level`` (default: the environment's
    ``MRV2_LOGGING_LEVEL``, else INFO). Idempotent; returns the level set. ValueError naming
    the variable and the allowed names on an unknown level."""
    if level is None:
        level = os.environ.get(LEVEL_ENV_VAR, "INFO").strip().upper() or "INFO"
    if isinstance(level, str):
        if level not in _LEVELS:
            raise ValueError(f"{LEVEL_ENV_VAR}={level!r}: allowed levels are "
                             f"{', '.join(_LEVELS)}")
        level = int(getattr(logging, level))
    root = logging.getLogger("mrv2")
    for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(handler)
    handler = _Handler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    # Records still propagate: the command installs no root handler (so nothing prints
    # twice), and an application's own root handlers (or pytest's caplog) still see them.
    return level


def configured_level() -> int | None:
    """The level :func:`configure_logging` set in this process, or None (not called): what
    the engine process passes to its child."""
    root = logging.getLogger("mrv2")
    if any(isinstance(h, _Handler) for h in root.handlers):
        return root.level
    return None
