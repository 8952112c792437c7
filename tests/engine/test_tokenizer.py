"""Tokenizer wrapper: built on a tiny tokenizer trained offline, no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mrv2.engine.tokenizer import Tokenizer, load_generation_eos

CORPUS = [
    "The capital of France is Paris.",
    "Hello world, hello tokenizer!",
    "user assistant system: what is two plus two? Four.",
    "naïve café — 東京 😀",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE trained on CORPUS, saved like a model directory's tokenizer."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer(tok_dir)


def test_encode_decode_roundtrip(tok: Tokenizer) -> None:
    text = "Hello Paris, naïve café 東京 😀!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert tok.decode(iter(ids)) == text


def test_metadata(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None and tok.convert_ids_to_tokens([eos]) == ["</s>"]
    assert isinstance(tok.hf, PreTrainedTokenizerFast)
    specials = set(tok.all_special_ids)
    for name in ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"):
        assert tok.hf.convert_tokens_to_ids(name) in specials
    assert tok.vocab_size == len(tok.hf) == len(tok)
    assert max(tok.encode("\U0001f600 everything")) < tok.vocab_size
    assert tok.pad_token_id is None


def test_convert_ids_to_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world", add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert len(tokens) == len(ids)
    assert "".join(tokens).replace("\u0120", " ") == "Hello world"


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is two plus two?"}]
    text = tok.render_chat_template(messages)
    assert text == "<|user|>What is two plus two?</s><|assistant|>"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.hf.convert_tokens_to_ids("<|assistant|>") == ids[-1]
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == ids[:-1]
    assert tok.decode(no_prompt, skip_special_tokens=False).endswith("</s>")


def test_no_chat_template_error(tmp_path: Path) -> None:
    tok = Tokenizer(build_tokenizer(tmp_path, chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_wrap_loaded_tokenizer(tok: Tokenizer) -> None:
    wrapped = Tokenizer(tok.hf)
    assert wrapped.model_dir is None
    assert wrapped.encode("Hello") == tok.encode("Hello")
    assert Tokenizer.from_pretrained(tok.model_dir or "").encode("Hello") == tok.encode("Hello")


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        Tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer(tmp_path / "nope")


def test_a_named_tokenizer_that_does_not_load_is_refused_before_the_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokenizer=`` naming a missing directory (or one without tokenizer files) is a
    ValueError naming the field, before any weight loads; it was dropped silently, the
    engine then serving without a tokenizer."""
    import mrv2.engine.engine as engine_module
    from mrv2 import LLM
    from mrv2.testing import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model", "LlamaForCausalLM")

    def no_runner(*args: object) -> None:
        raise AssertionError("the weights started loading")

    monkeypatch.setattr(engine_module, "make_runner", no_runner)
    for tokenizer in (tmp_path / "nope", model):  # (the checkpoint has no tokenizer files)
        with pytest.raises(ValueError, match=f"tokenizer='{tokenizer}'"):
            LLM(str(model), device="cpu", tokenizer=str(tokenizer))


def test_fallback_to_tokenizer_json(tok_dir: Path, tmp_path: Path) -> None:
    """An unloadable tokenizer_config.json falls back to tokenizer.json (+ chat template)."""
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "NoSuchTokenizerClass", "chat_template": CHAT_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_template_from_chat_template_json(tmp_path: Path) -> None:
    """A tokenizer without a template of its own takes ``chat_template.json``'s (where VL
    checkpoints ship it); the tokenizer's own wins; a malformed file is passed over."""
    build_tokenizer(tmp_path / "own")
    (tmp_path / "own" / "chat_template.json").write_text(json.dumps({"chat_template": "x"}))
    assert Tokenizer(tmp_path / "own").chat_template == CHAT_TEMPLATE
    path = build_tokenizer(tmp_path / "vl", chat_template=None)
    assert Tokenizer(path).chat_template is None
    (path / "chat_template.json").write_text("{not json")
    assert Tokenizer(path).chat_template is None
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tok = Tokenizer(path)
    assert tok.render_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|user|>hi</s><|assistant|>")


def _write(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj))


def test_load_generation_eos(tmp_path: Path) -> None:
    assert load_generation_eos(tmp_path) == set()
    _write(tmp_path / "config.json", {"eos_token_id": 2})
    assert load_generation_eos(tmp_path) == {2}
    _write(tmp_path / "generation_config.json", {"eos_token_id": [7, 9]})
    assert load_generation_eos(tmp_path) == {2, 7, 9}
    _write(tmp_path / "generation_config.json", {"eos_token_id": 11})
    _write(tmp_path / "config.json", {"eos_token_id": None, "text_config": {"eos_token_id": [3]}})
    assert load_generation_eos(str(tmp_path)) == {3, 11}


