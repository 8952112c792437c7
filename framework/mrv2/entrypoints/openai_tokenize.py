"""The bodies of vLLM's ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mrv2.entrypoints.openai_messages import ChatMessage


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a text ``prompt``, or chat ``messages`` through the
    model's chat template."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    #: The tokenizer's special tokens added: by default to a ``prompt`` and not to the
    #: rendered ``messages`` (vLLM's two tokenize requests' defaults, true and false).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    #: Offered to the chat template, as a chat request's would be.
    tools: list[dict[str, Any]] | None = None
    #: Refused, as a chat request's
    #: (:attr:`~mrv2.entrypoints.openai_protocol.ChatCompletionRequest.chat_template`).
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    model: str | None = None
    tokens: list[int]


TokenizeRequest.model_rebuild()
