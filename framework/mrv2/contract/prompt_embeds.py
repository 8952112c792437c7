"""Prompt embeddings as input (vLLM's ``enable_prompt_embeds``): a prompt given as a
``[length, hidden_size]`` tensor instead of token ids.

Such a prompt travels as one :class:`~mrv2.contract.requests.MultiModalItem` of kind
:data:`PROMPT_EMBEDS_KIND` covering every prompt position (its placeholder token ids are
:data:`PLACEHOLDER_TOKEN_ID`), so it reaches the runner the way media do: a digest of each
block's rows keys the prefix cache (:func:`rows_digest`: a prompt of embeddings never shares
KV blocks with a token prompt, only with embeddings whose leading rows are the same), chunked
prefill splits it like any item, and a preempted request brings it back. The runner keeps it
out of the family's :class:`ModelState` item hooks (:func:`split_prompt_embeds`) and holds it
in the state's :class:`PromptEmbedsRows`: copied to the device once, when the request takes
its row; each step that computes some of its rows gets them spliced over the token
embeddings in ``ModelState.prepare_inputs`` (those steps run eager, as steps with media do).
Generated tokens go through the ordinary token embedding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Any

import numpy as np
import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.requests import MultiModalEmbeddings, MultiModalItem, NewRequest
from mrv2.contract.staging import to_device

__all__ = ["PLACEHOLDER_TOKEN_ID", "PROMPT_EMBEDS_KIND", "PromptEmbedsRows",
           "check_given_embeds", "check_prompt_embeds_support", "embeds_prompt",
           "rows_digest", "prompt_embeds_item", "split_prompt_embeds"]

PROMPT_EMBEDS_KIND = "prompt_embeds"
"""The :class:`MultiModalItem` kind of a prompt given as embeddings."""

PLACEHOLDER_TOKEN_ID = 0
"""The token id standing for each embedding row in the state table (its embedding is replaced
before the model reads it)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OFF = ("prompt_embeds: this engine takes no prompt embeddings; start it with "
        "--enable-prompt-embeds (LLM(..., enable_prompt_embeds=True))")


