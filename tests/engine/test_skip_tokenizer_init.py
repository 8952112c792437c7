"""vLLM's ``skip_tokenizer_init``: no tokenizer loads (a model directory without tokenizer
files is its main use); prompts are token ids, outputs carry token ids and empty text, and
what needs text (text prompts, stop strings, chat) is refused naming why. Also
``LLM.chat``'s ``chat_template_content_format`` (vLLM's)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from mrv2.config_cli import add_cli_args, config_from_cli
from mrv2.contract.params import SamplingParams
from mrv2.engine.llm import LLM
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

PROMPT = {"prompt_token_ids": [5, 9, 17, 33]}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: A template that reads a message's content as parts (Gemma 3's and Qwen2-VL's way).
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}"
                  "{{ p['text'] }}{% endfor %}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same tiny checkpoint twice: without any tokenizer file, and with a tokenizer."""
    bare = make_tiny_checkpoint(tmp_path_factory.mktemp("bare"), "LlamaForCausalLM", std=0.15)
    full = tmp_path_factory.mktemp("full")
    shutil.copytree(bare, full, dirs_exist_ok=True)
    make_tiny_tokenizer(full, vocab_size=256, chat_template=PARTS_TEMPLATE)
    return bare, full


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=64, **kwargs)


def test_model_without_tokenizer_files_generates_ids_and_empty_text(
        dirs: tuple[Path, Path]) -> None:
    bare, full = dirs
    with _llm(full) as llm:
        expected = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert expected.text  # (the tokenizer's run detokenizes)
    with _llm(bare, skip_tokenizer_init=True) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.token_ids
    assert out.outputs[0].text == ""
    assert out.prompt_token_ids == PROMPT["prompt_token_ids"]


def test_skip_tokenizer_init_loads_none_and_refuses_text(dirs: tuple[Path, Path]) -> None:
    _, full = dirs  # (a directory that has a tokenizer: the flag still loads none)
    with _llm(full, skip_tokenizer_init=True) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.text == "" and len(out.token_ids) == 6
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            llm.generate("Hello", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="stop.*skip_tokenizer_init"):
            llm.generate(PROMPT, SamplingParams(max_tokens=4, stop=["a"]), use_tqdm=False)
        with pytest.raises(ValueError, match="LLM.chat.*skip_tokenizer_init"):
            llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)
        # stop on token ids needs no text
        stopped = llm.generate(PROMPT, SamplingParams(
            max_tokens=6, temperature=0.0, stop_token_ids=[out.token_ids[1]]),
            use_tqdm=False)[0].outputs[0]
        assert stopped.token_ids == out.token_ids[:2]


def test_stop_strings_refused_without_a_tokenizer(dirs: tuple[Path, Path]) -> None:
    """A model without tokenizer files (no flag): stop strings could never match (there is
    no text), so they are refused rather than ignored."""
    bare, _ = dirs
    with _llm(bare) as llm, pytest.raises(ValueError, match="stop.*no tokenizer"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, stop=["a"]), use_tqdm=False)


def test_cli_flag() -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = config_from_cli(parser.parse_args(["--skip-tokenizer-init"]), "m")
    assert config.model.skip_tokenizer_init is True
    assert config_from_cli(parser.parse_args([]), "m").model.skip_tokenizer_init is False


def test_chat_content_format(dirs: tuple[Path, Path]) -> None:
    """``auto`` gives a template looping over the content its parts (as the server's flag);
    ``string`` gives it one text (the loop then reads nothing); a bad value is refused."""
    _, full = dirs
    messages = [{"role": "user", "content": "Hello"}]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    with _llm(full) as llm:
        auto = llm.chat(messages, one, use_tqdm=False)[0]
        assert auto.prompt == "<|user|>Hello</s><|assistant|>"
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                              {"type": "text", "text": "lo"}]}]
        opened = llm.chat(parts, one, use_tqdm=False, chat_template_content_format="openai")
        assert opened[0].prompt == "<|user|>Hello</s><|assistant|>"
        plain = llm.chat(messages, one, use_tqdm=False, chat_template_content_format="string")
        assert plain[0].prompt == "<|user|></s><|assistant|>"
        with pytest.raises(ValueError, match="chat_template_content_format"):
            llm.chat(messages, one, use_tqdm=False, chat_template_content_format="text")
