"""``--chat-template-content-format``: the detection lives in
:mod:`mrv2.engine.content_format` (``LLM.chat`` uses it too); the server's start-up log line
is here."""

from __future__ import annotations

import logging

from mrv2.engine.content_format import (
    ResolvedFormat,
    detect_content_format,
    resolve_content_format,
    template_in_use,
)

__all__ = ["ResolvedFormat", "detect_content_format", "log_content_format",
           "resolve_content_format", "template_in_use"]

logger = logging.getLogger(__name__)


def log_content_format(chat_template: str | dict[str, str] | None) -> None:
    """Log, once a server starts with ``auto``, the format its chat template was given."""
    if isinstance(chat_template, dict):
        found = ", ".join(f"{detect_content_format(text)!r} for {name!r}"
                          for name, text in chat_template.items() if isinstance(text, str))
    elif chat_template:
        found = repr(detect_content_format(chat_template))
    else:
        return
    logger.info("chat template content format detected: %s (mrv2 serve "
                "--chat-template-content-format string|openai overrides it)", found)
