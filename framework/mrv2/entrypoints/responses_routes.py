"""OpenAI's Responses API routes over the chat path (:func:`~mrv2.entrypoints.
completion_routes.run_chat`): ``POST /v1/responses`` (its request and answers:
:mod:`mrv2.entrypoints.openai_responses`), and, with the store on
(``MRV2_ENABLE_RESPONSES_API_STORE=1``, :mod:`mrv2.entrypoints.responses_store`), ``GET`` and
``DELETE /v1/responses/{response_id}`` and ``previous_response_id``; ``truncation: "auto"``
drops a conversation's first messages until its prompt leaves room for the answer
(:func:`truncated`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from mrv2.entrypoints.completion_routes import run_chat
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, value_error_param
from mrv2.entrypoints.openai_responses import RENAMED, ResponsesRequest, ResponsesStream
from mrv2.entrypoints.responses import APIError
from mrv2.entrypoints.responses_store import STORE_ENV, ResponseStore
from mrv2.entrypoints.serving import Serving

__all__ = ["add_responses_routes", "truncated"]


def add_responses_routes(app: FastAPI, serving: Serving, stored: ResponseStore | None
                         ) -> None:
    """Add ``/v1/responses`` and ``/v1/responses/{response_id}`` (``GET``, ``DELETE``) to
    ``app``, over ``serving``'s engine and helpers; ``stored``: the responses kept (None:
    the store is off)."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API over the chat path (text in and out; see
        :mod:`mrv2.entrypoints.openai_responses`)."""
        body: ResponsesRequest = await serving.parse(request, ResponsesRequest)
        previous = None
        if body.previous_response_id is not None:
            if stored is None:
                raise APIError(400, "previous_response_id: this server stores no responses "
                               f"(start it with {STORE_ENV}=1)", param="previous_response_id")
            record = stored.get(body.previous_response_id)
            if record is None:
                raise APIError(404, f"no stored response has the id "
                               f"{body.previous_response_id!r}", "not_found_error",
                               "previous_response_id")
            previous = record.messages
        # (gpt-oss: its template reads a call's analysis from the message's thinking)
        harmony = serving.harmony
        try:
            chat_body = body.as_chat(previous, harmony)
        except ValueError as error:
            raise APIError(400, str(error), param=value_error_param(str(error), body)) from None
        except ValidationError as error:  # a message the chat request refuses
            raise APIError(400, f"input: {error.errors()[0]['msg']}", param="input") from None
        try:
            if body.truncation == "auto":
                chat_body = await truncated(serving, body, previous, harmony, chat_body)
            keep = stored if body.store else None
            return await run_chat(serving, request, chat_body, ResponsesStream, {
                "request": body, "store": keep,
                "conversation": body.conversation(previous) if keep is not None else None})
        except APIError as error:  # the chat request's field names, as this API calls them
            name = error.param or ""
            sent = RENAMED.get(name, name)
            if sent != name and error.message.startswith(f"{name}="):
                error.message = sent + error.message[len(name):]
            error.param = sent if error.param is not None else None
            raise

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response (the store on: ``MRV2_ENABLE_RESPONSES_API_STORE=1``)."""
        record = stored.get(response_id) if stored is not None else None
        if record is None:
            raise APIError(404, f"no stored response has the id {response_id!r}",
                           "not_found_error", "response_id")
        return record.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        if stored is None or not stored.delete(response_id):
            raise APIError(404, f"no stored response has the id {response_id!r}",
                           "not_found_error", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


async def truncated(serving: Serving, body: ResponsesRequest,
                    previous: list[dict[str, Any]] | None, harmony: bool,
                    whole: ChatCompletionRequest) -> ChatCompletionRequest:
    """``truncation: "auto"``: the chat request of ``body`` (``whole``: all of its
    conversation) without the fewest first messages (:meth:`ResponsesRequest.
    truncation_cuts`) that leave its prompt room for the answer (what
    ``truncate_prompt_tokens: -1`` keeps). Where none does, the most cut: too long for
    the context even so, a 400 naming ``input``; else :meth:`Serving.validate` names the
    ``max_output_tokens`` that leaves it no room. Fewer dropped never makes a prompt
    shorter: a binary search."""
    keep = serving.room(whole, serving.params_of(whole))
    max_model_len = serving.engine.max_model_len

    async def size(drop: int) -> int:
        chat = whole if drop == 0 else body.as_chat(previous, harmony, drop)
        return len((await serving.prompt_ids(chat))[0])

    cuts = body.truncation_cuts(previous)
    if await size(0) <= keep:
        return whole
    least = await size(cuts[-1])
    if least >= max_model_len:
        raise APIError(400, f"input: too long for this model's context (max_model_len "
                       f"{max_model_len}) even with truncation \"auto\": what it "
                       "keeps (the last message, the instructions and the system messages "
                       f"the conversation opens with) is a prompt of {least} tokens",
                       param="input")
    if least > keep:
        return body.as_chat(previous, harmony, cuts[-1])
    low, high = 1, len(cuts) - 1  # (cuts[high] fits, cuts[0] does not)
    while low < high:
        mid = (low + high) // 2
        if await size(cuts[mid]) <= keep:
            high = mid
        else:
            low = mid + 1
    return body.as_chat(previous, harmony, cuts[high])
