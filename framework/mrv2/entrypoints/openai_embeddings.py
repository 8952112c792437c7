"""OpenAI's embeddings API (``POST /v1/embeddings``): each input's embedding, the final
hidden state of its last token (:class:`~mrv2.contract.pooling.PoolingParams`), normalized,
as vLLM serves a decoder embedding model (Qwen3-Embedding, GTE-Qwen2, E5-Mistral).

``input`` is a string, a list of strings, a token id list or a list of them (at most
:data:`MAX_INPUTS`), or, instead, ``messages``: one chat rendered by the chat template
(vLLM's chat form, :class:`InputRequest`); ``dimensions`` keeps the first so many entries
(Matryoshka models; others refuse it, as vLLM's) before normalizing; ``encoding_format``
``"base64"`` sends each vector as little-endian float32 bytes in base64, as OpenAI's client
asks by default. The inputs of one request run in the same steps (beside any generation
requests), each a prompt of its own.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mrv2.engine.request_inputs import last_tokens

__all__ = ["MAX_INPUTS", "EmbeddingRequest", "InputRequest", "PoolingRequest",
           "embedding_response", "input_items", "truncation"]

Texts = str | list[str] | list[int] | list[list[int]]

#: The most inputs one request may carry (OpenAI's limit).
MAX_INPUTS = 2048


def truncation(value: int | None) -> int | None:
    """A request's ``truncate_prompt_tokens`` as given: None, at least 1, or vLLM's -1 (as
    many as the context holds); ValueError (a 400 naming it) otherwise."""
    if value is not None and value < 1 and value != -1:
        raise ValueError("truncate_prompt_tokens must be at least 1, or -1 (the model's "
                         "context length)")
    return value


def input_items(value: str | list[str] | list[int] | list[list[int]], field: str
                ) -> list[str | list[int]]:
    """A text, a token id list, or a list of either, as a list of items; ValueError naming
    ``field`` when it is empty, holds an empty item, or more than :data:`MAX_INPUTS`."""
    items: list[str | list[int]]
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [list(value)]  # type: ignore[arg-type]  # (one token id list)
    else:
        items = list(value)  # type: ignore[arg-type]
    if not items or any(len(item) == 0 for item in items):
        raise ValueError(f"{field} must not be empty (nor hold an empty text or id list)")
    if len(items) > MAX_INPUTS:
        raise ValueError(f"{field} holds {len(items)} items; at most {MAX_INPUTS}")
    return items


class PoolingRequest(BaseModel):
    """What every pooling route's body has (embeddings, classify, score, rerank)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    model: str | None = None
    user: str | None = None
    #: Keep only the prompt's last k tokens; -1: as many as the context holds (vLLM's).
    truncate_prompt_tokens: int | None = None
    #: vLLM's: lower runs first under ``--scheduling-policy priority`` (0 under ``fcfs``).
    priority: int = 0

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        return truncation(value)

    def truncate(self, ids: list[int], longest: int) -> list[int]:
        """The last ``truncate_prompt_tokens`` ids (-1: ``longest``, the longest prompt the
        request may have: a pooling request's ``max_model_len``, as vLLM's), when set."""
        return last_tokens(ids, self.truncate_prompt_tokens, longest)


class InputRequest(PoolingRequest):
    """A body whose prompts are ``input`` (texts, token id lists) or, instead, one chat's
    ``messages`` through the chat template (vLLM's chat form of ``/v1/embeddings``,
    ``/classify`` and ``/pooling``: no generation prompt, no special tokens on top of the
    template's by default). ``add_special_tokens`` (None: yes for ``input``, no for
    ``messages``, vLLM's defaults) adds the tokenizer's special tokens (BOS...) to a text."""

    input: Texts | None = None
    #: Chat messages (checked as a chat request's where the route reads them).
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each ``input``: a text or a token id list; ValueError naming the field on an
        empty or too long list, or when ``input`` and ``messages`` are both given or
        neither (a chat body has no ``input``: the caller reads ``messages``)."""
        if (self.input is None) == (self.messages is None):
            raise ValueError("input or messages: give either input (texts or token ids) or "
                             "messages (a chat), not both or neither")
        if self.input is None:
            return []
        return input_items(self.input, "input")

    def special_tokens(self) -> bool:
        """Whether a text gets the tokenizer's special tokens (``add_special_tokens``, by
        default yes for ``input``, no for ``messages`` whose template has its own)."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class EmbeddingRequest(InputRequest):
    """``POST /v1/embeddings``' body."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None  # (vLLM's extra; None: the model's default)
    #: vLLM's newer name of ``normalize`` (the two may not disagree).
    use_activation: bool | None = None


def embedding_response(vectors: list[list[float]], num_prompt_tokens: int, model: str,
                       request_id: str, created: int, encoding_format: str
                       ) -> dict[str, Any]:
    """The API's answer for ``vectors`` (one per input, in input order)."""
    data = []
    for index, vector in enumerate(vectors):
        embedding: list[float] | str = vector
        if encoding_format == "base64":
            raw = np.asarray(vector, dtype="<f4").tobytes()
            embedding = base64.b64encode(raw).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}
