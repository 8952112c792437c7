"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression, a choice of strings, a grammar (Lark or GBNF) or structural tags
(``SamplingParams.structured_outputs``, vLLM's names; the OpenAI server's ``response_format``
and vLLM's ``structured_outputs`` / ``guided_*`` fields map onto it).

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (one of
vLLM's backends; ``pip install llguidance``, in ``mrv2[serve]``): a request's constraint is
compiled and checked when it is added (a bad schema or grammar is a ``ValueError`` naming the
field, before any work), and each sample gets its own matcher over the tokenizer.

Per step (GPU-native where it can be, CPU where it must): the matcher lives on the CPU and
consumes each sampled token; the mask of a request's next token needs its last one. With
async scheduling that token is still on the device when the next step is planned, so (runner
in the engine's process, the default) the step is planned and its forward launched anyway,
and the masks are filled *during* the forward: the runner calls
``SchedulerOutput.fill_token_bitmasks`` between the forward and the sampling, which waits for
the tokens in flight (the step before's, done by then or soon), advances the matchers over
them and writes the masks, and the sampler then uploads them. A constrained request so samples
every step, as a free one does. Under tensor parallelism (the step crosses to other
processes before it runs) or with ``MRV2_LATE_TOKEN_MASKS=0`` the scheduler instead runs a
constrained request only when none of its tokens is in flight: every other step of an async
batch, the other requests keeping the pipeline; its masks are filled right after scheduling
and travel in ``SchedulerOutput.token_bitmasks``, the same on every rank. Either way the
allowed-token bitmasks come from llguidance (one bit a token, packed in int32 on the CPU;
several requests' on llguidance's thread pool: ~4 us a mask of a plain JSON schema on one
core of the CPU sandbox, 49K vocabulary; counted repetitions such as ``maxLength`` make them
~15x dearer), and every disallowed token's logit becomes -inf before sampling
(:func:`mrv2.sample.masks.apply_token_bitmask`, a store-only kernel): on a decode graph's
logits before its sampling tail replays (a structured output alone does not send a step to
eager sampling), else in the eager sampler. A request whose match is complete (the matcher
accepts nothing but the end) finishes with ``stop``; a step already launched for it samples
with every token allowed, and its token is dropped.

With the server's ``--reasoning-parser`` (``qwen3``, ``deepseek_r1``), as vLLM: the grammar
holds only what follows the ``<think>`` block. A prompt that closed the block (Qwen3 with
``enable_thinking: false``) is held from the first token; one that opened it (DeepSeek-R1's
template) is free until ``</think>``; otherwise (``qwen3``) the first token may be the
grammar's or ``<think>``, which frees it until ``</think>``. gpt-oss (``openai_gptoss``, its
harmony messages) is free until it opens its final answer, ``<|channel|>final<|message|>``
(a content type may come between: ``<|channel|>final <|constrain|>json<|message|>``; vLLM's
rule): its analysis and any tool call are not held to the grammar. Where the tokenizer spells
the end tag with several tokens (Olmo 3's plain-text ``</think>``, Hunyuan-A13B's
``</think>\n<answer>\n``) it is found in the bytes of the output's tokens, however the model
splits it (:mod:`mrv2.engine.think_tags`), and the grammar holds from the next token; a token
that would complete the tag and go on past it is not allowed. (A start tag of several tokens
cannot be offered beside the grammar's first token: there the grammar holds from the first
token unless the prompt opened the block.) Step-3.5's first token after ``</think>`` may be
the newline its parser drops (vLLM leaves that one token free; here only the newline is).
With ``structured_outputs_config``'s ``enable_in_reasoning`` the grammar holds from the first
token whatever the parser (the thinking block too), as vLLM's.

With speculative decoding a constrained request verifies its drafts as a free one does: a
step that samples one copies the drafts proposed after it to the host with its tokens
(``SchedulerOutput.copy_drafts``), and the next step's masks cover every logits row of the
request: its first token's, and each draft position's after the drafts before it, the
matcher advancing over them tentatively and rolled back (:meth:`Guide.draft_masks`). A draft
the grammar refuses is not allowed by its row's mask, so it is rejected there, and the rows
past it allow every token (nothing there is kept).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from mrv2.contract.params import SamplingParams, StructuredOutputsParams
from mrv2.engine.grammars import FIELD as _FIELD
from mrv2.engine.grammars import grammar_of, load_llguidance
from mrv2.engine.think_tags import TextTag

if TYPE_CHECKING:
    from mrv2.config import StructuredOutputsConfig

__all__ = ["Guide", "StructuredOutputs", "fill_bitmasks", "fill_draft_bitmasks", "grammar_of"]

#: The tokens gpt-oss may write between ``<|channel|>final`` and ``<|message|>`` (a content
#: type: `` <|constrain|>json``), its answer still held to the grammar (vLLM's 20).
HARMONY_HEADER_GAP = 20
#: The thinking blocks a structured output's ``SamplingParams._reasoning`` names (the server's
#: reasoning parser's convention): its start and end tags (one token of the tokenizer each, or
#: plain text that several tokens spell: the end tag is then found in the output's text,
#: :class:`~mrv2.engine.think_tags.TextTag`), and where the answer starts: ``prompt`` (in the
#: block if the prompt's last start tag stands after its last end tag, past it if the prompt
#: closed it, else ``qwen3``'s first token may open it and ``deepseek_r1``'s answer opens in
#: it), ``open`` (the model opens the block itself: the first token may be the start tag,
#: whatever the prompt holds: Magistral's system prompt writes both tags, Gemma 4's are not in
#: it). A start tag of several tokens cannot be offered beside the grammar's first token: where
#: the model would have to open the block itself, the grammar holds from the first token.
THINK_BLOCKS: dict[str, tuple[str, str, str]] = {
    "qwen3": ("<think>", "</think>", "prompt"),
    "deepseek_r1": ("<think>", "</think>", "prompt"),
    "seed_oss": ("<seed:think>", "</seed:think>", "prompt"),
    "step3p5": ("<think>", "</think>", "prompt"),
    "hunyuan_a13b": ("<think>\n", "</think>\n<answer>\n", "prompt"),
    "mistral": ("[THINK]", "[/THINK]", "open"),
    "gemma4": ("<|channel>", "<channel|>", "open"),
}
#: The marks whose answer opens in the block where the prompt says nothing of it (DeepSeek-R1's).
OPENS_IN_BLOCK = ("deepseek_r1", "seed_oss", "step3p5")
#: The marks whose first token after the block may be a newline the grammar does not hold
#: (Step-3.5 writes one after ``</think>``, which its parser drops; vLLM leaves that token
#: free, here only the newline is added to the grammar's first tokens).
NEWLINE_AFTER = ("step3p5",)
logger = logging.getLogger(__name__)


#: A guide's phases: "grammar" (every token masked by the matcher); "reasoning" (a thinking
#: model's block: nothing masked, until its end tag); "open" (qwen3's first token: the
#: matcher's tokens or the block's start tag); "lead" (the first token after the block: the
#: matcher's tokens or the guide's ``lead``, Step-3.5's newline).
_PHASES = ("grammar", "reasoning", "open", "lead")


class Guide:
    """One sample's matcher: the allowed next tokens, and each sampled token consumed; with a
    reasoning model, only what follows its ``<think>`` block is held to the grammar, as vLLM
    does (``think``: the start tag's token id, the token ids that end the block (``</think>``;
    gpt-oss: ``<|channel|>final<|message|>``), and the phase to start in; ``gap``: how many
    tokens may stand before the end sequence's last one, after the others: gpt-oss's header
    may carry a content type, ``<|channel|>final <|constrain|>json<|message|>``, as vLLM
    allows); ``spell``: the end tag where the tokenizer spells it with several tokens (matched
    on their text; ``think``'s end ids are then unused); ``lead``: a token that may come first
    after the block, not held to the grammar (Step-3.5's newline; -1: none))."""

    def __init__(self, matcher: Any, owner: StructuredOutputs,
                 think: tuple[int, tuple[int, ...], str] | None = None, gap: int = 0,
                 spell: TextTag | None = None, lead: int = -1) -> None:
        self.matcher, self.owner = matcher, owner
        self.think_start, self.think_end, self.phase = think or (-1, (), "grammar")
        self.gap, self.spell, self.lead = gap, spell, lead
        #: The last tokens of the reasoning phase (up to the end sequence's length + gap).
        self.tail: tuple[int, ...] = ()
        #: With ``spell``: the output's last bytes that may begin its tag.
        self.text = b""
        #: Tokens advanced over: the request's output so far, or past it by the tokens of
        #: steps whose results arrived but are not processed yet (late masks).
        self.consumed = 0
        #: ``consumed`` when the match completed or broke (None: not yet): the request ends
        #: with that token, though the guide may have gone past it (late masks).
        self.done_at: int | None = None
        assert self.phase in _PHASES

    def advance(self, token: int) -> bool:
        """Consume a sampled token (a token the mask allowed; anything else puts the matcher
        in its error state, which ends the request); True when the matcher took it (the
        grammar's, not the thinking block's)."""
        self.consumed += 1
        if self.phase == "reasoning":
            if self.spell is not None:
                self.text, ended = self.spell.feed(self.text, token)
            else:
                self.tail = (*self.tail, token)[-(len(self.think_end) + self.gap):]
                ended = self._reasoning_ended()
            if ended:
                self.phase = "lead" if self.lead >= 0 else "grammar"
            return False
        if self.phase == "open":
            self.phase = "grammar"
            if token == self.think_start:
                self.phase = "reasoning"
                return False
        elif self.phase == "lead":
            self.phase = "grammar"
            if token == self.lead:
                return False
        self.matcher.consume_token(token)
        if self.done_at is None and self.done:
            self.done_at = self.consumed
        return True

    def _reasoning_ended(self) -> bool:
        """The tail ends the thinking: the end sequence's last token, and the others at the
        tail's last start of them, up to ``gap`` tokens before it."""
        tail, end = self.tail, self.think_end
        if not tail or tail[-1] != end[-1]:
            return False
        head = end[:-1]
        if not head:
            return True
        at = max((i for i, t in enumerate(tail[:-1]) if t == head[0]), default=-1)
        return at >= 0 and at + len(head) < len(tail) and tail[at:at + len(head)] == head

    def draft_masks(self, drafts: list[int], out: np.ndarray) -> None:
        """The masks of a step that verifies ``drafts``: ``out[0]`` (``[1 + len(drafts),
        words]``) the allowed next tokens, ``out[j]`` those after ``drafts[:j]``; the rows
        past the first draft the grammar refuses (its row does not allow it, so it is
        rejected there) allow every token. The guide is left as it was: the drafts are
        consumed tentatively and rolled back (:func:`fill_draft_bitmasks`, for one)."""
        fill_draft_bitmasks([self], [drafts], [out])

    def fork(self) -> Guide:
        """An independent copy (its own matcher, a deep copy): beam search's candidates each
        go on from their beam's state."""
        twin = Guide(self.matcher.deep_copy(), self.owner,
                     (self.think_start, self.think_end, self.phase), self.gap, self.spell,
                     self.lead)
        twin.tail, twin.text = self.tail, self.text
        twin.consumed, twin.done_at = self.consumed, self.done_at
        return twin

    @property
    def broken(self) -> bool:
        """The grammar refused a token (the matcher's error state)."""
        return self.phase == "grammar" and bool(self.matcher.is_error())

    @property
    def done(self) -> bool:
        """The match is complete (only the end may follow), or broken."""
        return self.phase == "grammar" and bool(self.matcher.is_stopped()
                                                or self.matcher.is_error())


def fill_bitmasks(guides: list[Guide | None], out: np.ndarray) -> None:
    """Each guide's allowed next tokens into its row of ``out`` (``[len, words]`` int32,
    C-contiguous, one bit a token); a row whose guide is None or done (its request finished
    after the step was planned: the token is discarded) allows every token."""
    live = [i for i, g in enumerate(guides) if g is not None and not g.done]
    if len(live) == len(guides):
        _compute(cast(list[Guide], guides), out)
        return
    out[:] = -1
    if live:
        some = np.empty((len(live), out.shape[1]), dtype=np.int32)
        _compute([cast(Guide, guides[i]) for i in live], some)
        out[live] = some


def fill_draft_bitmasks(guides: list[Guide | None], drafts: list[list[int]],
                        out: list[np.ndarray]) -> None:
    """Each guide's masks over its step's logits rows into ``out[i]`` (``[1 + len(drafts[i]),
    words]``, C-contiguous): row ``j`` the allowed tokens after the first ``j`` drafts, as
    :meth:`Guide.draft_masks` says. Row ``j`` of every guide is computed at once (several on
    llguidance's thread pool), the guides advanced a draft a level and all rolled back at
    the end; a guide that is None or done allows every token."""
    words = out[0].shape[1] if out else 0
    live: list[int] = []
    for i, guide in enumerate(guides):
        assert out[i].shape == (1 + len(drafts[i]), words) and out[i].flags.c_contiguous
        if guide is None or guide.done:
            out[i][:] = -1
        else:
            live.append(i)
    saved = {i: (g.phase, g.consumed, g.done_at, g.tail, g.text)
             for i in live if (g := guides[i]) is not None}
    taken = dict.fromkeys(live, 0)
    try:
        level = 0
        while live:
            rows = np.empty((len(live), words), dtype=np.int32)
            _compute([cast(Guide, guides[i]) for i in live], rows)
            after = []
            for k, i in enumerate(live):
                out[i][level] = rows[k]
                guide = cast(Guide, guides[i])
                if level == len(drafts[i]):
                    continue
                if guide.done:  # complete: the end only, and nothing past it is kept (nor is
                    out[i][level + 1 :] = -1  # the end consumed: a stopped matcher's rollback
                    continue  # would not count it)
                token = drafts[i][level]
                allowed = 0 <= token < 32 * words and (
                    int(rows[k].view(np.uint32)[token // 32]) >> (token % 32)) & 1
                if allowed:
                    taken[i] += guide.advance(token)
                if not allowed or guide.matcher.is_error():  # rejected here: rows past it
                    out[i][level + 1 :] = -1
                else:
                    after.append(i)
            live, level = after, level + 1
    finally:
        for i, (phase, consumed, done_at, tail, text) in saved.items():
            guide = cast(Guide, guides[i])
            if taken[i]:
                guide.matcher.rollback(taken[i])
            guide.phase, guide.consumed, guide.done_at = phase, consumed, done_at
            guide.tail, guide.text = tail, text


def _compute(guides: list[Guide], out: np.ndarray) -> None:
    """The guides' masks into ``out``'s rows: one guide on this thread, several on
    llguidance's thread pool (the GIL released; H200 host: 16 cores); a guide in its thinking
    block allows every token (but, where its end tag is text, those that would carry text past
    the tag: :meth:`TextTag.restrict`), one that may still open it also its start tag, one just
    past it also its ``lead``."""
    if not guides:
        return
    owner = guides[0].owner
    words = owner.words
    assert out.dtype == np.int32 and out.shape == (len(guides), words)
    assert out.flags.c_contiguous
    masked = [(g, i) for i, g in enumerate(guides) if g.phase != "reasoning"]
    if len(masked) == 1:
        g, i = masked[0]
        g.matcher.unsafe_compute_mask_ptr(out[i].ctypes.data, words * 4)
    elif masked:
        owner.executor.unsafe_compute_mask_ptr(
            [(g.matcher, i) for g, i in masked], out.ctypes.data, words * 4, len(guides))
    for i, g in enumerate(guides):
        if g.phase == "reasoning":
            out[i] = -1  # every token
            if g.spell is not None:
                g.spell.restrict(g.text, out.view(np.uint32)[i])
        elif g.phase == "open":  # or the thinking block's start
            out.view(np.uint32)[i, g.think_start // 32] |= np.uint32(1 << g.think_start % 32)
        elif g.phase == "lead":  # or the token that may follow the block (a newline)
            out.view(np.uint32)[i, g.lead // 32] |= np.uint32(1 << g.lead % 32)


class StructuredOutputs:
    """An engine's structured-outputs side: the llguidance tokenizer (built at the first
    constrained request), the checked grammars and each request's matchers; ``config``
    (``EngineConfig.structured_outputs``, vLLM's ``structured_outputs_config``): every
    request's JSON compact (``disable_any_whitespace``) or its objects closed
    (``disable_additional_properties``, or backend ``xgrammar`` / ``outlines``) as if it
    asked, and with ``enable_in_reasoning`` the grammar holds the thinking block too."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 config: StructuredOutputsConfig | None = None) -> None:
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.compact = config is not None and config.disable_any_whitespace
        self.closed = config is not None and config.closes_objects
        self.in_reasoning = config is not None and config.enable_in_reasoning
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._tokenizer: Any = None
        self._executor: Any = None
        self._grammars: dict[str, str] = {}
        self._ids: dict[str, int] = {}  # a tag's token id (-1: several tokens)
        self._spelled: dict[str, TextTag] = {}
        self._vocab: list[bytes] | None = None
        self._warned: set[str] = set()
        self._final: tuple[int, ...] | None = None  # (): looked up, not in this tokenizer

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            llg = load_llguidance()
            self._tokenizer = llg.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids or None)
        return self._tokenizer

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for many requests' masks at once."""
        if self._executor is None:
            self._executor = load_llguidance().LLExecutor()
        return self._executor

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """``spec`` compiled and checked against the tokenizer (the last 256 kept: a server
        sees the same schema again and again); ValueError naming the field when it is not
        a valid constraint. (The key keeps the schema's key order: the grammar writes an
        object's properties in the order the schema lists them.) The engine's defaults
        (``config``) apply to every request."""
        if (self.compact and not spec.disable_any_whitespace) or (
                self.closed and not spec.disable_additional_properties):
            spec = dataclasses.replace(
                spec, disable_any_whitespace=spec.disable_any_whitespace or self.compact,
                disable_additional_properties=spec.disable_additional_properties
                or self.closed)
        key = json.dumps(dataclasses.astuple(spec))
        grammar = self._grammars.get(key)
        if grammar is None:
            kind = spec.kinds()[0]
            try:
                grammar = grammar_of(spec)
            except ValueError as error:
                raise ValueError(f"{_FIELD}.{kind} is invalid: {error}") from None
            message = load_llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer)
            if message and not message.startswith("WARNING"):
                raise ValueError(f"{_FIELD}.{kind} is invalid: {message.strip()}")
            if len(self._grammars) >= 256:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = grammar
        return grammar

    def guide(self, params: SamplingParams, prompt_token_ids: list[int]) -> Guide:
        """A fresh matcher over ``params.structured_outputs``' grammar (:meth:`grammar`,
        cached); with ``params._reasoning`` (the server's reasoning parser) it holds only what
        follows the thinking block (:data:`THINK_BLOCKS`: its tags by the mark): from the
        start if the prompt closed the block (Qwen3 with ``enable_thinking: false``), after
        the end tag if the prompt opened it (DeepSeek-R1), and for ``qwen3`` otherwise (and
        always for a block the model opens itself, Magistral's) the first token may open it
        instead. With ``params._grammar_prefix`` (k: beam search's steps) the prompt's last k
        tokens are consumed first, the thinking block looked for in those before them."""
        assert params.structured_outputs is not None
        prefix = params._grammar_prefix
        if not 0 <= prefix <= len(prompt_token_ids):
            raise ValueError(f"SamplingParams._grammar_prefix={prefix} is invalid: expected "
                             f"0 to the prompt's length ({len(prompt_token_ids)})")
        if not prefix:
            return self._fresh_guide(params, prompt_token_ids)
        # (beam search: the beam's output so far, consumed as the request's own would be,
        # then counted as none of this request's: its first sample is its first output)
        cut = len(prompt_token_ids) - prefix
        guide = self._fresh_guide(params, prompt_token_ids[:cut])
        for token in prompt_token_ids[cut:]:
            guide.advance(token)
            if guide.broken:
                raise ValueError(f"SamplingParams._grammar_prefix={prefix} is invalid: the "
                                 f"grammar refuses the prompt's token {token} there")
        guide.consumed, guide.done_at = 0, None
        return guide

    def _fresh_guide(self, params: SamplingParams, prompt_token_ids: list[int]) -> Guide:
        """:meth:`guide` of a request whose output starts after ``prompt_token_ids``."""
        assert params.structured_outputs is not None
        matcher = load_llguidance().LLMatcher(self.tokenizer,
                                          self.grammar(params.structured_outputs))
        if matcher.is_error():
            raise ValueError(f"{_FIELD} is invalid: {matcher.get_error()}")
        if self.in_reasoning:  # (enable_in_reasoning: the thinking block held too)
            return Guide(matcher, self)
        if params._reasoning == "openai_gptoss":  # the prompt ends in <|start|>assistant
            final = self._harmony_final()
            return Guide(matcher, self, None if final is None else (-1, final, "reasoning"),
                         gap=HARMONY_HEADER_GAP)
        block = THINK_BLOCKS.get(params._reasoning or "")
        if block is None:
            return Guide(matcher, self)
        start_tag, end_tag, opens = block
        start, end = self._token_id(start_tag), self._token_id(end_tag)
        if start >= 0 and end >= 0:  # (the ids: as fast as it gets)
            opened = max((i for i, t in enumerate(prompt_token_ids) if t == start), default=-1)
            closed = max((i for i, t in enumerate(prompt_token_ids) if t == end), default=-1)
        else:  # a tag of several tokens: the prompt's text
            text = self.tokenizer.decode_bytes(prompt_token_ids)
            opened, closed = text.rfind(start_tag.encode()), text.rfind(end_tag.encode())
        if opens == "open":
            phase = "open"  # the model opens the block itself, or answers at once
        elif closed > opened:
            phase = "grammar"  # the template closed the block: no reasoning
        elif opened >= 0 or params._reasoning in OPENS_IN_BLOCK:
            phase = "reasoning"
        else:
            phase = "open"
        if phase == "open" and start < 0:
            if start_tag not in self._warned:
                self._warned.add(start_tag)
                logger.warning("structured outputs: %r is not one token of this tokenizer, so "
                               "the first token cannot open the thinking block: the grammar "
                               "holds from the first token unless the prompt opened it",
                               start_tag)
            phase = "grammar"
        spell = self._spell(end_tag) if end < 0 else None
        lead = self._token_id("\n") if params._reasoning in NEWLINE_AFTER else -1
        return Guide(matcher, self, (start, (end,) if end >= 0 else (), phase), spell=spell,
                     lead=lead)

    def _harmony_final(self) -> tuple[int, ...] | None:
        """The token ids of ``<|channel|>final<|message|>`` (None, logged once, where the
        markers are not special tokens of this tokenizer: the grammar then holds from the
        first token)."""
        if self._final is None:
            ids = self.hf_tokenizer.encode("<|channel|>final<|message|>",
                                           add_special_tokens=False)
            names = self.hf_tokenizer.convert_ids_to_tokens([ids[0], ids[-1]])
            self._final = tuple(ids) if names == ["<|channel|>", "<|message|>"] else ()
            if not self._final:
                logger.warning("structured outputs: <|channel|> / <|message|> are not tokens "
                               "of this tokenizer; the grammar holds from the first token")
        return self._final or None

    def _token_id(self, tag: str) -> int:
        """The token id of ``tag`` (-1 where the tokenizer spells it with several tokens)."""
        if tag not in self._ids:
            ids = self.hf_tokenizer.encode(tag, add_special_tokens=False)
            self._ids[tag] = ids[0] if len(ids) == 1 else -1
        return self._ids[tag]

    def _spell(self, tag: str) -> TextTag:
        """``tag`` (several tokens) matched on the text of the tokens (built once: every
        token's bytes, read from the tokenizer; a special token's are empty, as the text the
        parser reads skips it)."""
        if tag not in self._spelled:
            if self._vocab is None:
                tokenizer = self.tokenizer
                self._vocab = [b"" if tokenizer.is_special_token(i)
                               else tokenizer.decode_bytes([i])
                               for i in range(min(tokenizer.vocab_size, self.vocab_size))]
            self._spelled[tag] = TextTag(tag.encode(), self._vocab, self.words)
        return self._spelled[tag]