def prompt_embeds_item(embeds: Any, hidden_size: int, max_model_len: int,
                       field: str = "prompt_embeds") -> MultiModalItem:
    """The item of a prompt given as embeddings, checked: a float32 / bfloat16 / float16
    tensor of shape ``[length, hidden_size]`` (``[1, length, hidden_size]`` is taken too, as
    vLLM's), dense, not empty, shorter than ``max_model_len`` (room for one generated token)
    and finite. ValueErrors name ``field``. The item holds a contiguous CPU copy (hashed as the
    prefix cache fills: :func:`rows_digest`)."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"{field} must be a torch.Tensor of shape [length, hidden_size]; got "
                         f"{type(embeds).__name__}")
    if embeds.layout is not torch.strided:
        embeds = embeds.to_dense()
    if embeds.dtype not in _DTYPES:
        raise ValueError(f"{field} must be float32, bfloat16 or float16; got {embeds.dtype}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2:
        raise ValueError(f"{field} must be a 2-D tensor of shape [length, hidden_size="
                         f"{hidden_size}]; got shape {list(embeds.shape)}")
    length, width = embeds.shape
    if width != hidden_size:
        raise ValueError(f"{field} has hidden size {width}; the model's is {hidden_size}")
    if length == 0:
        raise ValueError(f"{field} is empty (0 rows)")
    if length >= max_model_len:
        raise ValueError(f"{field} has {length} rows; max_model_len={max_model_len} leaves room "
                         f"for at most {max_model_len - 1} (and one generated token)")
    embeds = embeds.detach().to("cpu", copy=True).contiguous()  # (the caller's may change)
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError(f"{field} holds non-finite values (inf or nan)")
    digest = hashlib.sha256(str((embeds.dtype, tuple(embeds.shape))).encode())
    digest.update(embeds.view(torch.uint8).numpy().tobytes())
    return MultiModalItem(PROMPT_EMBEDS_KIND, embeds, "embeds:" + digest.hexdigest(), 0,
                          int(length))


def rows_digest(item: MultiModalItem, start: int, end: int) -> tuple[str, str]:
    """The prefix-cache key of prompt positions ``start .. end - 1`` of a prompt given as
    embeddings: a digest of those rows' bytes (with the item's dtype and width)."""
    data: torch.Tensor = item.data
    rows = data[max(start - item.offset, 0): max(end - item.offset, 0)]
    digest = hashlib.sha256(str((data.dtype, data.shape[1])).encode())
    digest.update(rows.contiguous().view(torch.uint8).numpy().tobytes())
    return PROMPT_EMBEDS_KIND, digest.hexdigest()


def embeds_prompt(prompt: dict[str, Any], engine: Any) -> tuple[list[int], MultiModalItem]:
    """A prompt dict with ``"prompt_embeds"`` (vLLM's EmbedsPrompt) for ``engine`` (its
    ``config``, ``hidden_size`` and ``max_model_len``): its placeholder token ids and its item;
    ValueErrors naming the field (the flag off, other prompt fields, bad rows)."""
    if not engine.config.model.enable_prompt_embeds:
        raise ValueError(_OFF)
    others = sorted(set(prompt) & {"prompt", "prompt_token_ids", "multi_modal_data"})
    if others:
        raise ValueError(f"prompt_embeds: a prompt given as embeddings takes no {others}")
    item = prompt_embeds_item(prompt["prompt_embeds"], engine.hidden_size, engine.max_model_len)
    return [PLACEHOLDER_TOKEN_ID] * item.length, item


def check_given_embeds(items: list[MultiModalItem], prompt_token_ids: list[int],
                       prompt_logprobs: int | None, enabled: bool, hidden_size: int) -> bool:
    """Whether a request's prompt is given as embeddings (its ``items`` hold a
    :data:`PROMPT_EMBEDS_KIND` one), checked where the engine queues it: ValueErrors naming
    the field where the engine runs without ``enable_prompt_embeds``, the rows don't fit the
    model or the prompt, it comes with other items, or it asks for ``prompt_logprobs``
    (there are no prompt tokens to score)."""
    given = [item for item in items if item.kind == PROMPT_EMBEDS_KIND]
    if not given:
        return False
    if not enabled:
        raise ValueError(_OFF)
    item = given[0]
    data = item.data
    if (len(items) != 1 or item.offset != 0 or item.length != len(prompt_token_ids)
            or not isinstance(data, torch.Tensor) or data.dim() != 2
            or data.shape[0] != item.length):
        raise ValueError("prompt_embeds: one item covering the whole prompt (made by "
                         "mrv2.contract.prompt_embeds.prompt_embeds_item), and nothing else")
    if data.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds has hidden size {data.shape[1]}; the model's is "
                         f"{hidden_size}")
    if prompt_logprobs is not None:
        raise ValueError("prompt_logprobs: not with prompt_embeds (a prompt given as "
                         "embeddings has no tokens to score)")
    return True


def split_prompt_embeds(request: NewRequest) -> tuple[NewRequest, MultiModalItem | None]:
    """``request`` without its prompt-embeddings item (what the family's ModelState sees),
    and that item (None: a token prompt, ``request`` itself)."""
    item = next((i for i in request.mm_items if i.kind == PROMPT_EMBEDS_KIND), None)
    if item is None:
        return request, None
    rest = [i for i in request.mm_items if i is not item]
    return dataclasses.replace(request, mm_items=rest), item


def check_prompt_embeds_support(model: Any, state: Any, architecture: str) -> None:
    """ValueError naming ``architecture`` where prompt embeddings can't reach the model: it
    has no ``embed_input_ids``, its ``forward`` takes no ``inputs_embeds``, or it or its
    ModelState says ``prompt_embeds_supported = False`` (what it computes reads the prompt's
    token ids beyond their embeddings)."""
    forward = getattr(model, "forward", None)
    takes = forward is not None and "inputs_embeds" in inspect.signature(forward).parameters
    if (not callable(getattr(model, "embed_input_ids", None)) or not takes
            or not getattr(model, "prompt_embeds_supported", True)
            or not getattr(state, "prompt_embeds_supported", True)):
        raise ValueError(f"enable_prompt_embeds: the {architecture} model takes no prompt "
                         "embeddings (its model or ModelState can't replace token "
                         "embeddings); start without --enable-prompt-embeds")


class PromptEmbedsRows:
    """The prompt embeddings of the requests in the state table, on the device (module doc):
    one tensor a row, dropped once a step computes its last row."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        #: What given rows are multiplied by on arrival, in the model dtype (the model's
        #: ``prompt_embeds_scale``: Granite's HF models scale ``inputs_embeds``; set by the
        #: runner at start-up).
        self.scale = 1.0
        self._rows: dict[int, tuple[str, torch.Tensor]] = {}
        #: The last step's key and rows: the same step asked again gets the same rows (the
        #: first call let go of the requests it finished), as the encoder cache's.
        self._last: tuple[tuple[Any, ...], MultiModalEmbeddings | None] | None = None

    def add(self, row: int, req_id: str, item: MultiModalItem, num_computed: int) -> None:
        """Hold ``item``'s rows for request ``req_id`` in ``row`` (already ``num_computed``
        tokens computed: a prefix-cache hit or a resumed request), copied to the device now."""
        self._rows.pop(row, None)
        self._last = None
        if num_computed >= item.length:
            return
        data: torch.Tensor = item.data
        if self.device.type == "cuda":
            data = data.pin_memory()
        rows = data.to(self.device, non_blocking=True).to(self.dtype)
        self._rows[row] = (req_id, rows * self.scale if self.scale != 1.0 else rows)

    def remove(self, row: int) -> None:
        """The request in ``row`` left."""
        self._rows.pop(row, None)
        self._last = None

    def graph_allowed(self, rows: list[int], num_computed: list[int],
                      query_lens: list[int]) -> bool:
        """False where the step computes an embedding row (it runs eager)."""
        if not self._rows:
            return True
        for row, first, _ in zip(rows, num_computed, query_lens, strict=True):
            held = self._rows.get(row)
            if held is not None and first < held[1].shape[0]:
                return False
        return True

    def step_rows(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """The embedding rows this step computes with their rows of the flat step batch (None:
        none); a request whose last embedding row is computed here lets go of them."""
        if not self._rows and self._last is None:
            return None
        n = batch.num_reqs
        key = (tuple(batch.req_ids[:n]), batch.idx_mapping_cpu[:n].tobytes(),
               batch.num_computed_cpu[:n].tobytes(), batch.query_start_loc_cpu[: n + 1].tobytes())
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        result = self._step_rows(batch) if self._rows else None
        self._last = (key, result) if result is not None else None
        return result

    def _step_rows(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        indices: list[np.ndarray] = []
        parts: list[torch.Tensor] = []
        for i in range(batch.num_reqs):
            row = int(batch.idx_mapping_cpu[i])
            held = self._rows.get(row)
            if held is None or held[0] != batch.req_ids[i]:  # (a dummy batch's rows: none)
                continue
            embeds = held[1]
            first = int(batch.num_computed_cpu[i])
            start = int(batch.query_start_loc_cpu[i])
            count = int(batch.query_start_loc_cpu[i + 1]) - start
            end = min(first + count, embeds.shape[0])
            if first >= end:
                continue
            parts.append(embeds[first:end])
            indices.append(np.arange(start, start + end - first))
            if end == embeds.shape[0]:
                del self._rows[row]  # (the slice keeps the rows alive for this step)
        if not parts:
            return None
        return MultiModalEmbeddings(to_device(np.concatenate(indices), torch.int64, self.device),
                                    parts[0] if len(parts) == 1 else torch.cat(parts))
