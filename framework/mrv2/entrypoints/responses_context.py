"""What the chat template is given of a Responses API conversation (its chat messages: a
stored response's and the request's input, :mod:`mrv2.entrypoints.openai_responses`).

* Reasoning. An earlier answer's reasoning (its ``reasoning`` items sent back as input, or kept
  by the store) is its assistant message's ``reasoning``, kept only after the conversation's
  last answer (an assistant message without calls): the reasoning before the calls of the
  turn under way, which the model goes on from once their results come. A finished turn's is
  dropped, as harmony drops it (openai-harmony's ``auto_drop_analysis``, gpt-oss's chat
  template, vLLM's Responses API) and the templates that render reasoning do (Qwen3's keeps
  none before its last user message).
* Harmony (gpt-oss). Its template reads the analysis before a call from the assistant
  message's ``thinking`` (from its ``content`` when it has none, and refuses both): the
  reasoning, then a preamble the message holds as its content, are the ``thinking``.
* ``truncation: "auto"``. Where the conversation may be cut (:func:`truncation_cuts`): whole
  messages from its beginning, after its leading system (developer) messages, which stay as
  the request's ``instructions`` do; never the last, and never so that a tool's result opens
  what is kept (its call dropped).
"""

from __future__ import annotations

from typing import Any

from mrv2.entrypoints.openai_protocol import ChatMessage

__all__ = ["TemplateMessage", "current_reasoning", "cut", "for_harmony", "truncation_cuts"]


class TemplateMessage(ChatMessage):
    """A chat message of a Responses API conversation: the chat route's, and an assistant's
    ``thinking`` (:func:`for_harmony`: gpt-oss's template's name for a call's analysis)."""

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        thinking = (self.model_extra or {}).get("thinking")
        if self.role == "assistant" and isinstance(thinking, str):
            out["thinking"] = thinking
        return out


def _is_answer(message: dict[str, Any]) -> bool:
    return message.get("role") == "assistant" and not message.get("tool_calls")


def current_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the ``reasoning`` of finished turns left out (module doc): kept only
    on the messages after the last answer (copies; the others as they are)."""
    last = max((i for i, m in enumerate(messages) if _is_answer(m)), default=-1)
    return [{k: v for k, v in m.items() if k != "reasoning"}
            if i <= last and "reasoning" in m else m for i, m in enumerate(messages)]


def for_harmony(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as gpt-oss's chat template reads them: an assistant call's reasoning (and
    a preamble in its content, after it) as its ``thinking``, its content empty."""
    out = []
    for m in messages:
        reasoning, content = m.get("reasoning"), m.get("content")
        if (m.get("role") == "assistant" and m.get("tool_calls") and reasoning
                and isinstance(content, str)):
            m = {**m, "thinking": "\n".join(t for t in (reasoning, content) if t),
                 "content": ""}
        out.append(m)
    return out


def _pinned(messages: list[dict[str, Any]]) -> int:
    """How many of the conversation's first messages are system messages (never cut)."""
    return next((i for i, m in enumerate(messages) if m.get("role") != "system"),
                len(messages))


def truncation_cuts(messages: list[dict[str, Any]]) -> list[int]:
    """How many messages ``truncation: "auto"`` may drop (:func:`cut`), fewest first: 0, then
    each count that leaves a message other than a tool's result first, and one at least."""
    pinned = _pinned(messages)
    return [0] + [k for k in range(1, len(messages) - pinned)
                  if messages[pinned + k].get("role") != "tool"]


def cut(messages: list[dict[str, Any]], drop: int) -> list[dict[str, Any]]:
    """``messages`` without the ``drop`` first after its leading system messages."""
    pinned = _pinned(messages)
    return messages[:pinned] + messages[pinned + drop:]
