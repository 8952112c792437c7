"""``SamplingParams``: per-request sampling settings, with vLLM's names and meanings.

Validation happens at construction, so a bad request fails before any work starts, with a
message naming the field and the allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass

_GREEDY_EPS = 1e-5

# Fields accepted for API compatibility but not implemented yet; a non-default value is refused
# rather than silently ignored.
_NOT_YET = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
}


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, per request (vLLM's names).

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p == 1`` disables
    top-p. ``seed`` makes the request's samples reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n == 1, "n", self.n,
               "1 (n > 1 is not supported yet)")
        _check(_is_number(self.temperature) and self.temperature >= 0.0, "temperature",
               self.temperature, "a number >= 0 (0 means greedy)")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p,
               "a number in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k,
               "an integer >= 1, or 0 / -1 to disable")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
               "a number in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               "seed", self.seed, "None or an integer in [0, 2**63)")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                           and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "None or an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"an integer <= max_tokens ({self.max_tokens})")
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a non-empty string or a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name, default in _NOT_YET.items():
            value = getattr(self, name)
            _check(value == default, name, value, f"{default!r} (other values are not "
                   "supported yet by this version of mrv2)")

    @property
    def greedy(self) -> bool:
        """True when the request picks the most likely token (temperature near 0)."""
        return self.temperature < _GREEDY_EPS

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id named by these params is outside the model's vocabulary."""
        assert isinstance(self.stop_token_ids, list)
        for token in self.stop_token_ids:
            _check(token < vocab_size, "stop_token_ids", token,
                   f"token ids in [0, {vocab_size})")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed}")
