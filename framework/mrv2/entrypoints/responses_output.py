"""A Responses API answer's output items (:class:`mrv2.entrypoints.openai_responses.
ResponsesStream`'s): its text deltas split into runs of reasoning and message text, the
message text's logprobs and its tool calls' pieces (:class:`AnswerSplit`), and the
``reasoning``, ``message`` and ``function_call`` items they make, with the typed events that
stream them (:class:`OutputItems`; a call's arguments as ``response.function_call_arguments.
delta`` events as they come, as vLLM's).
"""

from __future__ import annotations

from typing import Any

from mrv2.entrypoints.openai_logprobs import chat_logprobs
from mrv2.entrypoints.reasoning import ReasoningStream
from mrv2.entrypoints.tool_stream import CallDelta, ToolCallStream

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
    tokens a position; None: not asked for) and the pieces of its tool calls
    (:class:`mrv2.entrypoints.tool_stream.CallDelta`; ``parallel`` false: the first call's
    only).

    A token's logprob goes with the message text of its delta (the engine's output of a step);
    a delta that shows none (text held back as it may begin a tag, a character's first byte)
    holds its tokens for the next one that does, where it lies past the reasoning; the tokens
    of reasoning (its end tag included: gpt-oss's markers are tokens of their own) and of
    tool calls, and those still held when the answer ends (the end-of-sequence token), are in
    no message's logprobs."""

    def __init__(self, reasoning: str | None, tools: Any, parallel: bool,
                 k: int | None) -> None:
        self.reasoning = ReasoningStream(reasoning) if reasoning else None
        self.calling = ToolCallStream(tools.parser, tools.tools) if tools is not None else None
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
             ) -> tuple[list[tuple[str, str]], list[CallDelta], list[dict[str, Any]]]:
        """A delta's ``(runs, call pieces, the message text's logprobs)``: ``runs`` its
        ``("reasoning" | "content", text)`` pieces in order (``final``: the answer's last)."""
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
        found: list[CallDelta] = []
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
            found = [p for p in found if self.parallel or p.index == 0]
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


def _call_item(item_id: str, call: CallDelta, status: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "status": status, "call_id": call.id,
            "name": call.name, "arguments": arguments}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


class OutputItems:
    """A streamed answer's output items as events: the reasoning item while its text comes,
    then the message, a function call item at each call's first piece (each opened at its
    first text and closed when the next opens or the answer ends; a message is opened at the
    end if no text and no call came)."""

    def __init__(self, suffix: str, event: Any) -> None:
        self.suffix, self.event = suffix, event
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None  # the open item's: "reasoning" or "message"
        self.item_id = ""  # the open item's (a kind's second item on: its number after it)
        self.text: list[str] = []  # the open item's, joined when it closes
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        self.again = False  # the open item is its kind's second or later, no text yet
        self.call: CallDelta | None = None  # the open function call's first piece

    def feed(self, runs: list[tuple[str, str]], logprobs: list[dict[str, Any]],
             calls: list[CallDelta] | None = None) -> str:
        """A delta's runs of reasoning and message text (:meth:`AnswerSplit.feed`), in order,
        and its call pieces: those of the open call first (the text after a call comes after
        its last piece), the others' after the runs; its logprobs go with its first run of
        message text."""
        calls = calls or []
        open_index = self.call.index if self.kind == "function_call" and self.call else None
        out = self._call_pieces([p for p in calls if p.index == open_index and not p.name])
        calls = [p for p in calls if p.index != open_index or p.name]
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
        return out + self._call_pieces(calls)

    def _call_pieces(self, pieces: list[CallDelta]) -> str:
        """Call pieces: a call's first opens its item; the others' arguments are the open
        call's (a stream sends a call's pieces before the next call's)."""
        out = ""
        for piece in pieces:
            if piece.name:
                out += self._close()
                self.kind, self.text, self.call = "function_call", [], piece
                self.item_id = f"fc_{self.suffix}_{piece.index}"
                out += self.event("response.output_item.added", output_index=len(self.output),
                                  item=_call_item(self.item_id, piece, "in_progress", ""))
            elif self.kind != "function_call" or self.call is None or (
                    self.call.index != piece.index):
                continue  # (not the open call's: cannot happen, see above)
            if piece.arguments:
                self.text.append(piece.arguments)
                out += self.event("response.function_call_arguments.delta",
                                  item_id=self.item_id, output_index=len(self.output),
                                  delta=piece.arguments)
        return out

    def close(self, status: str = "completed") -> tuple[list[dict[str, Any]], str]:
        """The answer's output items, and the events that close them: the open item; a
        message item, empty if no content came, where there are no calls. The message or
        function call item closed here has the answer's ``status`` (``incomplete``: cut by
        ``max_output_tokens``; a call cut there may hold half its arguments)."""
        has_item = self.kind in ("message", "function_call") or any(
            i["type"] in ("message", "function_call") for i in self.output)
        out = self._open("message") if not has_item else ""
        out += self._close(status)
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
        if self.kind == "function_call":
            assert self.call is not None
            item = _call_item(item_id, self.call, status, text)
            out = self.event("response.function_call_arguments.done", item_id=item_id,
                             output_index=index, arguments=text)
        elif self.kind == "reasoning":
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
