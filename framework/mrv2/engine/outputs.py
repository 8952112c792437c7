"""Result objects, with vLLM's names: ``RequestOutput`` holding ``CompletionOutput`` s."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Per prompt token (``None`` for the first), when ``SamplingParams.prompt_logprobs`` is set."""
