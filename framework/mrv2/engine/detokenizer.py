"""Incremental detokenization with stop strings.

Token ids become text through ``tokenizers``' ``DecodeStream`` (Rust): it decodes a window of
ids ``[prefix_offset, len(ids))``, cuts off the text of ``[prefix_offset, read_offset)`` (already
emitted), and emits the rest unless it ends in U+FFFD (a character still incomplete). Decoding
from a few tokens back keeps decoders that treat the first token specially (sentencepiece's
leading-space marker) and byte-level BPE (a character split over several tokens) right. Used raw,
``DecodeStream`` is not exact, so two things are added here:

* Byte-fallback runs are held. Sentencepiece's ``ByteFallback`` decoder is not local: a run of
  ``<0xNN>`` tokens that is not valid UTF-8 as a whole decodes to one U+FFFD per byte, so a later
  stray byte turns an earlier, complete character of the same run into U+FFFD. Raw
  ``DecodeStream`` then has emitted text the decode lacks (``<0x4D><0xCF>``: it emits "M", the
  decode is two U+FFFD) or raises "Invalid prefix encountered" (``<0x6A><0xEC>`` then "a"). So
  a run is held here, outside the stream, and goes in together with the token that ends it.
  Ids the decode drops (skipped special tokens; ids past the vocabulary, a padded embedding's)
  do not end a run: the bytes around them join. A run is capped at ``_MAX_BYTE_RUN`` tokens so
  that text keeps streaming; past the cap valid UTF-8 still decodes exactly, and if a later
  byte makes the run invalid after all (the text already out cannot be taken back), the
  stream's error is caught and the request goes on with Python windows.
* ``flush``: at the end of a request, held-back text (a held run; an incomplete character, as
  U+FFFD) is released. Raw ``DecodeStream`` never emits it: an output ending mid-character loses
  its last character. The window's offsets are mirrored here for this.

A tokenizer without a Rust backend (a "slow" HF tokenizer), and ``decode_stream=False``, decode
the same windows in Python through ``Tokenizer.decode`` (two decodes per token): that was the
whole implementation before, kept for those tokenizers and as the recovery path above.

Why, measured with ``mrv2 bench detokenize`` (CPU time per token, one id per ``add_tokens``,
512-token outputs of mixed English / accents / CJK / emoji / code text, median of 7 runs, on a
2-core CI-class CPU; exactness over 1000 random and adversarial id sequences per tokenizer)::

    tokenizer             Python windows  raw DecodeStream      this
    byte-level BPE        3.2 us  exact   0.8 us  74% exact     1.6 us  exact
    sentencepiece <0xNN>  3.8 us  exact   1.9 us  57% exact     2.5 us  exact
    SmolLM2 (49k vocab)   3.4 us  exact   0.9 us  92% exact     1.7 us  exact

Raw ``DecodeStream`` fails by the lost tail on all tokenizers and, on byte fallback, also by
wrong text (5%) and exceptions (28%). The Python windows of before were 3.5 / 5.0 / 3.8 us and
missed out-of-vocabulary ids inside byte runs (0.5% of sentencepiece cases); they also appended
to one string, so the cost grew with the output (over 10 us per token past 16k tokens): the
text is now kept in pieces, joined when read.

The concatenated deltas equal ``tokenizer.decode(output_ids, skip_special_tokens)``, no delta
holds a U+FFFD that text lacks, and the cost of a call is proportional to the tokens it adds and
the window, not to the length of the output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from mrv2.engine.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# A run of byte-fallback tokens is held back until it ends, up to this many tokens; past it,
# its tokens go to the decoder one by one (text is emitted as soon as it ends on a character).
_MAX_BYTE_RUN = 32
# Prompt tokens kept as decoding context when ``use_prompt_context`` is set.
_PROMPT_CONTEXT_TOKENS = 6
# What ``DecodeStream.step`` raises when a window's text no longer starts with its prefix.
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, a delta at a time.

    ``prompt_token_ids`` are kept for reference. By default they are not decoding context, so
    the output text is exactly the decode of the output ids alone; with
    ``use_prompt_context=True`` (the engine's: vLLM's behaviour) the last few prompt tokens
    are context, and a sentencepiece model's first output word keeps its leading space ("is"
    -> " Paris").
    ``decode_stream=False`` decodes windows in Python even for a fast tokenizer (benchmarks,
    tests).

    ``spaces_between_special_tokens=False`` with ``skip_special_tokens=False`` does what
    vLLM's fast detokenizer does: an added token that follows an added token is emitted as
    its bare text, without the space a decoder may put before it (WordPiece's: "[SEP] [PAD]"
    becomes "[SEP][PAD]"); the text then is no longer exactly the decode. Otherwise it is a
    no-op (as in vLLM).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        use_prompt_context: bool = False,
        *,
        decode_stream: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_ids
        self._skipped_ids = (
            frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        )
        # {id: byte} where the decoder is ByteFallback (see _held_run_is_invalid)
        self._byte_values = tokenizer.byte_fallback_values
        if not self._byte_values.keys().isdisjoint(self._skipped_ids):
            self._byte_values = {}
        self._num_ids = tokenizer.vocab_size  # ids past it (a padded embedding's) decode to ""
        # {id: text} of added tokens whose space after another added token is dropped
        self._bare_added = ({} if skip_special_tokens or spaces_between_special_tokens
                            else tokenizer.added_tokens)
        self._last_added = False  # (the prompt's last token is not counted, as in vLLM)
        # Context ids followed by output ids; the decoder has seen ``_ids[:_fed]`` (the rest is
        # a held byte run), and its window is ``_ids[_prefix_offset:]``.
        self._ids: list[int] = []
        self._num_context = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self._fed = 0
        self._byte_run = 0  # byte-fallback tokens in the run the last tokens belong to
        self._run_start = 0  # where that run begins in _ids (when _byte_run > 0)
        if use_prompt_context and self.prompt_token_ids:
            end = self._context_end(self.prompt_token_ids)
            context = self.prompt_token_ids[max(0, end - _PROMPT_CONTEXT_TOKENS) : end]
            # A prompt ending mid-character, or in a byte run the output may continue, cannot
            # serve as context: its text would not be a prefix of the text with the output.
            if context and not (self._ends_in_byte_run(context)
                    or self._decode(context).endswith(_REPLACEMENT_CHAR)):
                self._ids = list(context)
                self._num_context = self._read_offset = self._fed = len(context)
        self._backend: Any = tokenizer.backend if decode_stream else None
        self._stream: DecodeStream | None = None
        if self._backend is not None:
            try:
                self._stream = DecodeStream(
                    ids=list(self._ids), skip_special_tokens=skip_special_tokens
                )
            except TypeError:  # a tokenizers too old for ``ids=`` (and list steps): windows
                self._backend = None
        # output_text as pieces, joined when read: appending stays O(1) for a long output.
        self._parts: list[str] = []
        self._length = 0  # len(output_text)
        self._stream_offset = 0  # output_text already handed out by stream_delta
        self._delta_start = 0  # where the text of the last add_tokens/flush call starts
        self._no_stop_before = 0  # no stop string may end at or before this (min_tokens)
        self._held_key = (0, 0)  # (prefix, read offsets) of _held_prefix: its text's length
        self._held_prefix = 0
        self.stop_reason: str | None = None

    # -- token ids -> text ----------------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def output_text(self) -> str:
        """All text finalized so far (truncated at a stop string once one matched)."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def _append(self, delta: str) -> None:
        if delta:
            self._parts.append(delta)
            self._length += len(delta)

    def _tail(self, start: int) -> str:
        """``output_text[start:]``, joining only the pieces it spans."""
        pieces, length = [], self._length
        for piece in reversed(self._parts):
            if length <= start:
                break
            pieces.append(piece)
            length -= len(piece)
        return "".join(reversed(pieces))[start - length :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _invisible(self, token_id: int) -> bool:
        """True for ids the decode drops before its decoder runs: they do not end a byte run."""
        return token_id in self._skipped_ids or not 0 <= token_id < self._num_ids

    def _ends_in_byte_run(self, ids: Iterable[int]) -> bool:
        """True if the last token of ``ids`` the decoder sees is a byte-fallback token."""
        for token_id in reversed(list(ids)):
            if not self._invisible(token_id):
                return token_id in self._byte_ids
        return False

    def _context_end(self, prompt: list[int]) -> int:
        """Where the prompt's decoding context ends: at its end, or, when it ends in a byte
        run (Llama-2's "\\n" is ``<0x0A>``), before that run, which the output may continue
        (its text is the prompt's either way): the tokens before it are still context, so
        the first output word keeps its leading space after such a prompt (as vLLM's, and
        as the decode of prompt + output). 0 where no token before the run is near."""
        in_run = False
        for i in range(len(prompt) - 1, max(-1, len(prompt) - 4 * _MAX_BYTE_RUN - 1), -1):
            if self._invisible(prompt[i]):
                continue
            if prompt[i] not in self._byte_ids:
                return i + 1 if in_run else len(prompt)
            in_run = True
        return 0 if in_run else len(prompt)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output ids; return the text they finalize (maybe "", e.g. mid-character).

        Once a stop string matched, the output is frozen and this returns "".
        """
        if self.stop_reason is not None:
            return ""
        self._delta_start = self._length
        ids = self._ids
        deltas = []
        for token_id in new_ids:
            token_id = int(token_id)
            ids.append(token_id)
            bare = None
            if self._bare_added:
                bare = self._bare_added.get(token_id) if self._last_added else None
                self._last_added = token_id in self._bare_added
            if token_id in self._byte_ids:
                if not self._byte_run:
                    self._run_start = len(ids) - 1
                self._byte_run += 1
                if self._byte_run < _MAX_BYTE_RUN:
                    continue  # held: a later byte may still change how the run decodes
            elif token_id in self._skipped_ids or not 0 <= token_id < self._num_ids:
                if 0 < self._byte_run < _MAX_BYTE_RUN:
                    continue  # dropped by the decode (``_invisible``): the run goes on
            else:
                self._byte_run = 0
            # Pass the ids the decoder has not seen (usually just this one) to it.
            fed, self._fed = self._fed, len(ids)
            delta: str | None
            if self._stream is not None:
                try:  # one id goes as an int: the bindings take a list noticeably slower
                    delta = self._stream.step(
                        self._backend, token_id if self._fed - fed == 1 else ids[fed:]
                    )
                except Exception as e:  # tokenizers raises a bare Exception
                    if not str(e).startswith(_INVALID_PREFIX):
                        raise
                    # Only past the byte-run cap: decode windows in Python from now on.
                    self._stream = None
                    delta = self._window_delta()
            else:
                delta = self._window_delta()
            if delta:
                self._prefix_offset = self._read_offset
                self._read_offset = self._fed
                deltas.append(delta if bare is None else bare)
        if not deltas:
            return ""
        delta = deltas[0] if len(deltas) == 1 else "".join(deltas)
        self._parts.append(delta)
        self._length += len(delta)
        return delta

    def _window_delta(self) -> str | None:
        """The window's text past its prefix; None if there is none or it ends mid-character."""
        window = self._ids[self._prefix_offset : self._fed]
        read = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:read]) if read else ""
        text = self._decode(window)
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return None  # nothing visible yet (a skipped special token) or an incomplete char
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Release text held back at the end (an incomplete character becomes U+FFFD)."""
        if self.stop_reason is not None or self._read_offset == len(self._ids):
            return ""
        delta = self._held_text()
        self._prefix_offset = self._read_offset
        self._read_offset = self._fed = len(self._ids)
        self._byte_run = 0
        self._byte_values = {}  # (a later run may join this tail's in the window)
        self._stream = None  # it has not seen this tail: any later ids go through windows
        self._delta_start = self._length
        self._append(delta)
        return delta

    def _held_text(self) -> str:
        """The text held back now (a byte run, an incomplete character): what :meth:`flush`
        would release; "" when nothing is held."""
        if self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        key = (self._prefix_offset, self._read_offset)
        if self._held_key != key:  # the prefix's text is the same while a run is held
            self._held_key, self._held_prefix = key, len(self._decode(window[:read]))
        return self._decode(window)[self._held_prefix :]

    # -- stop strings ---------------------------------------------------------------------

    def check_stop(
        self, stop: Sequence[str], include_stop_str_in_output: bool = False
    ) -> str | None:
        """Find the earliest stop string that ends in the text of the last ``add_tokens``, or
        in the text held back (a byte run, an incomplete character: what :meth:`flush` would
        release), which then joins the output.

        A match of ``s`` ends in that text, so it starts at most ``len(s) - 1`` characters
        before it (vLLM's search), and only that region is searched: call this after every
        ``add_tokens`` (a stop string that ends in the text of a call not followed by a check is
        never matched). Under ``min_tokens``, call :meth:`skip_stop_check` instead, on the
        last token it covers: no match ends at or before that point. On a match
        ``output_text`` is truncated before the stop string (after it with
        ``include_stop_str_in_output``), further tokens are ignored, and the stop string is
        returned; else None.
        """
        if self.stop_reason is not None:
            return self.stop_reason
        stops = [s for s in stop if s]
        if not stops:
            return None
        # Text held back (a byte run waits for the token that ends it) counts: were the output
        # to end here, it would be released, so a stop string in it stops the request now.
        held = "" if self._held_run_is_invalid(stops) else self._held_text()
        if self._delta_start >= self._length and not held:
            return None
        # A match must end in the new text (vLLM's rule, per stop string: a short one is not
        # looked for in text a long one needs as lead-in), and past ``skip_stop_check``'s mark.
        new = max(min(self._delta_start, self._length), self._no_stop_before)
        start = max(0, min(self._delta_start, self._length) - (max(len(s) for s in stops) - 1))
        region = self._tail(start) + held
        best: tuple[int, str] | None = None
        for s in stops:
            index = region.find(s, max(0, new - (len(s) - 1) - start))
            if index != -1 and (best is None or index < best[0]):
                best = (index, s)
        if best is None:
            return None
        if held:
            self.flush()  # the output ends here: its held text joins it
        index, matched = best
        end = start + index + (len(matched) if include_stop_str_in_output else 0)
        text = self.output_text[:end]
        self._parts = [text] if text else []
        self._length = end
        self._delta_start = min(self._delta_start, end)
        self.stop_reason = matched
        return matched

    def _held_run_is_invalid(self, stops: list[str]) -> bool:
        """True when all that is held lies in a byte run (ByteFallback) that is not valid
        UTF-8 so far (mid-character: most of a CJK run's tokens): the decoder turns the
        window's part of the run into one U+FFFD per byte, so the held text is U+FFFDs only,
        where none of ``stops`` can end, and it need not be decoded to be searched."""
        values, ids = self._byte_values, self._ids
        if not (values and self._byte_run) or self._read_offset == len(ids):
            return False
        start = max(self._run_start, self._prefix_offset)  # the run as the window has it
        if start > self._read_offset or any(_REPLACEMENT_CHAR in s for s in stops):
            return False
        try:
            bytes([values[i] for i in ids[start:] if i in values]).decode("utf-8")
        except UnicodeDecodeError:
            return True
        return False

    def skip_stop_check(self) -> None:
        """The output so far (held text included) is under ``min_tokens``: no stop string
        may end in it, though one that begins in it and ends later does (vLLM's rule). An
        incomplete character (U+FFFD, held) is not in it: the token that completes it is
        later."""
        self._no_stop_before = self._length + len(self._held_text().rstrip(_REPLACEMENT_CHAR))

    # -- streaming ------------------------------------------------------------------------

    @property
    def streamed_text(self) -> str:
        """``output_text`` as far as :meth:`stream_delta` has handed it out."""
        text = self.output_text
        return text[: self._stream_offset] if self._stream_offset < len(text) else text

    def stream_delta(self, finished: bool = False, holdback: int = 0) -> str:
        """Text not yet handed out by this method.

        While not ``finished``, the last ``holdback`` characters are kept back: pass
        ``max(len(s) for s in stop) - 1`` when stop strings are excluded from the output, so
        a partial stop string is never streamed before ``check_stop`` could cut it off.
        """
        end = self._length if finished else max(0, self._length - holdback)
        if end <= self._stream_offset:
            return ""
        delta = self._tail(self._stream_offset)[: end - self._stream_offset]
        self._stream_offset = end
        return delta
