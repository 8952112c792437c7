"""``/v1/completions``' ``prompt_embeds`` (vLLM's): each a base64 string of a ``torch.save``'d
``[length, hidden_size]`` tensor, read with ``torch.load(weights_only=True)`` (no pickled
code runs) and checked as :func:`mrv2.contract.prompt_embeds.prompt_embeds_item` checks an
offline prompt's tensor, before the engine sees it. Every error names the field; with the
engine's ``enable_prompt_embeds`` off, the first thing said is how to turn it on."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from mrv2.contract.prompt_embeds import PLACEHOLDER_TOKEN_ID, prompt_embeds_item
from mrv2.contract.requests import MultiModalItem

__all__ = ["load_prompt_embeds"]


def load_prompt_embeds(value: str | list[str], engine: Any
                       ) -> list[tuple[list[int], MultiModalItem]]:
    """Placeholder token ids and the item of each prompt in ``value`` (one base64 string or a
    list of them) for ``engine`` (its ``config``, ``hidden_size`` and ``max_model_len``).
    ValueErrors name ``prompt_embeds`` (``prompt_embeds[i]`` for a list's item)."""
    if not engine.config.model.enable_prompt_embeds:
        raise ValueError("prompt_embeds: this server takes no prompt embeddings; start it with "
                         "--enable-prompt-embeds")
    many = isinstance(value, list)
    values = value if many else [value]
    if not values:
        raise ValueError("prompt_embeds is an empty list")
    loaded = []
    for i, text in enumerate(values):
        field = f"prompt_embeds[{i}]" if many else "prompt_embeds"
        item = prompt_embeds_item(_tensor(text, field), engine.hidden_size,
                                  engine.max_model_len, field)
        loaded.append(([PLACEHOLDER_TOKEN_ID] * item.length, item))
    return loaded


def _tensor(text: Any, field: str) -> Any:
    """The object ``torch.load`` reads from base64 ``text`` (weights only, on the CPU, sparse
    tensors' invariants checked)."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a base64 string; got {type(text).__name__}")
    try:
        payload = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} is not valid base64") from None
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(payload), weights_only=True,
                                map_location=torch.device("cpu"))
            if isinstance(tensor, torch.Tensor) and tensor.layout is not torch.strided:
                tensor = tensor.to_dense()
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # (the bytes the client sent: its error, bounded)
        reason = (str(error).strip() or type(error).__name__)[:200]
        raise ValueError(f"{field} is not a torch.save'd tensor ({reason})") from None
    return tensor
