"""A Responses API answer's output items (:class:`mrv2.entrypoints.openai_responses.
ResponsesStream`'s): its text deltas split into runs of reasoning and message text, the
message text's logprobs and its tool calls (:class:`AnswerSplit`), and the ``reasoning``,
``message`` and ``function_call`` items they make, with the typed events that stream them
(:class:`OutputItems`).
"""

from __future__ import annotations

from typing import Any

from mrv2.entrypoints.openai_logprobs import chat_logprobs
from mrv2.entrypoints.reasoning import ReasoningStream

__all__ = ["AnswerSplit", "OutputItems"]


def _message_item(item_id: str, text: str, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


class AnswerSplit:
    """One answer's text deltas split as they come: into runs of reasoning
    (``--reasoning-parser``) and of the message's text, in the order the model wrote them
    (harmony's messages may come in any order), the message text's logprobs (``k``: the top
    tokens a position; None: not asked for) and, when the answer ends, tool calls.

    A token's logprob goes with the message text of its delta (the engine's output of a step);
    a delta that shows none (text held back as it may begin a tag, a character's first byte)
    holds its tokens for the next one that does, where it lies past the reasoning; the tokens
    of reasoning (its end tag included: gpt-oss's markers are tokens of their own) and of
    tool calls, and those still held when the answer ends (the end-of-sequence token), are in
    no message's logprobs."""

    def __init__(self, reasoning: str | None, tools: Any, parallel: bool,
                 k: int | None) -> None:
        self.reasoning = ReasoningStream(reasoning) if reasoning else None
        self.calling = tools.stream() if tools is not None else None
        self.parallel, self.k = parallel, k
        self.held_ids: list[int] = []
        self.held: list[Any] = []
        #: The reasoning's tokens so far: a delta's where all the text it shows is reasoning,
        #: or where it shows none in the reasoning (its tags, harmony's ``<|message|>`` and
        #: ``<|end|>`` around the analysis).
        self.reasoning_tokens = 0

    def _in_reasoning(self) -> bool:
        split = self.reasoning
        if split is None:
            return False
        if split.harmony is not None:
            return split.harmony.state == "body" and split.harmony.header.kind == "reasoning"
        return split.state == "reasoning"

    def feed(self, text: str, token_ids: Any, logprobs: Any, final: bool
             ) -> tuple[list[tuple[str, str]], list[Any], list[dict[str, Any]]]:
        """A delta's ``(runs, calls, the message text's logprobs)``: ``runs`` its
        ``("reasoning" | "content", text)`` pieces in order (``final``: the answer's last;
        the calls come then)."""
        split = self.reasoning
        harmony = split.harmony if split is not None else None
        past = split is None or (harmony is None and split.state == "content")
        was_reasoning = self._in_reasoning()
        if harmony is not None:  # (its pieces, in the order written)
            runs = [(p.kind, p.text) for p in harmony.feed(text, final)
                    if p.kind in ("reasoning", "content") and p.text]
        else:
            thought, content = split.feed(text, final) if split is not None else ("", text)
            runs = [r for r in (("reasoning", thought), ("content", content)) if r[1]]
        found: list[Any] = []
        if self.calling is not None:
            if self.calling.parser.harmony:
                said, found = self.calling.feed(text, final)
                if harmony is None:  # (else its content is the reasoning split's, in order)
                    runs = [r for r in runs if r[0] == "reasoning"] + [("content", said)]
            else:
                said, found = self.calling.feed(
                    "".join(t for kind, t in runs if kind == "content"), final)
                runs = [r for r in runs if r[0] == "reasoning"] + [("content", said)]
            runs = [r for r in runs if r[1]]
            found = found if self.parallel else found[:1]
        if (all(kind == "reasoning" for kind, _ in runs) and not found
                and (runs or was_reasoning or self._in_reasoning())):
            self.reasoning_tokens += len(token_ids)
        if self.k is None or logprobs is None:
            return runs, found, []
        ids, lps = self.held_ids + list(token_ids), self.held + list(logprobs)
        self.held_ids, self.held = [], []
        if any(kind == "content" for kind, _ in runs):
            return runs, found, chat_logprobs(lps, ids, self.k)["content"]
        if past and not (runs or found):
            self.held_ids, self.held = ids, lps
        return runs, found, []


def _call_item(item_id: str, call: Any, status: str, arguments: str | None = None
               ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "status": status, "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if arguments is None else arguments}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class OutputItems:
    """A streamed answer's output items as events: the reasoning item while its text comes,
    then the message (each opened at its first text and closed when the next opens or the
    answer ends; a message is opened at the end if no text came)."""

    def __init__(self, suffix: str, event: Any) -> None:
        self.suffix, self.event = suffix, event
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None  # the open item's: "reasoning" or "message"
        self.item_id = ""  # the open item's (a kind's second item on: its number after it)
        self.text: list[str] = []  # the open item's, joined when it closes
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        self.again = False  # the open item is its kind's second or later, no text yet

    def feed(self, runs: list[tuple[str, str]], logprobs: list[dict[str, Any]]) -> str:
        """A delta's runs of reasoning and message text (:meth:`AnswerSplit.feed`), in order; its
        logprobs go with its first run of message text."""
        out = ""
        for kind, text in runs:
            out += self._open("message" if kind == "content" else "reasoning")
            if self.again:  # (harmony's separator of a kind's messages: not in a new item)
                text, self.again = text.removeprefix("\n"), False
            if not text:
                continue
            self.text.append(text)
            if kind == "reasoning":
                out += self.event("response.reasoning_text.delta", item_id=self._id(),
                                  output_index=len(self.output), content_index=0,
                                  delta=text)
                continue
            self.logprobs += logprobs
            out += self.event("response.output_text.delta", item_id=self._id(),
                              output_index=len(self.output), content_index=0, delta=text,
                              logprobs=logprobs)
            logprobs = []
        return out

    def close(self, calls: list[Any], status: str = "completed"
              ) -> tuple[list[dict[str, Any]], str]:
        """The answer's output items, and the events that close them: the open item, then
        a function call item per call; a message item, empty if no content came, where there
        are no calls. The message item closed here has the answer's ``status``
        (``incomplete``: cut by ``max_output_tokens``)."""
        has_message = self.kind == "message" or any(i["type"] == "message"
                                                    for i in self.output)
        out = self._open("message") if not (has_message or calls) else ""
        out += self._close(status)
        for i, call in enumerate(calls):
            index, item_id = len(self.output), f"fc_{self.suffix}_{i}"
            item = _call_item(item_id, call, "completed")
            out += (self.event("response.output_item.added", output_index=index,
                               item=_call_item(item_id, call, "in_progress", ""))
                    + self.event("response.function_call_arguments.delta", item_id=item_id,
                                 output_index=index, delta=call.arguments)
                    + self.event("response.function_call_arguments.done", item_id=item_id,
                                 output_index=index, arguments=call.arguments)
                    + self.event("response.output_item.done", output_index=index, item=item))
            self.output.append(item)
        return self.output, out

    def _id(self) -> str:
        return self.item_id

    def _open(self, kind: str) -> str:
        if self.kind == kind:
            return ""
        out = self._close()
        self.kind, self.text, self.logprobs = kind, [], []
        # (harmony's analysis after a preamble: a kind's item again, with an id of its own)
        again = sum(i["type"] == kind for i in self.output)
        self.again = again > 0
        self.item_id = (f"{'rs' if kind == 'reasoning' else 'msg'}_{self.suffix}"
                        + (f"_{again}" if again else ""))
        index = len(self.output)
        if kind == "reasoning":
            item = _reasoning_item(self._id(), "", "in_progress")
            item["content"] = []
            return out + self.event("response.output_item.added", output_index=index,
                                    item=item)
        item = _message_item(self._id(), "", "in_progress")
        item["content"] = []
        return (out + self.event("response.output_item.added", output_index=index, item=item)
                + self.event("response.content_part.added", item_id=self._id(),
                             output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [],
                                   "logprobs": []}))

    def _close(self, status: str = "completed") -> str:
        if self.kind is None:
            return ""
        index, item_id, text = len(self.output), self._id(), "".join(self.text)
        if self.kind == "reasoning":
            item = _reasoning_item(item_id, text, "completed")
            out = self.event("response.reasoning_text.done", item_id=item_id,
                             output_index=index, content_index=0, text=text)
        else:
            item = _message_item(item_id, text, status, self.logprobs)
            part = item["content"][0]
            out = (self.event("response.output_text.done", item_id=item_id,
                              output_index=index, content_index=0, text=text,
                              logprobs=self.logprobs)
                   + self.event("response.content_part.done", item_id=item_id,
                                output_index=index, content_index=0, part=part))
        out += self.event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.kind = None
        return out
