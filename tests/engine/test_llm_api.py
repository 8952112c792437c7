"""``LLM``'s offline API as vLLM's users call it: ``chat``'s positional order and ``tools``,
``generate``'s ``priority``, the tokenizer's ``apply_chat_template(tokenize=False)``."""

from __future__ import annotations

from typing import Any

import pytest

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

TEMPLATE = ("{% if tools %}[{{ tools | length }} tools]{% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("m")
    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               chat_template=TEMPLATE, policy="priority", max_num_seqs=1)


MESSAGES = [{"role": "user", "content": "hi"}]
PARAMS = SamplingParams(max_tokens=1, temperature=0)


def test_chat_takes_vllms_positional_order(llm: LLM) -> None:
    """vLLM's ``chat(messages, sampling_params, use_tqdm, lora_request, ...)``: a LoRA
    request given fourth was read as ``add_generation_prompt`` (and silently not applied)."""
    tok = llm.engine.tokenizer
    assert tok is not None
    out = llm.chat(MESSAGES, PARAMS, False, None)
    assert out[0].prompt_token_ids == tok.encode("hi>", add_special_tokens=False)
    with pytest.raises(ValueError, match="lora_request 'a'"):  # applied, so refused here
        llm.chat(MESSAGES, PARAMS, False, LoRARequest("a", 1, "/nowhere"))


def test_chat_offers_tools_to_the_template(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    assert tok is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = llm.chat(MESSAGES, PARAMS, use_tqdm=False, tools=tools)
    assert out[0].prompt_token_ids == tok.encode("[1 tools]hi>", add_special_tokens=False)


def test_tokenizer_apply_chat_template_with_tokenize_false_gives_the_text(llm: LLM) -> None:
    """vLLM's users render with ``llm.get_tokenizer().apply_chat_template(messages,
    tokenize=False, add_generation_prompt=True)``: it raised "not template variables"."""
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template(MESSAGES, tokenize=False,
                                   add_generation_prompt=True) == "hi>"
    assert tok.apply_chat_template(MESSAGES, tokenize=True) == tok.encode(
        "hi>", add_special_tokens=False)


def test_generate_takes_a_priority_per_prompt(llm: LLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``generate(..., priority=[...])``: one per prompt, lower first under the
    "priority" policy; outputs still in prompt order."""
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    params = SamplingParams(max_tokens=2, temperature=0)
    plain = llm.generate(prompts, params, use_tqdm=False)
    seen: list[int] = []
    add = llm.engine.add_request

    def spy(*args: Any, **kwargs: Any) -> str:
        seen.append(kwargs["priority"])
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", spy)
    ranked = llm.generate(prompts, params, use_tqdm=False, priority=[1, 0])
    assert seen == [1, 0]
    assert [o.prompt_token_ids for o in ranked] == [[5, 6, 7], [8, 9]]
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    with pytest.raises(ValueError, match="got 1 priority for 2 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0])


@pytest.mark.parametrize("key", ["mm_processor_kwargs", "multimodal_data"])
def test_a_prompt_field_mrv2_does_not_read_is_refused_by_name(llm: LLM, key: str) -> None:
    """A prompt dict's key the engine would ignore (vLLM's ``mm_processor_kwargs``, a
    misspelt ``multi_modal_data``: its image silently dropped) is refused by name."""
    with pytest.raises(ValueError, match=f"unknown prompt field.*{key}"):
        llm.generate({"prompt_token_ids": [5, 6], key: {}}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match=f"unknown prompt field.*{key}"):
        llm.generate({"prompt": "hi", key: {}}, PARAMS, use_tqdm=False)
