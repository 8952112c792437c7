"""Incremental detokenization with stop strings.

Each new token is decoded inside a small window of ids ``[prefix_offset, len(ids))``; the text of
``[prefix_offset, read_offset)`` (already emitted) is cut off the front, and what is left is the
delta. Decoding from a few tokens back, rather than the new token alone, keeps decoders that treat
the first token specially (sentencepiece's leading-space marker) and byte-level BPE (a character
split over several tokens) right. A window whose text ends in U+FFFD ends mid-character: its text
is held back until a later token completes it (``flush`` releases it at the end of a request).

Sentencepiece byte-fallback decoding is not local: a run of ``<0xNN>`` tokens that is not valid
UTF-8 as a whole decodes to one U+FFFD per byte, so a later stray byte can turn an earlier,
complete character of the same run into U+FFFD. Text is therefore held back while the last
visible token is a byte token, until the run ends (bounded by ``_MAX_BYTE_RUN`` tokens; beyond
it, valid UTF-8 still decodes exactly).

The concatenated deltas equal ``tokenizer.decode(output_ids, skip_special_tokens)``; the cost of
a call is proportional to the tokens it adds and the window, not to the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from mrv2.engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# A run of byte-fallback tokens is held back until it ends (see ``_in_byte_run``), up to this
# many tokens; past it, text is emitted as soon as it ends on a whole character.
_MAX_BYTE_RUN = 32
# Prompt tokens kept as decoding context when ``use_prompt_context`` is set.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, a delta at a time.

    ``prompt_token_ids`` are kept for reference. By default they are not decoding context, so
    the output text is exactly the decode of the output ids alone; with
    ``use_prompt_context=True`` the last few prompt tokens are context (vLLM's behaviour), and a
    sentencepiece model's first output word keeps its leading space ("is" -> " Paris").
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        use_prompt_context: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_ids
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else None
        # Decoding window over ``_ids`` (context ids followed by output ids).
        self._ids: list[int] = []
        self._num_context = 0
        self._prefix_offset = 0
        self._read_offset = 0
        if use_prompt_context and self.prompt_token_ids:
            context = self.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
            # A prompt ending mid-character cannot serve as context: its text would not be a
            # prefix of the text with the output appended.
            if not self._decode(context).endswith(_REPLACEMENT_CHAR):
                self._ids = context
                self._num_context = len(context)
                self._read_offset = len(context)
        self._text = ""
        self._stream_offset = 0  # output_text already handed out by stream_delta
        self._delta_start = 0  # where the text of the last add_tokens/flush call starts
        self.stop_reason: str | None = None

    # -- token ids -> text ----------------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def output_text(self) -> str:
        """All text finalized so far (truncated at a stop string once one matched)."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output ids; return the text they finalize (maybe "", e.g. mid-character).

        Once a stop string matched, the output is frozen and this returns "".
        """
        if self.stop_reason is not None:
            return ""
        self._delta_start = len(self._text)
        deltas = []
        for token_id in new_ids:
            self._ids.append(int(token_id))
            delta = self._advance()
            if delta:
                deltas.append(delta)
        delta = "".join(deltas)
        self._text += delta
        return delta

    def _in_byte_run(self) -> bool:
        """True if the last visible token is a byte-fallback token in a run shorter than the cap."""
        run = 0
        for i in range(len(self._ids) - 1, self._prefix_offset - 1, -1):
            token_id = self._ids[i]
            if self._skipped_ids is not None and token_id in self._skipped_ids:
                continue
            if token_id not in self._byte_ids:
                break
            run += 1
            if run >= _MAX_BYTE_RUN:
                return False
        return run > 0

    def _advance(self) -> str:
        if self._byte_ids and self._in_byte_run():
            return ""
        window = self._ids[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read]) if read else ""
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing visible yet (a skipped special token) or an incomplete character.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Release text held back at the end (an incomplete character becomes U+FFFD)."""
        if self.stop_reason is not None or self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read]) if read else ""
        new_text = self._decode(window)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text) :]
        self._delta_start = len(self._text)
        self._text += delta
        return delta

    # -- stop strings ---------------------------------------------------------------------

    def check_stop(
        self, stop: Sequence[str], include_stop_str_in_output: bool = False
    ) -> str | None:
        """Find the earliest stop string that ends in the text of the last ``add_tokens``.

        Only that delta plus ``max(len(s) for s in stop) - 1`` characters before it can hold a
        new match, so only that region is searched: call this after every ``add_tokens`` (text
        of calls not followed by a check, e.g. under ``min_tokens``, is never matched). On a
        match ``output_text`` is truncated before the stop string (after it with
        ``include_stop_str_in_output``), further tokens are ignored, and the stop string is
        returned; else None.
        """
        if self.stop_reason is not None:
            return self.stop_reason
        text = self._text
        stops = [s for s in stop if s]
        if not stops or self._delta_start >= len(text):
            return None
        start = max(0, self._delta_start - (max(len(s) for s in stops) - 1))
        best: tuple[int, str] | None = None
        for s in stops:
            index = text.find(s, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, s)
        if best is None:
            return None
        index, matched = best
        end = index + len(matched) if include_stop_str_in_output else index
        self._text = text[:end]
        self._delta_start = min(self._delta_start, end)
        self.stop_reason = matched
        return matched

    # -- streaming ------------------------------------------------------------------------

    def stream_delta(self, finished: bool = False, holdback: int = 0) -> str:
        """Text not yet handed out by this method.

        While not ``finished``, the last ``holdback`` characters are kept back: pass
        ``max(len(s) for s in stop) - 1`` when stop strings are excluded from the output, so
        a partial stop string is never streamed before ``check_stop`` could cut it off.
        """
        end = len(self._text) if finished else max(0, len(self._text) - holdback)
        if end <= self._stream_offset:
            return ""
        delta = self._text[self._stream_offset : end]
        self._stream_offset = end
        return delta
