"""Requests the server answers whole, never streamed, from their final outputs alone:
embeddings (``/v1/embeddings``) and beam search (``use_beam_search``: each step's beams are
one-token requests). :func:`final_outputs` submits a batch of prompts through the server's
worker and waits for each one's final output; the rest turn those into API answers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import PoolingParams
from mrv2.engine.beam_search import BeamSearch, BeamSearchOutput
from mrv2.engine.outputs import RequestOutput
from mrv2.entrypoints.engine_process import EngineProcess
from mrv2.entrypoints.engine_thread import EngineThread, QueueFullError
from mrv2.entrypoints.reasoning import keeps_special_tokens, split_reasoning
from mrv2.entrypoints.responses import APIError, disconnected

__all__ = ["beam_answer_body", "beam_search_through", "embed_through", "final_outputs",
           "unless_disconnected"]

T = TypeVar("T")


async def final_outputs(worker: EngineThread | EngineProcess, prompts: list[list[int]],
                        params: SamplingParams, lora: LoRARequest | None = None,
                        pooling: PoolingParams | None = None, kind: str = "req",
                        param: str = "prompt", cache_salt: str | None = None,
                        priority: int = 0) -> list[RequestOutput]:
    """Submit every prompt (through adapter ``lora``; embedding requests with ``pooling``;
    salted with ``cache_salt``; scheduled by ``priority``) and return each one's final
    output, in order. Refused by the engine: a 400 naming
    ``param``; a full server: 503; a failed engine: 500. If one is refused, or the client
    leaves, every request of the batch not yet finished is aborted."""
    loop = asyncio.get_running_loop()
    sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    base = f"{kind}-{uuid.uuid4().hex}"
    req_ids = [f"{base}-{i}" for i in range(len(prompts))]
    finals: dict[str, RequestOutput] = {}
    submitted: list[str] = []
    try:
        for req_id, ids in zip(req_ids, prompts, strict=True):
            await worker.admit(req_id, ids, params, None, sink, loop, None, lora, pooling,
                               cache_salt, priority)
            submitted.append(req_id)
        while len(finals) < len(req_ids):
            item = await sink.get()
            if isinstance(item, BaseException):
                raise APIError(500, f"internal error: {item}", "server_error")
            if item.finished:
                finals[item.request_id] = item
    except QueueFullError as error:
        raise APIError(503, str(error), "service_unavailable") from None
    except ValueError as error:  # the engine in its own process refused it
        raise APIError(400, str(error), param=param) from None
    finally:
        for req_id in submitted:
            if req_id not in finals:
                worker.abort(req_id)
    return [finals[req_id] for req_id in req_ids]


async def embed_through(worker: EngineThread | EngineProcess, prompts: list[list[int]],
                        params: SamplingParams, lora: LoRARequest | None,
                        pooling: PoolingParams, priority: int = 0) -> list[list[float]]:
    """Each prompt's embedding, in order (one embedding request a prompt, scheduled by
    ``priority``)."""
    outputs = await final_outputs(worker, prompts, params, lora, pooling, "embd", "input",
                                  priority=priority)
    return [output.embedding or [] for output in outputs]


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, or None when the client disconnects first: ``work`` is then
    cancelled (:func:`final_outputs` aborts the requests it has in flight) before this
    returns."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    left = True
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        left = not task.done()
    finally:  # (also when this request's own task is cancelled)
        gone.cancel()
        if left:
            task.cancel()
            await asyncio.wait((task,))  # its requests aborted before this returns
    return None if left else task.result()


async def beam_search_through(worker: EngineThread | EngineProcess, search: BeamSearch,
                              lora: LoRARequest | None, cache_salt: str | None = None,
                              priority: int = 0) -> list[BeamSearchOutput]:
    """Beam search (vLLM's ``use_beam_search``) through the worker: each step's beams of
    ``search`` as one-token requests, salted with ``cache_salt``, scheduled by
    ``priority``."""
    while requests := search.requests():
        outputs = await final_outputs(worker, requests, search.step_params, lora, kind="beam",
                                      cache_salt=cache_salt, priority=priority)
        search.advance([(o.outputs[0].logprobs or [{}])[0] if o.outputs else {}
                        for o in outputs])
    return search.outputs()


def beam_answer_body(outputs: list[BeamSearchOutput], prompts: list[list[int]],
                     tokenizer: Any, model: str, chat: bool,
                     reasoning: str | None = None, role: str = "assistant") -> dict[str, Any]:
    """The completions (or, with ``chat``, chat completions) answer of beam search: each
    prompt's beams as choices, best first (a chat message's role ``role``)."""
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    skip = not (chat and keeps_special_tokens(reasoning))  # (the parser reads the markers)
    for output in outputs:
        for beam in output.sequences:
            completion_tokens += len(beam.output_tokens)
            text = (tokenizer.decode(beam.output_tokens, skip_special_tokens=skip)
                    if tokenizer is not None else "")
            # (a running index: a structured output may leave a prompt fewer than n beams)
            choice: dict[str, Any] = {"index": len(choices),
                                      "logprobs": None, "finish_reason": beam.finish_reason,
                                      "stop_reason": None}
            if chat:
                thought, content = (split_reasoning(reasoning, text) if reasoning
                                    else (None, text))
                choice["message"] = {"role": role, "content": content,
                                     "reasoning_content": thought, "tool_calls": []}
            else:
                choice["text"] = text
            choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
