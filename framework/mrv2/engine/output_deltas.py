"""Streamed outputs as deltas, and back: what crosses from the engine's process to the
server's (:mod:`mrv2.entrypoints.engine_core`), and what ``mrv2 bench outputs`` times.

A cumulative ``RequestOutput`` holds the prompt's ids and every token so far, so pickling
whole outputs each step would cost O(tokens so far) a stream: :class:`DeltaEncoder` (the
engine's side) sends what changed, :class:`OutputAccumulator` (the server's side) rebuilds
the cumulative outputs. A request with ``output_kind`` DELTA (the server's) is a delta
already: it crosses as it is and neither side keeps anything of it.
"""

from __future__ import annotations

from typing import Any

from mrv2.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["ChoiceDelta", "DeltaEncoder", "OutputAccumulator", "OutputDelta"]

#: One choice's change since the last message: (index, new token ids, text start, text from
#: there, finish reason, stop reason, new logprobs or None, cumulative logprob). The text
#: starts before the end of what was sent when a stop string cut it back.
ChoiceDelta = tuple[int, list[int], int, str, "str | None", "int | str | None",
                    "list[Any] | None", "float | None"]
#: One request's change: (request id, finished, its choices' deltas, its prompt's tokens
#: found in the prefix cache, whether the request's outputs are deltas, its prompt logprobs
#: (in its first message only; None otherwise or when not asked for), an embedding
#: request's vector (None otherwise, or not yet), its time in queue (seconds; in its finished
#: message, else None)).
OutputDelta = tuple[str, bool, list[ChoiceDelta], int, bool, "list[Any] | None",
                    "list[float] | None", "float | None"]


class DeltaEncoder:
    """(child) Turns cumulative ``RequestOutput`` s into deltas against what was sent."""

    def __init__(self) -> None:
        #: (request id, choice index) -> (tokens, text length, logprobs) already sent
        self._sent: dict[tuple[str, int], tuple[int, int, int]] = {}
        #: cumulative requests whose prompt logprobs went with an earlier message
        self._prompt_sent: set[str] = set()

    def encode(self, output: RequestOutput) -> OutputDelta:
        choices: list[ChoiceDelta] = []
        if output.delta:  # (a delta request's output: nothing to keep)
            choices = [(c.index, c.token_ids, 0, c.text, c.finish_reason, c.stop_reason,
                        c.logprobs, c.cumulative_logprob) for c in output.outputs]
            return (output.request_id, output.finished, choices, output.num_cached_tokens,
                    True, output.prompt_logprobs, output.embedding, output.time_in_queue)
        prompt = None
        if output.prompt_logprobs is not None and output.request_id not in self._prompt_sent:
            prompt = output.prompt_logprobs
            self._prompt_sent.add(output.request_id)
        for c in output.outputs:
            key = (output.request_id, c.index)
            tokens, text, num_lp = self._sent.get(key, (0, 0, 0))
            start = min(text, len(c.text))
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[num_lp:]
                num_lp = len(c.logprobs)
            choices.append((c.index, c.token_ids[tokens:], start, c.text[start:],
                            c.finish_reason, c.stop_reason, logprobs, c.cumulative_logprob))
            self._sent[key] = (len(c.token_ids), len(c.text), num_lp)
        if output.finished:
            for c in output.outputs:
                self._sent.pop((output.request_id, c.index), None)
            self._prompt_sent.discard(output.request_id)
        return (output.request_id, output.finished, choices, output.num_cached_tokens, False,
                prompt, output.embedding, output.time_in_queue)

    def forget(self, request_id: str) -> None:
        """An aborted request: drop what was sent of it."""
        for key in [k for k in self._sent if k[0] == request_id]:
            del self._sent[key]
        self._prompt_sent.discard(request_id)


class OutputAccumulator:
    """(parent) Rebuilds each request's cumulative ``RequestOutput`` from deltas, in place:
    the one object of a request is updated and handed on again (outputs are cumulative, so a
    reader that sees a later state has lost nothing). A delta request's output is rebuilt as
    it came, a new object each time, and nothing of it is kept."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def apply(self, delta: OutputDelta) -> RequestOutput:
        req_id, finished, choices, cached, is_delta, prompt, embedding, queued = delta
        if is_delta:  # a delta request's output, as the engine made it
            outs = [CompletionOutput(index, text, ids, reason, stop, cumulative, logprobs)
                    for index, ids, _, text, reason, stop, logprobs, cumulative in choices]
            return RequestOutput(request_id=req_id, prompt=None, prompt_token_ids=[],
                                 outputs=outs, finished=finished,
                                 new_token_ids=[t for c in outs for t in c.token_ids],
                                 new_text="".join(c.text for c in outs),
                                 num_cached_tokens=cached, prompt_logprobs=prompt, delta=True,
                                 embedding=embedding, time_in_queue=queued)
        output = self._outputs.get(req_id)
        if output is None:
            output = RequestOutput(request_id=req_id, prompt=None, prompt_token_ids=[],
                                   outputs=[], finished=False)
            self._outputs[req_id] = output
        by_index = {c.index: c for c in output.outputs}
        new_ids: list[int] = []
        for index, ids, start, text, reason, stop, logprobs, cumulative in choices:
            c = by_index.get(index)
            if c is None:
                c = CompletionOutput(index=index, text="", token_ids=[])
                by_index[index] = c
                output.outputs = [by_index[i] for i in sorted(by_index)]
            c.token_ids.extend(ids)
            c.text = c.text + text if start == len(c.text) else c.text[:start] + text
            c.finish_reason, c.stop_reason, c.cumulative_logprob = reason, stop, cumulative
            if logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(logprobs)
            new_ids.extend(ids)
        output.new_token_ids = new_ids
        output.finished = finished
        output.num_cached_tokens = cached
        output.time_in_queue = queued
        if prompt is not None:
            output.prompt_logprobs = prompt
        if embedding is not None:
            output.embedding = embedding
        if finished:
            del self._outputs[req_id]
        return output

    def forget(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)
