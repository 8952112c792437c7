"""Thin wrapper over a HF tokenizer loaded from a local model directory.

Decoding never applies ``clean_up_tokenization_spaces``: the clean-up is not local to a token
window, so incremental detokenization (see ``detokenizer.py``) could not reproduce it. Text from
``Tokenizer.decode`` is therefore exactly what the tokenizer's own decoder produces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


class Tokenizer:
    """A HF tokenizer (``.hf``) with the small API the engine needs.

    ``Tokenizer(model_dir)`` loads the tokenizer of a local model directory (never downloads);
    ``Tokenizer(hf_tokenizer)`` wraps an already loaded HF tokenizer.
    """

    def __init__(self, source: str | Path | Any, **kwargs: Any) -> None:
        if isinstance(source, (str, Path)):
            self.model_dir: Path | None = Path(source)
            self.hf: Any = _load_hf_tokenizer(self.model_dir, **kwargs)
        else:
            self.model_dir = None
            self.hf = source
        # Fast tokenizers: decode through the Rust object directly (same result, less overhead).
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._backend: Any = backend if getattr(self.hf, "is_fast", False) else None

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` of a fast tokenizer (what ``decode`` runs); else None."""
        return self._backend

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> Tokenizer:
        return cls(Path(model_dir), **kwargs)

    # -- encoding -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one prompt, as the tokenizer pairs them (``tokenizer(text=first,
        text_pair=second)``: its pair template's special tokens and separators; what vLLM and
        sentence-transformers' CrossEncoder give a cross-encoder)."""
        return list(self.hf(text=first, text_pair=second)["input_ids"])

    def render_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
        tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
        documents: list[dict[str, Any]] | None = None, chat_template: str | None = None,
        **kwargs: Any
    ) -> str:
        """The chat template applied to ``messages``, as text: ``tools`` offered to the model,
        ``documents`` to ground its answer (a RAG template's), the last message continued
        (``continue_final_message``); ``kwargs`` are the template's own variables
        (``enable_thinking=False`` for Qwen3's: :func:`check_template_kwargs`).
        ``chat_template``: Jinja text rendered instead of the tokenizer's own template (a
        request's, vLLM's ``--trust-request-chat-template``). ValueError where the template
        refuses the messages (its ``raise_exception``) or does not render."""
        check_template_kwargs(kwargs)
        if tools:
            kwargs["tools"] = tools
        if documents:
            kwargs["documents"] = documents
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        elif not self.chat_template:
            raise ValueError(
                f"tokenizer of {self.model_dir or type(self.hf).__name__} has no chat template; "
                "send a plain prompt instead of chat messages"
            )
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except TemplateError as error:  # its raise_exception(...), a bad template: ValueError
            raise ValueError(str(error)) from error  # (a server's 400, as vLLM's)
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
        tokenize: bool = True, add_special_tokens: bool = False, **kwargs: Any
    ) -> Any:
        """Token ids of the rendered chat template (its text carries any BOS it wants; with
        ``add_special_tokens``, vLLM's chat field, the tokenizer's are added on top);
        ``tokenize=False``: the text (as transformers' and vLLM's users call it)."""
        text = self.render_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens) if tokenize else text

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` (Jinja text) instead of the tokenizer's own chat template."""
        self.hf.chat_template = template

    def warm_up(self) -> bool:
        """Encode a text and render a one-message chat once, so a server's first request does
        not pay what their first use costs (Jinja compiles the chat template then: 4.2 ms
        against 0.1 ms for SmolLM2's on this sandbox's CPU; transformers keeps the compiled
        template). A template that refuses such a chat is left for the requests to report.
        Returns whether the template rendered."""
        self.encode("Hello")
        if not self.chat_template:
            return False
        try:
            self.apply_chat_template([{"role": "user", "content": "Hello"}])
        except Exception:  # the template's own rules (e.g. a system message required)
            return False
        return True

    # -- decoding -------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = ids if isinstance(ids, list) else list(ids)
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(
            self.hf.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        )

    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = False
    ) -> list[str]:
        return list(
            self.hf.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens)
        )

    # -- metadata -------------------------------------------------------------------------

    @property
    def eos_token_id(self) -> int | None:
        eos = self.hf.eos_token_id
        return None if eos is None else int(eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def pad_token_id(self) -> int | None:
        pad = self.hf.pad_token_id
        return None if pad is None else int(pad)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of special tokens: the named ones plus added tokens flagged special."""
        ids = {int(i) for i in self.hf.all_special_ids}
        for i, tok in getattr(self.hf, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False):
                ids.add(int(i))
        return sorted(ids)

    @cached_property
    def added_tokens(self) -> dict[int, str]:
        """``{id: text}`` of the added tokens (special or not), as vLLM's detokenizer reads
        them for ``spaces_between_special_tokens=False``."""
        return {int(i): str(getattr(tok, "content", tok))
                for i, tok in getattr(self.hf, "added_tokens_decoder", {}).items()}

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of sentencepiece byte-fallback tokens (``<0x41>``); empty for byte-level BPE."""
        pattern = re.compile(r"<0x[0-9A-Fa-f]{2}>")
        vocab: dict[str, int] = self.hf.get_vocab()
        return frozenset(int(i) for t, i in vocab.items() if pattern.fullmatch(t))

    @cached_property
    def byte_fallback_values(self) -> dict[int, int]:
        """``{id: byte}`` of the byte-fallback tokens where a fast tokenizer's decoder is
        ``ByteFallback`` (a run of them that is not valid UTF-8 decodes to one U+FFFD per
        byte); empty otherwise (a slow tokenizer's decode may differ there)."""
        decoder = getattr(self._backend, "decoder", None)
        try:
            state = json.loads(decoder.__getstate__()) if decoder is not None else {}
        except (TypeError, ValueError, AttributeError):
            return {}
        parts = state.get("decoders", [state]) if isinstance(state, dict) else []
        if not any(isinstance(d, dict) and d.get("type") == "ByteFallback" for d in parts):
            return {}
        vocab: dict[str, int] = self.hf.get_vocab()
        return {int(vocab[t]): int(t[3:5], 16) for t in vocab
                if int(vocab[t]) in self.byte_fallback_ids}

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf)``, not ``hf.vocab_size``)."""
        return int(len(self.hf))

    def __len__(self) -> int:
        return self.vocab_size

    @cached_property
    def max_token_id(self) -> int:
        """The largest token id of the vocabulary, added tokens included (vLLM's
        ``max_token_id``: ``max(get_vocab().values())``)."""
        return int(max(self.hf.get_vocab().values()))

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        template = getattr(self.hf, "chat_template", None)
        return template or None

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.hf).__name__}, dir={self.model_dir}, vocab={self.vocab_size})"


#: Names ``chat_template_kwargs`` may not use: transformers' own ``apply_chat_template``
#: arguments (and the messages), which a template variable must not override.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` (the chat template's own variables, vLLM's field): a dict of
    names not in :data:`RESERVED_TEMPLATE_KWARGS`; ValueError naming the field otherwise."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object of template variables, such "
                         "as {\"enable_thinking\": false}")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved} are not template variables (the "
                         "chat template's own arguments); use the request's fields")
    return dict(kwargs)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as chat templates read it (vLLM's ``parse_chat_messages``), a copy: no
    ``content`` as "", an assistant's ``reasoning`` (or ``reasoning_content``) under both
    names (templates such as Qwen3's read the one, newer clients send the other), its
    ``tool_calls`` with JSON-text ``arguments`` as objects (:func:`template_call`), none or an
    empty list left out. ValueError naming the field on a call that is not a function's."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    if out.get("role") != "assistant":
        return out
    reasoning = out.get("reasoning")
    if reasoning is None:
        reasoning = out.get("reasoning_content")
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    calls = out.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [template_call(c) for c in calls]
    elif not calls:  # (None or []: the template's plain assistant turn, as vLLM's)
        out.pop("tool_calls", None)
    return out


def template_call(call: Any) -> Any:
    """An OpenAI tool call with its ``arguments`` JSON text parsed (a template indexes them);
    as vLLM's ``_postprocess_messages``: a text that is not JSON (empty included), null or
    anything but an object or a list is {}. ValueError naming the field on a call that is
    not ``{"function": {...}}``."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError("messages[].tool_calls: each call must be {\"type\": \"function\", "
                         "\"function\": {\"name\": ..., \"arguments\": ...}}")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:  # (vLLM's: an empty dict for any text that is not JSON)
            arguments = {}
    # (JSON text of null, a number... too: the values the template cannot index)
    function["arguments"] = arguments if isinstance(arguments, (dict, list)) else {}
    return {**call, "function": function}


def _load_hf_tokenizer(path: Path, **kwargs: Any) -> Any:
    if not path.is_dir():
        raise FileNotFoundError(f"directory {path} does not exist")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer files in {path} (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    except Exception as e:
        if not (path / "tokenizer.json").is_file():
            raise RuntimeError(f"could not load the tokenizer in {path}: {e}") from e
        # e.g. an unknown tokenizer_class in tokenizer_config.json: use tokenizer.json alone.
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        hf.chat_template = _read_chat_template(path)
        return hf
    if not getattr(hf, "chat_template", None):  # (a processor's chat_template.json: VL models)
        hf.chat_template = _read_chat_template(path)
    return hf


def _read_chat_template(path: Path) -> str | None:
    """The chat template of the model directory ``path``: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template``, else the ``chat_template`` of
    ``chat_template.json`` (the processor's file, where vision-language checkpoints such as
    Gemma 3's ship theirs: transformers' tokenizer does not read it). A file that is not a
    JSON object is passed over."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.json"):
        file = path / name
        try:
            data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
        except ValueError:
            continue
        template = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(template, str):
            return template
    return None


def _eos_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def load_generation_eos(model_dir: str | Path) -> set[int]:
    """EOS ids of a model: generation_config.json's ``eos_token_id`` plus config.json's.

    Either may be an int or a list; a multimodal config's ``text_config`` counts too.
    """
    path = Path(model_dir)
    eos: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        data = json.loads(file.read_text(encoding="utf-8"))
        eos |= _eos_ids(data.get("eos_token_id"))
        text_config = data.get("text_config")
        if isinstance(text_config, dict):
            eos |= _eos_ids(text_config.get("eos_token_id"))
    return eos
