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

* ``deepseek_v3`` (DeepSeek-V3.1 / V3.2): ``deepseek_r1``'s where the request's
  ``chat_template_kwargs`` turn thinking on (``thinking`` or ``enable_thinking`` true: the
  template opens the block), else no split (the whole output is content). ``glm45`` /
  ``glm47`` (GLM-4.5 / 4.6 / 4.7) and ``holo2`` (Holo2, on Qwen3-VL; vLLM's
  ``DeepSeekV3ReasoningWithThinkingParser`` all three): the same with thinking on unless
  the request sets either switch (GLM's template closes the block with
  ``enable_thinking: false``). ``exaone4`` (EXAONE 4.0): ``enable_thinking``
  alone decides. ``nemotron_v3`` (Nemotron 3 Nano): ``deepseek_r1``'s, but with
  ``enable_thinking: false`` an output that does not open ``<think>`` is content
  (``qwen3``'s: vLLM's whole answer likewise, its stream would call it reasoning).
* ``ernie45`` (ERNIE-4.5 Thinking): ``deepseek_r1``'s; the newlines after ``</think>`` are
  dropped, and a content wrapped in ``<response>...</response>`` is what the wrapper holds
  (what follows its last ``</response>`` is dropped).
* ``seed_oss`` (Seed-OSS): ``deepseek_r1``'s with ``<seed:think>`` / ``</seed:think>``.
* ``mistral`` (Magistral): ``[THINK]...[/THINK]``, special tokens (the request is decoded
  keeping them, :func:`keeps_special_tokens`); the block may open anywhere (text before it
  is content, a ``[/THINK]`` before any ``[THINK]`` is dropped), a block not closed is
  reasoning to the end, an output with no ``[THINK]`` is content.
* ``gemma4`` (Gemma 4): ``<|channel>thought\\n...<channel|>`` (special tokens, kept): the
  output may open the block (the ``thought\\n`` label dropped), else it is content.
* ``granite`` (Granite 3.2 / 3.3 with ``thinking: true``): plain-text markers: an output
  that opens with "Here is my thought process:" (or "Here's ...") is reasoning up to
  "Here is my response:" (or "Here's ..."), content after it; any other output is content.
  A thought process cut off before its response is reasoning (vLLM's stream; its whole
  answer calls it content). The engine cannot hold a grammar after text markers: a
  structured output of a request that turns ``thinking`` on is refused (400,
  :func:`structured_refusal`); without it the grammar holds from the first token.
