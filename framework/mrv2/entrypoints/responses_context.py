"""What the chat template is given of a Responses API conversation (its chat messages: a
stored response's and the request's input, :mod:`mrv2.entrypoints.openai_responses`), and of
a chat request's messages for gpt-oss (:func:`harmony_messages`).

* Reasoning. An earlier answer's reasoning (its ``reasoning`` items sent back as input, or kept
  by the store) is its assistant message's ``reasoning``, kept only after the conversation's
  last answer (an assistant message without calls): the reasoning before the calls of the
  turn under way, which the model goes on from once their results come. A finished turn's is
  dropped, as harmony drops it (openai-harmony's ``auto_drop_analysis``, gpt-oss's chat
  template, vLLM's Responses API) and the templates that render reasoning do (Qwen3's keeps
  none before its last user message).
* Harmony (gpt-oss). Its template reads the analysis before a call from the assistant
  message's ``thinking`` (from its ``content`` when it has none, and refuses both): the
  reasoning, then a preamble the message holds as its content, are the ``thinking``. The
  chat route does the same with an assistant message's ``reasoning`` (or
  ``reasoning_content``) sent back with its ``tool_calls``, as vLLM's chat route renders it
  (``parse_chat_inputs_to_harmony_messages``: the analysis before the calls, a finished
  turn's dropped); other templates get the message as before (both names, content kept).
* ``truncation: "auto"``. Where the conversation may be cut (:func:`truncation_cuts`): whole
  messages from its beginning, after its leading system (developer) messages, which stay as
  the request's ``instructions`` do; never the last, and never so that a tool's result opens
  what is kept (its call dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mrv2.entrypoints.openai_messages import ChatMessage

__all__ = ["TemplateMessage", "current_reasoning", "cut", "for_harmony", "harmony_messages",
           "truncation_cuts"]

#: The names an assistant message's reasoning comes under (vLLM's and the older one).
REASONING_KEYS = ("reasoning", "reasoning_content")


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


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k not in REASONING_KEYS}


def current_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the ``reasoning`` (``reasoning_content``) of finished turns left out
    (module doc): kept only on the messages after the last answer (copies; the others as they
    are)."""
    last = max((i for i, m in enumerate(messages) if _is_answer(m)), default=-1)
    return [_without_reasoning(m) if i <= last and any(k in m for k in REASONING_KEYS) else m
            for i, m in enumerate(messages)]


def for_harmony(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as gpt-oss's chat template reads them: an assistant call's reasoning (and
    a preamble in its content, after it) as its ``thinking``, its content empty and its
    reasoning keys dropped (copies; the others as they are: twice is once)."""
    out = []
    for m in messages:
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        content = m.get("content")
        if (m.get("role") == "assistant" and m.get("tool_calls") and reasoning
                and isinstance(content, str)):
            m = {**_without_reasoning(m), "content": "",
                 "thinking": "\n".join(t for t in (reasoning, content) if t)}
        out.append(m)
    return out


def harmony_messages(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """A chat request's ``messages`` as gpt-oss's chat template reads them (module doc): the
    assistant calls' reasoning of the turn under way as their ``thinking``
    (:func:`for_harmony`), a finished turn's left out (:func:`current_reasoning`); the
    messages that keep what they had as they are (their content parts too), all of them
    where one is malformed (a call that is not a function's: the rendering refuses it)."""
    try:
        plain = [m.as_dict() for m in messages]
    except ValueError:
        return list(messages)
    kept = for_harmony(current_reasoning(plain))
    return [m if k is p else TemplateMessage(**k)
            for m, p, k in zip(messages, plain, kept, strict=True)]


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
