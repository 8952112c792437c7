"""The Responses API's stored responses (``MRV2_ENABLE_RESPONSES_API_STORE=1``, as vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE``): answers to requests with ``store`` (the API's default)
are kept in this process's memory, so a later request continues the conversation with
``previous_response_id`` and ``GET /v1/responses/{id}`` / ``DELETE /v1/responses/{id}``
read and remove them.

A stored response keeps its conversation as chat messages: the earlier turns, the request's
input and the answer (its message text, function calls and reasoning: a continuation's prompt
keeps the reasoning of the turn under way only, :mod:`mrv2.entrypoints.responses_context`).
A continuation's ``instructions`` are its own, not carried over, as in OpenAI's API. The store
holds the :data:`DEFAULT_CAPACITY` most recent responses (``MRV2_RESPONSES_API_STORE_SIZE``),
dropping the oldest first: it is memory, not a database, and lost when the server stops.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: ``1`` keeps responses for ``previous_response_id`` and the retrieve/delete routes.
STORE_ENV = "MRV2_ENABLE_RESPONSES_API_STORE"
#: How many responses the store keeps (the oldest dropped first).
SIZE_ENV = "MRV2_RESPONSES_API_STORE_SIZE"
DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class StoredResponse:
    """A response object as answered, and its conversation as chat messages (without the
    request's instructions)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """The most recent ``capacity`` stored responses, by id (thread-safe)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"{SIZE_ENV} must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = StoredResponse(response, messages)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None


def store_from_env() -> ResponseStore | None:
    """A store when ``MRV2_ENABLE_RESPONSES_API_STORE=1`` (its size from
    ``MRV2_RESPONSES_API_STORE_SIZE``), else None; ValueError on a bad size."""
    if os.environ.get(STORE_ENV, "").strip().lower() not in ("1", "true"):
        return None
    size = os.environ.get(SIZE_ENV, "").strip()
    try:
        capacity = int(size) if size else DEFAULT_CAPACITY
    except ValueError:
        raise ValueError(f"{SIZE_ENV}={size!r} is not an integer") from None
    return ResponseStore(capacity)
