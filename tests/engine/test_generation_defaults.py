"""A model's sampling defaults (generation_config.json) fill what a request leaves unset, as
vLLM's ``--generation-config auto``: through ``LLM.generate`` without params and the OpenAI
request models; ``none`` turns them off, overrides replace them, bad ones fail first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrv2 import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.generation_defaults import load_sampling_defaults, max_tokens_limit
from mrv2.engine.llm import LLM
from mrv2.testing import make_tiny_checkpoint

# Qwen3's own file, plus a max_new_tokens and fields that are not sampling defaults.
QWEN3_GENERATION = {"bos_token_id": 0, "do_sample": True, "eos_token_id": [1, 2],
                    "pad_token_id": 0, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "max_new_tokens": 7, "transformers_version": "5.17.0"}
QWEN3_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}


def _write(folder: Path, data: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def test_the_sampling_fields_of_the_file_are_the_defaults(tmp_path: Path) -> None:
    folder = _write(tmp_path / "m", QWEN3_GENERATION)
    assert load_sampling_defaults(folder) == QWEN3_DEFAULTS
    assert load_sampling_defaults(folder, "auto", {"temperature": 0.0, "min_p": 0.1}) == {
        **QWEN3_DEFAULTS, "temperature": 0.0, "min_p": 0.1}
    for off in ("none", "vllm"):
        assert load_sampling_defaults(folder, off) == {}
        assert load_sampling_defaults(folder, off, {"top_k": 5}) == {"top_k": 5}
    assert load_sampling_defaults(tmp_path / "no_file") == {}  # auto: a model without one
    other = _write(tmp_path / "other", {"repetition_penalty": 1.1, "top_p": None})
    assert load_sampling_defaults(folder, str(other)) == {"repetition_penalty": 1.1}


def test_max_new_tokens_of_an_override_or_a_folder_limits_every_request() -> None:
    """vLLM's ``--generation-config``: "If max_new_tokens is specified in generation config,
    then it sets a server-wide limit on the number of output tokens for all requests": that
    of ``override_generation_config`` or of a folder's file; a model's own file only sets the
    default of requests that leave max_tokens unset (vLLM's fix of Qwen3-1.7B-Base's 2048)."""
    assert max_tokens_limit("auto", {}, QWEN3_DEFAULTS) is None
    assert max_tokens_limit("auto", {"max_new_tokens": 9}, {"max_tokens": 9}) == 9
    assert max_tokens_limit("vllm", {"max_new_tokens": 9}, {"max_tokens": 9}) == 9
    assert max_tokens_limit("none", {"temperature": 0.5}, {"temperature": 0.5}) is None
    assert max_tokens_limit("/folder", {}, QWEN3_DEFAULTS) == 7
    assert max_tokens_limit("/folder", {}, {"top_k": 3}) is None


def test_bad_defaults_fail_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="override_generation_config has unknown fields "
                       r"\['top_n'\]; allowed: temperature, top_k"):
        load_sampling_defaults(None, "auto", {"top_n": 3})
    bad = _write(tmp_path / "bad", {"top_p": 0.0})
    with pytest.raises(ValueError, match=r"bad/generation_config.json are invalid: .*top_p"):
        load_sampling_defaults(bad)
    with pytest.raises(ValueError, match="override_generation_config are invalid: .*"
                       "temperature"):
        load_sampling_defaults(None, "none", {"temperature": -1})
    with pytest.raises(ValueError, match="generation_config='/nowhere' is invalid: expected "
                       "'auto', 'none', 'vllm' or a directory"):
        load_sampling_defaults(None, "/nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{temperature")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_sampling_defaults(tmp_path / "broken")


def test_openai_requests_take_the_defaults_for_unset_fields() -> None:
    pytest.importorskip("pydantic")
    from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"messages": messages})
    params = chat.sampling_params(QWEN3_DEFAULTS)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (
        0.6, 20, 0.95, 7)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)  # no default: the engine's
    explicit = ChatCompletionRequest.model_validate(
        {"messages": messages, "temperature": 0.0, "top_k": -1, "max_tokens": 3})
    params = explicit.sampling_params(QWEN3_DEFAULTS)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (
        0.0, -1, 0.95, 3)  # a request's 0 is a value, not "unset"
    plain = chat.sampling_params()
    assert (plain.temperature, plain.top_k, plain.top_p, plain.max_tokens) == (
        1.0, 0, 1.0, None)
    # a completion's max_tokens left out is OpenAI's (and vLLM's) 16, whatever the model's
    # max_new_tokens; sent as null, the model's (else the context left)
    completion = CompletionRequest.model_validate({"prompt": "hi"})
    assert completion.sampling_params(QWEN3_DEFAULTS).max_tokens == 16
    assert completion.sampling_params({"top_k": 20}).max_tokens == 16
    null = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": None})
    assert null.sampling_params(QWEN3_DEFAULTS).max_tokens == 7
    assert null.sampling_params({"top_k": 20}).max_tokens is None
    sent = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 16})
    assert sent.sampling_params(QWEN3_DEFAULTS).max_tokens == 16
    # where max_tokens came from the model (the server caps it at the context left)
    assert null.max_tokens_from_model(QWEN3_DEFAULTS)
    assert not null.max_tokens_from_model({"top_k": 20})
    assert not completion.max_tokens_from_model(QWEN3_DEFAULTS)
    assert not sent.max_tokens_from_model(QWEN3_DEFAULTS)
    assert chat.max_tokens_from_model(QWEN3_DEFAULTS) and not explicit.max_tokens_from_model(
        QWEN3_DEFAULTS)


ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64,
              num_gpu_blocks_override=64, max_num_seqs=4, seed=0)


def test_llm_generate_without_params_uses_the_models_defaults(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "tiny", "Qwen3ForCausalLM")
    generation = json.loads((model / "generation_config.json").read_text())
    _write(model, {**generation, "temperature": 0.0, "max_new_tokens": 5})
    prompt = [3, 14, 15, 92, 65]
    with LLM(config=EngineConfig.from_kwargs(model=str(model), **ENGINE)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0,
                                                                   max_tokens=5)
        got = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs[0]
        want = llm.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=0.0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0]
    # this prompt's greedy continuation does not hit EOS: max_new_tokens (not the 16 of
    # SamplingParams' own default) ends it
    assert (len(want.token_ids), want.finish_reason) == (5, "length")
    assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")
    with LLM(config=EngineConfig.from_kwargs(model=str(model), generation_config="none",
                                             override_generation_config={"top_k": 3},
                                             **ENGINE)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(top_k=3)


def test_a_bad_generation_config_fails_before_the_weights_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="override_generation_config has unknown fields"):
        LLM(config=EngineConfig.from_kwargs(model=str(tmp_path / "not_loaded"),
                                            override_generation_config={"beams": 2},
                                            **ENGINE))


def test_the_tokenizers_eos_counts_with_the_configs(tmp_path: Path) -> None:
    """A fine-tune whose tokenizer's EOS (``<|assistant|>`` here, a chat model's
    ``<|im_end|>``) is not the one config.json names: generation stops at either, as vLLM's
    (the tokenizer's EOS is its primary one); it was dropped whenever the configs named one."""
    from mrv2.testing import make_tiny_tokenizer

    model = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    tokenizer = make_tiny_tokenizer(tmp_path)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(
        {**config, "eos_token": "<|assistant|>"}))
    llm = LLM(str(model), device="cpu", max_model_len=64, generation_config="none")
    assert llm.get_tokenizer() is not None
    eos = llm.get_tokenizer().eos_token_id  # type: ignore[union-attr]
    assert eos == 3 and llm.engine.eos_token_ids == {1, eos}
