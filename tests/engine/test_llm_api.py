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


def test_sampling_params_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    """vLLM's ``detokenize=False``: no text, the token ids only (it was a TypeError)."""
    plain = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                               detokenize=False), use_tqdm=False)[0].outputs[0]
    assert plain.text and out.text == "" and out.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="detokenize"):  # stop strings need the text
        SamplingParams(detokenize=False, stop=["x"])


def test_sampling_params_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    assert tok is not None
    ids = tok.encode("hello there world again", add_special_tokens=False)
    assert len(ids) > 3
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=3),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-3:]
    long_ids = (ids * 20)[:70]  # longer than max_model_len (64): -1 keeps 64 - max_tokens
    out = llm.generate({"prompt_token_ids": long_ids},
                       SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids[-60:]
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)  # type: ignore[arg-type]


def test_sampling_params_extra_args_and_spaces_between_special_tokens() -> None:
    """``extra_args`` is kept (opaque, as vLLM's); ``spaces_between_special_tokens`` takes a
    bool (what False does: test_detokenizer)."""
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}
    assert SamplingParams(spaces_between_special_tokens=True).spaces_between_special_tokens
    assert not SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1])  # type: ignore[arg-type]


def test_engine_add_request_honours_truncate_prompt_tokens(llm: LLM) -> None:
    """Through ``LLMEngine.add_request`` too (the field was not read there)."""
    ids = list(range(10, 20))
    engine = llm.engine
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0,
                                           truncate_prompt_tokens=4), request_id="cut")
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.prompt_token_ids for o in outputs] == [ids[-4:]]


def test_a_cut_longer_than_the_context_is_refused_offline(llm: LLM) -> None:
    """vLLM's offline bound: ``truncate_prompt_tokens`` above max_model_len is a ValueError,
    however short the prompt (``LLM.generate``, ``LLM.chat``, ``LLMEngine.add_request``);
    max_model_len itself (and -1) is taken."""
    limit = llm.engine.max_model_len
    too_long = SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=limit + 1)
    message = rf"truncate_prompt_tokens value \({limit + 1}\) is greater than max_model_len"
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", too_long, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": "hi"}], too_long, use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request([5, 6, 7], too_long, request_id="too-long")
    assert not llm.engine.has_unfinished()
    for keep in (limit, -1):
        params = SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=keep)
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == [5, 6, 7]


def test_last_tokens_rule() -> None:
    """The one ``truncate_prompt_tokens`` rule (generation, pooling and the server's bodies):
    the last k ids, -1 the room given, None all; a multimodal prompt is never cut."""
    from mrv2.engine.request_inputs import last_tokens

    ids = list(range(10))
    assert last_tokens(ids, 4, 8) == ids[-4:] and last_tokens(ids, -1, 8) == ids[-8:]
    assert last_tokens(ids, None, 3) is ids and last_tokens(ids, 12, 3) is ids
    assert last_tokens(ids, 12, 3, multimodal=True) is ids
    with pytest.raises(ValueError, match="would cut a multimodal prompt"):
        last_tokens(ids, 4, 8, multimodal=True)


def test_outputs_carry_the_lora_request(tmp_path: Any) -> None:
    """vLLM's ``RequestOutput.lora_request`` / ``CompletionOutput.lora_request``: the adapter
    the request ran through (None: the base model), n > 1 included."""
    from mrv2.testing_checkpoints import make_lora_adapter

    base = tmp_path / "base"
    make_tiny_checkpoint(base, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(base)
    adapter = make_lora_adapter(base, tmp_path / "a", rank=4)
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              enable_lora=True)
    lora = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(max_tokens=1, n=2, seed=0)
    with_lora, plain = llm.generate(["hi", "hi"], params, use_tqdm=False,
                                    lora_request=[lora, None])
    assert with_lora.lora_request == lora and plain.lora_request is None
    assert [c.lora_request for c in with_lora.outputs] == [lora, lora]
    assert [c.lora_request for c in plain.outputs] == [None, None]