* ``kimi_k2`` (Kimi-K2 Thinking): ``deepseek_r1``'s, and a tool-call section
  (``<|tool_calls_section_begin|>``) opened in the thinking ends it too: the section stays
  in the content, where the ``kimi_k2`` tool-call parser reads it; a request whose
  ``chat_template_kwargs`` set ``thinking`` false is not split. (Where both come, the first
  one ends it: vLLM's stream; its whole answer looks for ``</think>`` first.)
* ``olmo3`` (Olmo 3 Think, whose template opens ``<think>`` in the prompt) and ``step3``
  (Step3): ``deepseek_r1``'s (an output cut off before ``</think>`` is reasoning: vLLM's
  stream; ``olmo3``'s whole answer calls it content); ``step3`` leaves a ``<think>`` the
  model writes in the reasoning, as vLLM's. Olmo 3's tags are plain text (several tokens): a
  structured output's grammar holds from the token after ``</think>``, found in the output's
  text however the model splits it. ``step3p5`` (Step-3.5): ``deepseek_r1``'s, and
  one newline right before ``</think>`` and one right after it are dropped (a cut-off
  reasoning's last newline too); a structured output may write that newline before its
  grammar's first token (vLLM leaves that token free).
* ``hunyuan_a13b`` (Hunyuan-A13B): the output may open with ``<think>\\n``; the reasoning
  runs to ``\\n</think>\\n<answer>\\n`` (or without its first newline), the content to
  ``\\n</answer>`` (what follows is dropped); an output that does not open the block is
  content (up to a ``\\n</answer>`` likewise), a thinking cut off is reasoning (vLLM's
  stream). The tags are plain text (several tokens): a structured output holds what follows
  ``</think>\\n<answer>\\n`` (found in the output's text) where the prompt opened the block,
  and from the first token otherwise (the model cannot open the block itself: the answer is
  content).
* ``mimo`` (Xiaomi MiMo): ``qwen3``'s (vLLM's same parser).

The parsers that read the chat template's switches are resolved per request
(:func:`request_parser`) to one of the others, or to ``identity`` (no split: all content).

A ``--reasoning-parser-plugin`` file adds parsers of its own with
:func:`register_reasoning_parser` (vLLM's ``ReasoningParserManager.register_module``); its
:class:`ReasoningParser` is either tags, read by the built-in parsers' machinery (a
:class:`Block`), or a splitter of the built-ins' contract (:class:`ReasoningSplitter`)::

    from mrv2.entrypoints.reasoning import Block, ReasoningParser, register_reasoning_parser

    register_reasoning_parser(ReasoningParser("my_tags", Block(("<plan>",), ("</plan>",),
                                                               "output")))

A stream is split as it arrives (:class:`ReasoningStream`): text that may still turn out to
be part of a tag is held back until the next delta decides it, so no tag ever reaches the
client (but ``minimax_m2_append_think``'s and Kimi-K2's tool-call section, which are
content, and the ``<think>`` a Step3 model writes, which is reasoning) and no text is lost or
repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mrv2.entrypoints.harmony import HarmonyStream

#: ``--reasoning-parser`` values.
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss", "minimax_m2",
                     "minimax_m2_append_think", "deepseek_v3", "glm45", "glm47", "exaone4",
                     "nemotron_v3", "ernie45", "seed_oss", "mistral", "gemma4", "granite",
                     "holo2", "kimi_k2", "olmo3", "step3", "step3p5", "hunyuan_a13b", "mimo")
#: The parsers of a ``<think>`` block, each with the convention the engine's structured
#: outputs know it by (the grammar holds what follows the block; vLLM's MiniMax-M2 parsers
#: end the reasoning at ``</think>`` as DeepSeek-R1's does, ``minimax_m2_append_think``
#: included, though it leaves the block in the content).
THINK_PARSERS = {"qwen3": "qwen3", "deepseek_r1": "deepseek_r1", "minimax_m2": "deepseek_r1",
                 "minimax_m2_append_think": "deepseek_r1", "ernie45": "deepseek_r1",
                 "kimi_k2": "deepseek_r1", "olmo3": "deepseek_r1", "step3": "deepseek_r1",
                 "step3p5": "step3p5", "mimo": "qwen3"}
#: The other parsers' marks for the engine (:data:`mrv2.engine.structured_outputs.THINK_BLOCKS`
#: : their own tags; gpt-oss's harmony headers).
OTHER_MARKS = {"openai_gptoss": "openai_gptoss", "seed_oss": "seed_oss", "mistral": "mistral",
               "gemma4": "gemma4", "hunyuan_a13b": "hunyuan_a13b"}
#: ``deepseek_v3``'s with thinking on unless a request's switch says otherwise (vLLM's
#: ``DeepSeekV3ReasoningWithThinkingParser``: GLM-4.5 / 4.6 / 4.7, Holo2).
THINKING_BY_DEFAULT = ("glm45", "glm47", "holo2")
#: What :func:`request_parser` resolves a request's parser to besides the others: no split.
IDENTITY = "identity"

START, END = "<think>", "</think>"
GRANITE_THINK = ("Here is my thought process:", "Here's my thought process:")
GRANITE_RESPONSE = ("Here is my response:", "Here's my response:")
RESPONSE, RESPONSE_END = "<response>", "</response>"
KIMI_TOOLS = "<|tool_calls_section_begin|>"
HUNYUAN_ANSWER = "</think>\n<answer>\n"


@dataclass(frozen=True)
class Block:
    """A parser's thinking block: the tags that open and close it (any of each), and
    ``opens``: ``output`` (the output may open with it, leading whitespace allowed; else it
    is all content), ``prompt`` (the template opened it: the output starts in it, a start
    tag there dropped), ``anywhere`` (Magistral's: text before it is content); ``label``: text
    dropped right after the start tag; ``again``: an end tag written again in the content is
    dropped; ``response``: ERNIE's content (newlines after the block dropped, a
    ``<response>`` wrapper taken off); ``kept``: the end tags that stay in the content
    (Kimi-K2's tool-call section); ``trim``: one newline right after the end tag dropped
    (Step-3.5's; the one before it is an end tag of its own) and a cut-off reasoning's last;
    ``closes``: where the content ends (what follows is dropped: Hunyuan's ``</answer>``)."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    opens: str
    label: str = ""
    again: bool = False
    response: bool = False
    kept: tuple[str, ...] = ()
    trim: bool = False
    closes: str = ""


BLOCKS = {
    "qwen3": Block((START,), (END,), "output"),
    "deepseek_r1": Block((START,), (END,), "prompt"),
    "minimax_m2": Block((START,), (END,), "prompt", again=True),
    "ernie45": Block((START,), (END,), "prompt", response=True),
    "seed_oss": Block(("<seed:think>",), ("</seed:think>",), "prompt"),
    "mistral": Block(("[THINK]",), ("[/THINK]",), "anywhere"),
    "gemma4": Block(("<|channel>",), ("<channel|>",), "output", label="thought\n"),
    "granite": Block(GRANITE_THINK, GRANITE_RESPONSE, "output"),
    "kimi_k2": Block((START,), (END, KIMI_TOOLS), "prompt", kept=(KIMI_TOOLS,)),
    "olmo3": Block((START,), (END,), "prompt"),
    "step3": Block((), (END,), "prompt"),
    "step3p5": Block((START,), ("\n" + END, END), "prompt", trim=True),
    "hunyuan_a13b": Block((START + "\n",), ("\n" + HUNYUAN_ANSWER, HUNYUAN_ANSWER), "output",
                          closes="\n</answer>"),
    "mimo": Block((START,), (END,), "output"),
}


#: The engine's conventions a plugin's parser may name for structured outputs
#: (:attr:`ReasoningParser.grammar`: :data:`mrv2.engine.structured_outputs.THINK_BLOCKS`'s, and
#: gpt-oss's harmony headers).
ENGINE_MARKS = ("qwen3", "deepseek_r1", "seed_oss", "step3p5", "hunyuan_a13b", "mistral",
                "gemma4", "openai_gptoss")


class ReasoningSplitter(Protocol):
    """What a plugin's :attr:`ReasoningParser.splitter` makes, one for each choice: the
    built-in parsers' contract (:class:`ReasoningStream`)."""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The next text delta of the output: its ``(reasoning, content)`` parts to send now
        (text that may still be part of a tag held back for the next delta); ``final``:
        nothing follows (send what is held). A whole answer is one call with ``final``."""
        ...


@dataclass(frozen=True)
class ReasoningParser:
    """A ``--reasoning-parser`` a ``--reasoning-parser-plugin`` file registers
    (:func:`register_reasoning_parser`), named ``name``. Either ``block``: its tags, split as
    the built-in parsers split theirs (:class:`Block`: where the block opens, its start and
    end tags; a tag split across deltas is held back, never sent), or ``splitter``: a class
    (or any function of no arguments) making a :class:`ReasoningSplitter` for each choice,
    which splits the streamed deltas and, fed once with ``final``, the whole answer.
    ``special_tokens``: its tags are special tokens (a chat request is decoded keeping them,
    ``skip_special_tokens: false``). ``grammar``: the engine's convention whose thinking block
    a structured output waits for (one of :data:`ENGINE_MARKS`; its tags must be the model's);
    None: a structured output is refused (400) under this parser, as the engine cannot tell
    where its reasoning ends."""

    name: str
    block: Block | None = None
    splitter: Callable[[], ReasoningSplitter] | None = None
    special_tokens: bool = False
    grammar: str | None = None


#: The parsers plugins registered (:func:`register_reasoning_parser`), by name.
PLUGINS: dict[str, ReasoningParser] = {}


def register_reasoning_parser(parser: ReasoningParser) -> ReasoningParser:
    """Add ``parser`` (what a ``--reasoning-parser-plugin`` file calls; vLLM's
    ``ReasoningParserManager.register_module``): ``--reasoning-parser`` then takes its name.
    ValueError for a name taken already (a built-in parser's or another plugin's), for
    neither or both of ``block`` and ``splitter``, for a block whose tags cannot open and
    close it, and for a ``grammar`` the engine does not know. Returns ``parser``."""
    if not isinstance(parser, ReasoningParser):
        raise ValueError("register_reasoning_parser: expected a ReasoningParser, got "
                         f"{type(parser).__name__}")
    name = parser.name
    if not name or not isinstance(name, str):
        raise ValueError("a reasoning parser needs a name")
    if name in REASONING_PARSERS or name in PLUGINS or name == IDENTITY:
        raise ValueError(f"reasoning parser {name!r} is registered already")
    if (parser.block is None) == (parser.splitter is None):
        raise ValueError(f"reasoning parser {name!r}: give its block (tags) or its splitter, "
                         "one of them")
    block = parser.block
    if block is not None:
        if not isinstance(block, Block) or block.opens not in ("output", "prompt", "anywhere"):
            raise ValueError(f"reasoning parser {name!r}: block must be a Block whose opens "
                             "is 'output', 'prompt' or 'anywhere'")
        if (not isinstance(block.starts, tuple) or not isinstance(block.ends, tuple)
                or not block.ends or (block.opens != "prompt" and not block.starts)
                or not all(isinstance(t, str) and t for t in block.starts + block.ends)):
            raise ValueError(f"reasoning parser {name!r}: its block needs tuples of end tags "
                             "(and of start tags, unless the prompt opens it), none empty")
    elif not callable(parser.splitter):
        raise ValueError(f"reasoning parser {name!r}: splitter must be a class or function")
    if parser.grammar is not None and parser.grammar not in ENGINE_MARKS:
        raise ValueError(f"reasoning parser {name!r}: grammar={parser.grammar!r}: expected "
                         f"one of {', '.join(ENGINE_MARKS)} (or None)")
    PLUGINS[name] = parser
    return parser


def reasoning_parser_names() -> tuple[str, ...]:
    """The ``--reasoning-parser`` values: the built-in ones, then the plugins'."""
    return REASONING_PARSERS + tuple(PLUGINS)


def check_reasoning_parser(name: str | None) -> str | None:
    """``name`` if it is a parser (or None); ValueError listing the parsers otherwise."""
    if name is not None and name not in REASONING_PARSERS and name not in PLUGINS:
        raise ValueError(f"reasoning_parser={name!r}: allowed values are "
                         f"{', '.join(reasoning_parser_names())} (or a name a "
                         "--reasoning-parser-plugin file registers)")
    return name


def request_parser(kind: str | None, kwargs: Mapping[str, Any] | None) -> str | None:
    """The parser of one request's answer: those that read the chat template's thinking
    switches (``kwargs``: the request's ``chat_template_kwargs``; none for a completion)
    resolved to ``deepseek_r1``'s, ``qwen3``'s or :data:`IDENTITY`; ``kind`` otherwise."""
    kw = kwargs or {}
    thinking, enable = kw.get("thinking"), kw.get("enable_thinking")
    if kind == "deepseek_v3" or (kind in THINKING_BY_DEFAULT
                                 and (thinking is not None or enable is not None)):
        return "deepseek_r1" if bool(thinking) or bool(enable) else IDENTITY
    if kind in THINKING_BY_DEFAULT:  # (thinking unless the request turns it off)
        return "deepseek_r1"
    if kind == "exaone4":
        return "deepseek_r1" if bool(enable) else IDENTITY
    if kind == "nemotron_v3":
        return "qwen3" if enable is False else "deepseek_r1"
    if kind == "kimi_k2" and "thinking" in kw and not thinking:  # (vLLM's: on by default)
        return IDENTITY
    return kind


def structured_refusal(kind: str | None, kwargs: Mapping[str, Any] | None) -> str | None:
    """Why a structured output cannot be held under the parser ``kind`` for a request with
    these ``chat_template_kwargs`` (None: it can): Granite's thought process ends at a text
    marker, which the engine's grammar cannot wait for."""
    plugin = PLUGINS.get(kind or "")
    if plugin is not None and plugin.grammar is None:
        return (f"a structured output is not supported with --reasoning-parser {kind} (the "
                "plugin's parser names no grammar convention: the engine cannot tell where "
                "its reasoning ends)")
    if kind == "granite" and bool((kwargs or {}).get("thinking")):
        return ("a structured output is not supported with --reasoning-parser granite and "
                "chat_template_kwargs thinking: true (the thought process ends at a text "
                "marker, which the grammar cannot wait for); turn thinking off")
    return None


def grammar_mark(kind: str | None) -> str | None:
    """What a structured output is marked with under the (request's) reasoning parser
    ``kind`` (``SamplingParams._reasoning``: the convention the engine knows, its grammar
    then holding only what follows the thinking); None: no mark, the grammar holds from the
    first token (no parser, :data:`IDENTITY`, ``granite``)."""
    kind = request_parser(kind, None)
    plugin = PLUGINS.get(kind or "")
    if plugin is not None:
        return plugin.grammar
    return OTHER_MARKS.get(kind or "") or THINK_PARSERS.get(kind or "")


def prompt_reasoning(kind: str | None, prompt: list[int],
                     encode: Callable[[str], list[int]]) -> str | None:
    """The parser of an answer to ``prompt`` (token ids; ``encode``: text to ids, no special
    tokens added): ``qwen3``'s (or ``mimo``'s) to a prompt that opened the ``<think>``
    block (its last ``<think>`` after its last ``</think>``: Qwen3's thinking models'
    template) is ``deepseek_r1``'s, the answer opening in the reasoning (the engine's
    structured outputs likewise hold the grammar from its ``</think>``); ``kind`` otherwise,
    or where either tag is not one token."""
    if kind not in ("qwen3", "mimo"):
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
    plugin = PLUGINS.get(kind or "")
    return plugin.special_tokens if plugin is not None else kind in (
        "openai_gptoss", "mistral", "gemma4")


def harmony_format(kind: str | None) -> bool:
    """Whether the parser reads gpt-oss's harmony messages (whose chat template reads an
    assistant call's reasoning as its thinking)."""
    return kind == "openai_gptoss"


def split_reasoning(kind: str, text: str) -> tuple[str | None, str | None]:
    """A finished output's ``(reasoning_content, content)``; None for an empty part."""
    stream = ReasoningStream(kind)
    reasoning, content = stream.feed(text, final=True)
    return reasoning or None, content or None


def held_tag_prefix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may begin ``tag`` (a stream holds them back
    until the next delta decides; the tool-call parser uses it too)."""
    n, last = min(len(tag) - 1, len(text)), text[-1:]
    while n > 0:  # (only where the tag has the text's last character: a delta's usual work)
        n = tag.rfind(last, 0, n) + 1
        if n and text.endswith(tag[:n]):
            return n
        n -= 1
    return 0


def _find(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The first of ``tags`` in ``text``: its index (-1: none) and the tag."""
    found = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(found) if found else (-1, "")


def _held(text: str, tags: tuple[str, ...]) -> int:
    return max(held_tag_prefix(text, t) for t in tags)


class ReasoningStream:
    """Splits one choice's text deltas into ``(reasoning, content)`` deltas. ``state``:
    ``start`` (the output's first characters may still open the block), ``reasoning`` or
    ``content`` (past the reasoning: the Responses API reads it)."""

    def __init__(self, kind: str) -> None:
        if kind != IDENTITY:
            check_reasoning_parser(kind)
        kind = request_parser(kind, None) or kind  # (a switched parser's default)
        self.kind = kind
        self.block = BLOCKS.get(kind)
        plugin = PLUGINS.get(kind)
        #: A plugin's splitter (:class:`ReasoningSplitter`; a plugin's tags: :attr:`block`).
        self.splitter = None if plugin is None or plugin.splitter is None else plugin.splitter()
        if plugin is not None and plugin.block is not None:
            self.block = plugin.block
        self.state = "start"  # until the output's first characters say whether it opens <think>
        self.pending = ""  # text not yet sent: it may still be (part of) a tag
        self.harmony = HarmonyStream() if kind == "openai_gptoss" else None
        self.label = self.block is not None and bool(self.block.label)  # (still to drop)
        self.lead = self.block is not None and self.block.response  # ERNIE's content's start
        self.wrapped = False  # ERNIE's content opened <response>
        self.stray = False  # Magistral's output dropped an end tag before any block
        self.trimming = False  # Step-3.5's newline after </think> still to drop
        self.closed = False  # Hunyuan's content ended (</answer>): the rest is dropped

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The next delta of the output's text; ``final``: nothing follows (held text goes
        out as it is)."""
        if self.harmony is not None:
            pieces = self.harmony.feed(delta, final)
            return ("".join(p.text for p in pieces if p.kind == "reasoning"),
                    "".join(p.text for p in pieces if p.kind == "content"))
        if self.splitter is not None:
            return self._plugin(delta, final)
        if self.kind == "minimax_m2_append_think":  # all content, the prompt's <think> first
            opened, self.state = self.state == "start", "content"
            return "", START + delta if opened else delta
        if self.block is None:  # identity: no split
            self.state = "content"
            return "", delta
        text = self.pending + delta
        self.pending = ""
        out = {"reasoning": "", "content": ""}
        while text and self.pending == "":
            step = getattr(self, f"_{self.state}")
            text = step(text, final, out)
        return out["reasoning"], out["content"]

    def _plugin(self, delta: str, final: bool) -> tuple[str, str]:
        """A plugin's splitter's parts (TypeError naming the parser where they are not two
        strings); :attr:`state` from them: ``content`` after a delta with content,
        ``reasoning`` after one with reasoning only."""
        assert self.splitter is not None
        parts = self.splitter.feed(delta, final)
        if not (isinstance(parts, tuple) and len(parts) == 2
                and all(isinstance(p, str) for p in parts)):
            raise TypeError(f"reasoning parser {self.kind!r}: feed returned {parts!r}, "
                            "expected (reasoning, content) strings")
        reasoning, content = parts
        if content:
            self.state = "content"
        elif reasoning:
            self.state = "reasoning"
        return reasoning, content

    def _start(self, text: str, final: bool, out: dict[str, str]) -> str:
        block = self.block
        assert block is not None
        if block.opens == "anywhere":  # Magistral: content up to the start tag
            tags = block.starts + (() if self.stray else block.ends)
            at, tag = _find(text, tags)
            if at < 0:
                cut = len(text) - (0 if final else _held(text, tags))
                out["content"] += text[:cut]
                self.pending = text[cut:]
                return ""
            out["content"] += text[:at]
            if tag in block.starts:
                self.state = "reasoning"
            else:
                self.stray = True  # the first end tag before the block: dropped
            return text[at + len(tag):]
        stripped = text.lstrip()
        for tag in block.starts:
            if stripped.startswith(tag):
                self.state = "reasoning"
                return stripped[len(tag):]
        if any(tag.startswith(stripped) for tag in block.starts) and not final:
            self.pending = text  # whitespace or a part of a start tag: wait
            return ""
        # no opening tag: qwen3's output is all content, R1's opens in the reasoning
        self.state = "content" if block.opens == "output" else "reasoning"
        self.label = self.label and self.state == "reasoning"
        return text

    def _reasoning(self, text: str, final: bool, out: dict[str, str]) -> str:
        block = self.block
        assert block is not None
        if self.label:  # gemma4's "thought\n" after the start tag
            if text.startswith(block.label):
                text, self.label = text[len(block.label):], False
            elif block.label.startswith(text) and not final:
                self.pending = text
                return ""
            else:
                self.label = False
            if not text:
                return ""
        rest = self._upto_end(text, final, out, "reasoning")
        if rest is None:
            return ""
        self.state = "content"
        self.trimming = block.trim
        return rest

    def _content(self, text: str, final: bool, out: dict[str, str]) -> str:
        block = self.block
        assert block is not None
        if self.lead:  # ERNIE: newlines after </think> dropped, then maybe <response>
            text = text.lstrip("\n")
            if not text:
                return ""
            if text.startswith(RESPONSE):
                text, self.wrapped = text[len(RESPONSE):], True
            elif RESPONSE.startswith(text) and not final:
                self.pending = text
                return ""
            self.lead = False
            if not text:
                return ""
        if self.wrapped:  # up to the last </response> (held from one until the next)
            at = text.rfind(RESPONSE_END)
            if final:
                out["content"] += text[:at] if at >= 0 else text
                return ""
            cut = at if at >= 0 else len(text) - held_tag_prefix(text, RESPONSE_END)
            out["content"] += text[:cut]
            self.pending = text[cut:]
            return ""
        if self.trimming:  # Step-3.5: one newline right after </think> dropped
            text, self.trimming = text.removeprefix("\n"), False
        if block.closes:  # Hunyuan: the content up to </answer>, nothing after it
            at = -1 if self.closed else text.find(block.closes)
            cut = (0 if self.closed else at if at >= 0
                   else len(text) - (0 if final else held_tag_prefix(text, block.closes)))
            out["content"] += text[:cut]
            self.closed = self.closed or at >= 0
            self.pending = "" if self.closed else text[cut:]
            return ""
        if not block.again:
            out["content"] += text
            return ""
        # minimax_m2: a </think> again in the content is dropped
        rest = self._upto_end(text, final, out, "content")
        return "" if rest is None else rest

    def _upto_end(self, text: str, final: bool, out: dict[str, str], key: str) -> str | None:
        """``text`` onto ``out[key]`` up to the block's first end tag: what follows the tag,
        or None where ``text`` holds none (its tail that may begin one held back, unless
        ``final``)."""
        block = self.block
        assert block is not None
        at, tag = _find(text, block.ends)
        cut = at if at >= 0 else len(text) - (0 if final else _held(text, block.ends))
        part = text[:cut]
        if at < 0 and final and block.trim and key == "reasoning":
            part = part.removesuffix("\n")  # (Step-3.5's cut-off reasoning's last newline)
        out[key] += part
        if at < 0:
            self.pending = text[cut:]
            return None
        return text[at if tag in block.kept else at + len(tag):]  # (Kimi's tool section)
