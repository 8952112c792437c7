"""A chat message of the OpenAI-compatible API (:class:`ChatMessage`): as a request sends
it, and as the model's chat template reads it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from mrv2.engine.media import joined_text, part_text
from mrv2.engine.tokenizer import template_message


class ChatMessage(BaseModel):
    """A chat message as a request sends it (a chat, tokenize or scoring request's):
    ``role``, ``content`` (text or content parts) and the extras templates read."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (:func:`~mrv2.engine.tokenizer.
        template_message`, vLLM's): text content, an assistant's ``tool_calls`` (their
        JSON-text arguments as objects, as templates index them) and ``reasoning`` /
        ``reasoning_content`` (an earlier turn's thinking, both names), a tool answer's
        ``tool_call_id``, a ``name``."""
        content = self.content
        if isinstance(content, list):  # content parts: the text ones, a line each (vLLM's:
            # input_text, output_text, refusal and thinking parts too; empty ones dropped)
            content = joined_text(content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        extra = self.model_extra or {}
        keys = ["tool_call_id", "name"]
        if self.role == "assistant":  # (an earlier turn's thinking: an assistant's only)
            keys += ["reasoning", "reasoning_content"]
        for key in keys:
            if isinstance(extra.get(key), str):
                message[key] = extra[key]
        calls = extra.get("tool_calls")
        if isinstance(calls, list) and calls:
            message["tool_calls"] = calls
        return template_message(message)

    @property
    def tool_call_count(self) -> int:
        """How many tool calls the message holds (an assistant's ``tool_calls``; vLLM's
        ``get_history_tool_calls_cnt`` counts them)."""
        calls = (self.model_extra or {}).get("tool_calls")
        return len(calls) if self.role == "assistant" and isinstance(calls, list) else 0

    @property
    def has_media(self) -> bool:
        """Whether a content part is not text (an image)."""
        return isinstance(self.content, list) and any(
            part_text(part) is None for part in self.content)

    def with_parts(self) -> dict[str, Any]:
        """:meth:`as_dict` with the content parts as sent (for :func:`~mrv2.engine.media.
        split_chat_media`): an assistant's ``tool_calls``, a tool answer's ``tool_call_id``
        and ``name`` kept."""
        return {**self.as_dict(), "content": self.content or ""}
