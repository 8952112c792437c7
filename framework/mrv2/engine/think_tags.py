"""A thinking block's end tag that the tokenizer spells with several tokens (Olmo 3's plain-text
``</think>``, Hunyuan-A13B's ``</think>\\n<answer>\\n``), found in the bytes of the output's
tokens rather than in their ids: the model may spell it with any split of its tokens (``</``,
``think``, ``>`` or ``</th``, ``ink>``), and each spelling ends the block, as the server's
reasoning parser, which reads the text, ends it.

The grammar holds from the token after the one that completes the tag, so that token must not
carry text past the tag (``>\\n\\n`` where the tag ends at ``>``: the newlines would be content
the grammar never saw). While the output's tail is a part of the tag such tokens are not
allowed (:meth:`TextTag.restrict`): the model writes the rest of the tag, then the grammar's
tokens; a token that holds the whole tag and more is never allowed in the block. A guide keeps
only the output's last ``len(tag) - 1`` bytes (:meth:`TextTag.feed`)."""

from __future__ import annotations

import numpy as np

__all__ = ["TextTag"]


class TextTag:
    """An end tag matched on the bytes of the tokens (``vocab[i]``: token ``i``'s bytes; a
    special token's are empty: the text the parser reads skips it); ``words``: the int32 words
    of a mask row."""

    def __init__(self, tag: bytes, vocab: list[bytes], words: int) -> None:
        assert tag
        self.tag, self.vocab, self.words = tag, vocab, words
        #: Tokens that hold the whole tag with text after it (never allowed in the block).
        self._inside = [i for i, b in enumerate(vocab)
                        if (at := b.find(tag)) >= 0 and at + len(tag) < len(b)]
        self._past: dict[int, list[int]] = {}  # j: the tokens that go past tag[j:]
        self._rows: dict[tuple[int, ...], np.ndarray | None] = {}

    def feed(self, tail: bytes, token: int) -> tuple[bytes, bool]:
        """The tail after ``token`` and whether the tag is complete (the tail is then empty)."""
        text = tail + (self.vocab[token] if 0 <= token < len(self.vocab) else b"")
        if self.tag in text:
            return b"", True
        return text[max(0, len(text) - len(self.tag) + 1):], False

    def restrict(self, tail: bytes, row: np.ndarray) -> None:
        """Clear in ``row`` (a uint32 mask row) the tokens that would complete the tag after
        ``tail`` and go on past it, or that hold it whole and more."""
        parts = (tuple(j for j in range(1, len(self.tag)) if tail.endswith(self.tag[:j]))
                 if tail[-1:] in self.tag[:-1] else ())  # (most tails end in no part of it)
        allowed = self._rows.get(parts, 0)
        if isinstance(allowed, int):
            allowed = self._rows[parts] = self._allowed(parts)
        if allowed is not None:
            row &= allowed

    def _allowed(self, parts: tuple[int, ...]) -> np.ndarray | None:
        """The mask of every token but those :meth:`restrict` clears after a tail that ends
        with ``tag[:j]`` for each ``j`` of ``parts`` (None: it clears none)."""
        banned = set(self._inside)
        for j in parts:
            if j not in self._past:  # (a scan of the vocabulary, once each)
                rest = self.tag[j:]
                self._past[j] = [i for i, b in enumerate(self.vocab)
                                 if len(b) > len(rest) and b.startswith(rest)]
            banned.update(self._past[j])
        if not banned:
            return None
        bits = np.ones(32 * self.words, dtype=np.uint8)
        bits[sorted(banned)] = 0
        return np.packbits(bits, bitorder="little").view(np.uint32)