def test_warm_up_renders_the_chat_template_once(tok: Tokenizer, tok_dir: Path,
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A server warms its tokenizer at start-up: a template that renders says so; none, or one
    that refuses a lone user message, is no error (the requests report it)."""
    rendered: list[object] = []
    render = tok.hf.apply_chat_template
    monkeypatch.setattr(tok.hf, "apply_chat_template",
                        lambda *a, **k: rendered.append(a) or render(*a, **k))
    assert tok.warm_up() is True and len(rendered) == 1
    assert Tokenizer(build_tokenizer(tmp_path / "none", chat_template=None)).warm_up() is False
    strict = Tokenizer(build_tokenizer(
        tmp_path / "strict",
        chat_template="{% if messages[0]['role'] != 'system' %}"
                      "{{ raise_exception('a system message must come first') }}{% endif %}"))
    assert strict.warm_up() is False
    with pytest.raises(Exception, match="system message must come first"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_chat_template_from_the_config(tok_dir: Path, tmp_path: Path) -> None:
    """``--chat-template``: a file's text or the template itself replaces the tokenizer's; a
    missing file or a template Jinja cannot parse is refused when the config is built, naming
    the field; transformers' template extensions (loop controls, ``generation``) parse."""
    import argparse

    from pydantic import ValidationError

    from mrv2.config import EngineConfig
    from mrv2.config_cli import add_cli_args, config_from_cli
    from mrv2.engine.engine import _load_tokenizer

    inline = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = config_from_cli(parser.parse_args(["--chat-template", str(path)]), None)
    assert config.model.chat_template == path.read_text()
    assert EngineConfig.from_kwargs(chat_template=inline).model.chat_template == inline
    tok = _load_tokenizer(str(tok_dir), inline)
    assert tok is not None
    assert tok.render_chat_template([{"role": "user", "content": "hi"}]) == "<<hi>>"
    own = _load_tokenizer(str(tok_dir))
    assert own is not None and own.chat_template != inline
    with pytest.raises(ValidationError, match="chat_template='nope.jinja': no such file"):
        EngineConfig.from_kwargs(chat_template="nope.jinja")
    with pytest.raises(ValidationError, match=r"chat_template is not a valid Jinja template "
                                              r"\(line 1"):
        EngineConfig.from_kwargs(chat_template="{% for m in messages %}{{ m }")
    extensions = ("{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
                  "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    assert EngineConfig.from_kwargs(chat_template=extensions).model.chat_template == extensions


def test_llm_chat_passes_the_templates_own_variables(tmp_path: Path) -> None:
    from mrv2 import LLM, SamplingParams
    from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

    template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think "
                "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", chat_template=template)
    tok = llm.engine.tokenizer
    assert tok is not None
    params = SamplingParams(max_tokens=1, temperature=0)
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, params, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt_token_ids == tok.encode("/no_think hi>", add_special_tokens=False)
    out = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False)
    assert out[0].prompt_token_ids == tok.encode("hi", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template_kwargs: \\['messages'\\]"):
        llm.chat(messages, params, chat_template_kwargs={"messages": []})


def test_llm_chat_gives_the_template_messages_as_vllm_does(tmp_path: Path) -> None:
    """``LLM.chat`` renders messages as the server does (vLLM's ``parse_chat_messages``): an
    assistant's calls with JSON-text ``arguments`` as objects, no ``content`` as "", its
    ``reasoning`` also as ``reasoning_content`` (and the other way round)."""
    from mrv2 import LLM, SamplingParams
    from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

    template = ("{% for m in messages %}[{{ m['content'] }}]"
                "{% if m.reasoning_content is defined %}{{ m.reasoning_content }}|"
                "{{ m.reasoning }}{% endif %}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
                "{% endfor %}")
    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", chat_template=template)
    call = {"type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call],
                 "reasoning": "think"},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "ok", "reasoning_content": "more"}]
    out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert out[0].prompt == "[hi][]think|thinkParis[sunny][ok]more|more"
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # (the caller's, unchanged)
    # vLLM's chat_template argument (fifth positional): this call's template only
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), False,
                   None, "<{{ messages[0]['content'] }}>")
    assert out[0].prompt == "<hi>"
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                   use_tqdm=False)
    assert out[0].prompt == "[hi]"
