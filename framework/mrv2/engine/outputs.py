"""Result objects, with vLLM's names: ``RequestOutput`` holding ``CompletionOutput`` s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

    from mrv2.contract.lora import LoRARequest

#: A pooled result's ``outputs`` type.
Pooled = TypeVar("Pooled")
#: A pooled result's own class (:meth:`PooledRequestOutput.of`).
Result = TypeVar("Result", bound="PooledRequestOutput[Any]")


@dataclass
class Logprob:
    """One token's log-probability under the raw model distribution, as vLLM returns it."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token of the position."""
    decoded_token: str | None = None


#: Per position: ``{token_id: Logprob}`` for the chosen token and the top-k tokens.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """``"stop"`` (EOS, stop token or stop string), ``"length"``, ``"abort"``, or ``None``."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it; ``None`` for EOS or length."""
    cumulative_logprob: float | None = None
    """Sum of the generated tokens' logprobs (when ``logprobs`` was asked for)."""
    logprobs: list[PositionLogprobs] | None = None
    """One dict per generated token (when ``SamplingParams.logprobs`` is set)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request ran through (None: the base model), as vLLM's."""

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its output(s) so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens added since the previous output of this request (for streaming)."""
    new_text: str = ""
    """Text added since the previous output of this request (for streaming)."""
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Per prompt token (``None`` for the first), when ``SamplingParams.prompt_logprobs`` is set
    (of a ``delta`` request: in its first output only)."""
    delta: bool = False
    """True when ``outputs`` hold only what is new since this request's previous output
    (``SamplingParams.output_kind`` DELTA): each choice's text, token ids and logprobs go on
    from its previous ones, and a choice with nothing new may be absent (``n > 1``)."""
    embedding: list[Any] | None = None
    """An embedding request's pooled vector (``pooling_params``; its ``outputs`` hold a
    token nobody asked for); a per-token request's: one row per prompt token."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request ran through (None: the base model), as vLLM's (in
    process: ``mrv2 serve``'s engine process does not send it back)."""
    time_in_queue: float | None = None
    """Seconds from the request's arrival at the engine to its first step (of ``n > 1``
    samples: the first sample's), in its finished output only (None before)."""

    def add(self, later: RequestOutput) -> None:
        """Fold ``later``, this request's next output, into this one (changed in place), as
        if the two had been one output: a consumer that fell behind hands on one output for
        several. A cumulative ``later`` stands for both; a delta one is appended."""
        if later is self:
            return
        if later.request_id != self.request_id or later.delta != self.delta:
            raise ValueError(f"cannot fold an output of {later.request_id!r} (delta="
                             f"{later.delta}) into one of {self.request_id!r} (delta="
                             f"{self.delta})")
        self.finished, self.num_cached_tokens = later.finished, later.num_cached_tokens
        if later.time_in_queue is not None:
            self.time_in_queue = later.time_in_queue
        if later.embedding is not None:
            self.embedding = later.embedding
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if not later.delta:
            self.outputs = later.outputs
            self.new_token_ids = self.new_token_ids + later.new_token_ids
            self.new_text += later.new_text
            return
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            have = mine.get(c.index)
            if have is None:  # (a copy: ``later`` stays as it was)
                mine[c.index] = dataclasses.replace(c)
                continue
            have.text += c.text
            have.token_ids = have.token_ids + c.token_ids
            if c.logprobs is not None:
                have.logprobs = (have.logprobs or []) + c.logprobs
            have.finish_reason, have.stop_reason = c.finish_reason, c.stop_reason
            have.cumulative_logprob = c.cumulative_logprob
        self.outputs = [mine[i] for i in sorted(mine)]
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text


@dataclass
class EmbeddingOutput:
    """An embedding request's vector (vLLM's name)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The vector's length."""
        return len(self.embedding)


@dataclass
class PooledRequestOutput(Generic[Pooled]):
    """One prompt's result of a pooling call (``LLM.embed``, ``classify``, ``encode``): its
    id, its pooled ``outputs``, the tokens the model read."""

    request_id: str
    outputs: Pooled
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def of(cls: type[Result], output: RequestOutput, make: Callable[[list[Any]], Any]
           ) -> Result:
        """The pooling request's engine output as this result, ``make`` building its
        ``outputs`` from the pooled vector (or rows)."""
        return cls(output.request_id, make(output.embedding or []), output.prompt_token_ids,
                   True, output.num_cached_tokens)


class EmbeddingRequestOutput(PooledRequestOutput[EmbeddingOutput]):
    """What ``LLM.embed`` returns per prompt (vLLM's shape: ``output.outputs.embedding``)."""


@dataclass
class ClassificationOutput:
    """A classification request's label probabilities (vLLM's name)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many labels the classifier has."""
        return len(self.probs)


class ClassificationRequestOutput(PooledRequestOutput[ClassificationOutput]):
    """What ``LLM.classify`` returns per prompt (``output.outputs.probs``)."""


@dataclass
class PoolingOutput:
    """A pooling request's vector as a tensor (vLLM's ``PoolingOutput.data``): an embedding,
    or a classifier's label probabilities."""

    data: torch.Tensor


class PoolingRequestOutput(PooledRequestOutput[PoolingOutput]):
    """What ``LLM.encode`` returns per prompt (``output.outputs.data``)."""


@dataclass
class ScoringOutput:
    """A pair's score (vLLM's name): a classifier's probability, or two embeddings' cosine
    similarity."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (``output.outputs.score``); ``prompt_token_ids``:
    the pair's tokens as the model read them (a classifier's concatenation; both texts' for
    an embedding model)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
