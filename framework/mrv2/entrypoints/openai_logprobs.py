"""Logprobs as the OpenAI-compatible API answers them: the completions route's legacy
body, the chat route's ``content`` list and vLLM's ``prompt_logprobs``; -inf and NaN (not
JSON) clamped to :data:`MIN_LOGPROB`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from mrv2.engine.outputs import PositionLogprobs


def _token_text(lp: Any, token: int, as_ids: bool = False) -> str:
    if as_ids or lp.decoded_token is None:
        return f"token_id:{token}"
    return str(lp.decoded_token)


#: The lowest logprob an answer shows (vLLM's clamp): -inf (a token no sampling can give) and
#: NaN are not JSON.
MIN_LOGPROB = -9999.0


def _json_logprob(value: float) -> float:
    """``value`` clamped to :data:`MIN_LOGPROB` (NaN, which compares false, too)."""
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(positions: Sequence[PositionLogprobs | None], token_ids: list[int],
                        offset: int, token_text: Callable[[int], str] | None = None,
                        as_ids: bool = False, k: int | None = None
                        ) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy logprobs (tokens/token_logprobs/top_logprobs/text_offset); returns the
    text offset after the last token too. A position of ``None`` (an echoed prompt's first
    token) has no logprob and no top logprobs; its text is ``token_text(token)``. ``as_ids``
    (vLLM's ``return_tokens_as_token_ids``): every token named ``token_id:N``. ``k`` (the
    request's ``logprobs``): a position's ``top_logprobs`` holds its first ``k + 1`` entries
    (the token's own, then the top ones), as vLLM's, though an echoed prompt's positions may
    hold more (a larger ``prompt_logprobs``)."""
    tokens, token_lps, tops = [], [], []
    offsets: list[int] = []
    for token, pos in zip(token_ids, positions, strict=False):
        chosen = pos.get(token) if pos is not None else None
        if as_ids:
            text = f"token_id:{token}"
        elif chosen is not None:
            text = _token_text(chosen, token)
        else:
            text = token_text(token) if token_text is not None else ""
        tokens.append(text)
        token_lps.append(_json_logprob(chosen.logprob) if chosen is not None else None)
        tops.append(None if pos is None else
                    {_token_text(lp, t, as_ids): _json_logprob(lp.logprob)
                     for t, lp in itertools.islice(pos.items(), None if k is None else k + 1)})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
    return body, offset


def prompt_logprobs_body(positions: list[PositionLogprobs | None] | None) -> Any:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or ``{token id:
    {logprob, rank, decoded_token}}`` (the token itself and the top k)."""
    if positions is None:
        return None
    return [None if pos is None else {
        str(t): {"logprob": _json_logprob(lp.logprob), "rank": lp.rank,
                 "decoded_token": lp.decoded_token}
        for t, lp in pos.items()} for pos in positions]


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int],
                  k: int, as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    (``as_ids``: tokens named ``token_id:N``)."""
    content = []
    for token, pos in zip(token_ids, positions, strict=False):
        chosen = pos.get(token)
        if chosen is None:
            continue
        text = _token_text(chosen, token, as_ids)
        top = sorted(pos.items(), key=lambda x: x[1].rank or 0)
        tops = [{"token": _token_text(lp, t, as_ids), "logprob": _json_logprob(lp.logprob),
                 "bytes": list(_token_text(lp, t, as_ids).encode())} for t, lp in top[:k]]
        content.append({"token": text, "logprob": _json_logprob(chosen.logprob),
                        "bytes": list(text.encode()), "top_logprobs": tops})
    return {"content": content}
