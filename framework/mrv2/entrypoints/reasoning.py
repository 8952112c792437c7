"""``mrv2 serve --reasoning-parser``: a thinking model's ``<think>...</think>`` text as the
chat message's ``reasoning_content``, the rest as its ``content`` (vLLM's fields and parser
names).

The conventions, as vLLM's parsers:

* ``qwen3``: the output may open with ``<think>`` (leading whitespace allowed); what lies
  between it and ``</think>`` is reasoning, what follows is content. An output that does not
  open with ``<think>`` is all content (``enable_thinking: false``: the template closed the
  block in the prompt). A prompt whose template opened the block (Qwen3's ``-Thinking``
  models) is answered as ``deepseek_r1``'s (:func:`prompt_reasoning`), as the engine's
  structured outputs hold it.
* ``deepseek_r1``: the template opens the block in the prompt, so the output is reasoning up
  to ``</think>`` (a leading ``<think>`` is dropped) and content after it; an output without
  ``</think>`` is all reasoning.
* ``minimax_m2`` (MiniMax-M2, whose template also opens the block in the prompt):
  ``deepseek_r1``'s, and a ``</think>`` the model writes again in its content is dropped
  (vLLM's parser drops it too). ``minimax_m2_append_think`` (what MiniMax's guides serve the
  model with) splits nothing: the content is the whole output with the ``<think>`` the prompt
  opened put back in front (``<think>...</think>answer``: MiniMax asks clients to send the
  block back in later turns' messages, which a client that sees it in the content does) and
  there is no ``reasoning_content``.
* ``openai_gptoss`` (gpt-oss): OpenAI's harmony messages (:mod:`mrv2.entrypoints.harmony`):
  the ``analysis`` channel is reasoning; the ``final`` channel and ``commentary`` preambles
  (no recipient) are content; calls (``to=functions.NAME``) are neither (the ``openai``
  tool-call parser reads them from the whole output). Its markers are special tokens: the
  server decodes a chat request with ``skip_special_tokens=False`` (:func:`keeps_special_tokens`),
  and no marker reaches the client. Text that opens with no harmony header is content.

A stream is split as it arrives (:class:`ReasoningStream`): text that may still turn out to
be part of a tag is held back until the next delta decides it, so no tag ever reaches the
client (but ``minimax_m2_append_think``'s, which are content) and no text is lost or
repeated.
"""

from __future__ import annotations

from collections.abc import Callable

from mrv2.entrypoints.harmony import HarmonyStream

#: ``--reasoning-parser`` values.
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss", "minimax_m2",
                     "minimax_m2_append_think")
#: The parsers of a ``<think>`` block, each with the convention the engine's structured
#: outputs know it by (the grammar holds what follows the block; vLLM's MiniMax-M2 parsers
#: end the reasoning at ``</think>`` as DeepSeek-R1's does, ``minimax_m2_append_think``
#: included, though it leaves the block in the content).
THINK_PARSERS = {"qwen3": "qwen3", "deepseek_r1": "deepseek_r1", "minimax_m2": "deepseek_r1",
                 "minimax_m2_append_think": "deepseek_r1"}

START, END = "<think>", "</think>"


def check_reasoning_parser(name: str | None) -> str | None:
    """``name`` if it is a parser (or None); ValueError listing the parsers otherwise."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: allowed values are "
                         f"{', '.join(REASONING_PARSERS)}")
    return name


def grammar_mark(kind: str | None) -> str | None:
    """What a structured output is marked with under the reasoning parser ``kind``
    (``SamplingParams._reasoning``: the convention the engine knows, its grammar then holding
    only what follows the thinking); None: no mark, the grammar holds from the first token."""
    return kind if kind == "openai_gptoss" else THINK_PARSERS.get(kind or "")


def prompt_reasoning(kind: str | None, prompt: list[int],
                     encode: Callable[[str], list[int]]) -> str | None:
    """The parser of an answer to ``prompt`` (token ids; ``encode``: text to ids, no special
    tokens added): ``qwen3``'s to a prompt that opened the ``<think>`` block (its last
    ``<think>`` after its last ``</think>``: Qwen3's thinking models' template) is
    ``deepseek_r1``'s, the answer opening in the reasoning (the engine's structured outputs
    likewise hold the grammar from its ``</think>``); ``kind`` otherwise, or where either tag
    is not one token."""
    if kind != "qwen3":
        return kind
    tags = [encode(tag) for tag in (START, END)]
    if not all(len(ids) == 1 for ids in tags):
        return kind
    start, end = tags[0][0], tags[1][0]
    for token in reversed(prompt):
        if token == end:
            return kind
        if token == start:
            return "deepseek_r1"
    return kind


def keeps_special_tokens(kind: str | None) -> bool:
    """Whether the parser's markers are special tokens, which a request must be decoded
    keeping (``skip_special_tokens=False``)."""
    return kind == "openai_gptoss"


def split_reasoning(kind: str, text: str) -> tuple[str | None, str | None]:
    """A finished output's ``(reasoning_content, content)``; None for an empty part."""
    stream = ReasoningStream(kind)
    reasoning, content = stream.feed(text, final=True)
    return reasoning or None, content or None


def held_tag_prefix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may begin ``tag`` (a stream holds them back
    until the next delta decides; the tool-call parser uses it too)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits one choice's text deltas into ``(reasoning, content)`` deltas."""

    def __init__(self, kind: str) -> None:
        check_reasoning_parser(kind)
        self.kind = kind
        self.state = "start"  # until the output's first characters say whether it opens <think>
        self.pending = ""  # text not yet sent: it may still be (part of) a tag
        self.harmony = HarmonyStream() if kind == "openai_gptoss" else None

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The next delta of the output's text; ``final``: nothing follows (held text goes
        out as it is)."""
        if self.harmony is not None:
            pieces = self.harmony.feed(delta, final)
            return ("".join(p.text for p in pieces if p.kind == "reasoning"),
                    "".join(p.text for p in pieces if p.kind == "content"))
        if self.kind == "minimax_m2_append_think":  # all content, the prompt's <think> first
            opened, self.state = self.state == "start", "content"
            return "", START + delta if opened else delta
        text = self.pending + delta
        self.pending = ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text, self.state = stripped[len(START):], "reasoning"
                elif START.startswith(stripped) and not final:
                    self.pending = text  # whitespace or a part of <think>: wait
                    break
                else:  # no opening tag: qwen3's output is all content, R1's opens reasoning
                    self.state = "content" if self.kind == "qwen3" else "reasoning"
                continue
            if self.state == "content" and self.kind != "minimax_m2":
                content += text
                break
            # the text up to </think> (reasoning; minimax_m2's content drops a </think> again)
            end = text.find(END)
            cut = end if end >= 0 else len(text) - (0 if final else held_tag_prefix(text, END))
            if self.state == "content":
                content += text[:cut]
            else:
                reasoning += text[:cut]
            if end < 0:
                self.pending = text[cut:]
                break
            text, self.state = text[end + len(END):], "content"
        return reasoning, content
