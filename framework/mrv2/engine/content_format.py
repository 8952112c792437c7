"""``--chat-template-content-format auto`` as vLLM resolves it: a chat template that loops
over a message's content (``{% for part in message['content'] %}``, the message itself one
of a loop over ``messages`` or over a variable set from it, such as ``loop_messages =
messages[1:]``) reads content parts, and is given ``openai`` content (a list of ``{"type":
"text", "text": ...}`` parts); any other template is given ``string`` content (one text).

The template is parsed, never rendered (:func:`detect_content_format`, cached per template
text); a template that does not parse is given ``string``, as vLLM's default.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal

from mrv2.engine.media import part_text

__all__ = ["CONTENT_FORMATS", "ResolvedFormat", "detect_content_format",
           "resolve_content_format", "template_in_use", "text_parts"]

ResolvedFormat = Literal["string", "openai"]
#: The values ``chat_template_content_format`` takes (the server's flag, ``LLM.chat``'s).
CONTENT_FORMATS = ("auto", "string", "openai")


def template_in_use(chat_template: str | dict[str, str] | None, tools: bool) -> str | None:
    """The Jinja text transformers renders of the tokenizer's ``chat_template``: a named
    set's ``tool_use`` template when the request offers tools (and the set has one), else
    its ``default``."""
    if isinstance(chat_template, dict):
        if tools and "tool_use" in chat_template:
            return chat_template["tool_use"]
        return chat_template.get("default")
    return chat_template or None


def resolve_content_format(given: str, template: str | None) -> ResolvedFormat:
    """The content format of the flag's value ``given`` for the chat template ``template``:
    ``auto`` is :func:`detect_content_format`'s answer (``string`` without a template)."""
    if given == "openai":
        return "openai"
    if given != "auto" or not template:
        return "string"
    return detect_content_format(template)


def text_parts(content: Any) -> list[dict[str, str]]:
    """A text message's content as ``openai`` gives it to the template: a list of ``{"type":
    "text", "text": ...}`` parts (a string one part; a list's text parts), empty texts
    dropped, as vLLM drops them."""
    texts = ([content] if isinstance(content, str)
             else [part_text(p) for p in content] if isinstance(content, list) else [])
    return [{"type": "text", "text": text} for text in texts if text]


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ResolvedFormat:
    """``openai`` where the chat template ``template`` loops over a message's content (see
    the module doc), else ``string`` (a template that does not parse included)."""
    import jinja2

    try:
        root = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    return "openai" if any(True for _ in _content_loops(root)) else "string"


@lru_cache(maxsize=1)
def _environment() -> Any:
    """A Jinja environment that parses what transformers' chat templates may use: its
    ``{% generation %}`` block and the loop controls (``break``, ``continue``)."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: parsed as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[GenerationTag, jinja2.ext.loopcontrols])


def _reads(node: Any, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of the variables ``names`` (with ``key``: its ``key`` item or
    attribute), through filters, tests and slices (``messages | reverse``,
    ``messages[1:]``, ``message['content'] | list``)."""
    from jinja2 import nodes

    while (isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None
           or isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getitem):
        item = node.arg
        found = isinstance(item, nodes.Const) and item.value == key
    elif isinstance(node, nodes.Getattr):
        found = node.attr == key
    else:
        return False
    return found and _reads(node.node, names)


def _loop_names(root: Any, over: set[str], key: str | None = None) -> Iterator[str]:
    """The names of the ``for`` loops' variables over one of ``over`` (its ``key``)."""
    from jinja2 import nodes

    for loop in root.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, over, key):
            yield loop.target.name


def _content_loops(root: Any) -> Iterator[str]:
    """The variables of the loops over a message's content in the parsed template ``root``."""
    from jinja2 import nodes

    lists = {"messages"}  # and what is set from it, transitively
    assigns = [a for a in root.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    grown = True
    while grown:
        grown = False
        for assign in assigns:
            if assign.target.name not in lists and _reads(assign.node, lists):
                lists.add(assign.target.name)
                grown = True
    messages = set(_loop_names(root, lists))
    if messages:
        yield from _loop_names(root, messages, "content")
