"""vLLM's ``structured_outputs_config`` (``EngineConfig.structured_outputs``,
``--structured-outputs-config '{...}'``): its keys are parsed and checked (unknown ones refused
by name), and each changes what the engine's structured outputs allow, against an engine
without it."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from test_structured_outputs import _allowed_after as allowed_after

from mrv2 import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from mrv2.config import StructuredOutputsConfig
from mrv2.config_cli import add_cli_args, config_from_cli
from mrv2.engine.engine import LLMEngine
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

ENGINE = dict(device="cpu", dtype="float32", block_size=4)
PROBES = (",", "}", " ", "\n", '"')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<think>", "</think>"])
    return path


def _llm(checkpoint: Path, config: dict[str, Any] | None = None) -> LLM:
    extra = {} if config is None else {"structured_outputs_config": config}
    return LLM(str(checkpoint), **ENGINE, **extra)  # type: ignore[arg-type]


def _allowed_after(llm: LLM, spec: StructuredOutputsParams, text: str) -> set[str]:
    """Which of :data:`PROBES` a fresh matcher of ``spec`` allows after ``text``'s tokens."""
    return allowed_after(llm, spec, text, PROBES)


# ---- the config ----------------------------------------------------------------------------

def test_the_config_by_vllms_name_as_a_mapping_json_text_a_flag_and_a_file(
        tmp_path: Path) -> None:
    given = {"backend": "guidance", "disable_any_whitespace": True, "enable_in_reasoning": True,
             "disable_fallback": True}
    for value in (given, json.dumps(given), StructuredOutputsConfig(**given)):
        config = EngineConfig.from_kwargs(structured_outputs_config=value).structured_outputs
        assert (config.backend, config.disable_any_whitespace, config.enable_in_reasoning,
                config.disable_additional_properties) == ("guidance", True, True, False)
    assert EngineConfig().structured_outputs.backend == "auto"
    plugin = {"reasoning_parser_plugin": "/x/plugin.py"}  # (the server loads it)
    config = EngineConfig.from_kwargs(structured_outputs_config=plugin).structured_outputs
    assert config.server_reasoning_parser_plugin(None) == "/x/plugin.py"
    assert config.server_reasoning_parser_plugin("/x/plugin.py") == "/x/plugin.py"
    with pytest.raises(ValueError, match="--reasoning-parser-plugin /y.py and "
                                         "structured_outputs_config.reasoning_parser_plugin"):
        config.server_reasoning_parser_plugin("/y.py")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--structured-outputs-config", json.dumps(given)])
    assert config_from_cli(args, "m").structured_outputs.disable_any_whitespace
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"structured_outputs_config": given}))
    assert EngineConfig.from_file(path).structured_outputs.enable_in_reasoning


def test_the_backend_note_is_logged_once_per_engine(checkpoint: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A backend other than llguidance is noted once, when the engine starts: not again each
    time the config is validated (passed on as a ``StructuredOutputsConfig``, a field
    assigned), which logged it up to three times here; ``guidance`` is not noted."""
    caplog.set_level(logging.INFO, logger="mrv2")
    config = EngineConfig.from_kwargs(
        model=str(checkpoint), **ENGINE,
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"))
    config.structured_outputs.disable_any_whitespace = True
    LLMEngine(config).shutdown()
    notes = [r.getMessage() for r in caplog.records if "mrv2 uses llguidance" in r.getMessage()]
    assert notes == ["structured_outputs_config.backend='xgrammar': mrv2 uses llguidance "
                     "(vLLM's 'guidance'), object schemas closed as that backend's"], notes
    caplog.clear()
    LLMEngine(EngineConfig.from_kwargs(model=str(checkpoint), **ENGINE,
                                       structured_outputs_config={"backend": "guidance"})
              ).shutdown()
    assert not [r for r in caplog.records if "mrv2 uses llguidance" in r.getMessage()]


@pytest.mark.parametrize(("value", "message"), [
    ({"backend": "guidance", "whitespace": False}, "structured_outputs.whitespace"),
    ({"disable_any_whitespce": True}, "structured_outputs.disable_any_whitespce"),
    ({"backend": "llama.cpp"}, "structured_outputs.backend"),
    ({"disable_any_whitespace": "maybe"}, "structured_outputs.disable_any_whitespace"),
])
def test_unknown_keys_and_bad_values_are_refused_by_name(value: dict[str, Any],
                                                         message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig.from_kwargs(structured_outputs_config=value)


@pytest.mark.parametrize(("value", "message"), [
    ("{backend", "structured_outputs_config is not valid JSON"),
    ("[1]", "structured_outputs_config must be a mapping"),
])
def test_a_value_that_is_no_json_object_is_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(structured_outputs_config=value)


def test_the_reasoning_parser_given_in_the_config_or_the_flag() -> None:
    config = EngineConfig.from_kwargs(
        structured_outputs_config={"reasoning_parser": "qwen3"}).structured_outputs
    assert config.server_reasoning_parser(None) == "qwen3"
    assert config.server_reasoning_parser("qwen3") == "qwen3"
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1 and "
                                         "structured_outputs_config.reasoning_parser='qwen3'"):
        config.server_reasoning_parser("deepseek_r1")
    assert EngineConfig().structured_outputs.server_reasoning_parser("mistral") == "mistral"
    assert EngineConfig().structured_outputs.server_reasoning_parser(None) is None


def test_serve_takes_the_configs_reasoning_parser(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``mrv2 serve``: the config's parser is the server's; one that disagrees with
    ``--reasoning-parser``, or is no parser, is refused before anything loads."""
    pytest.importorskip("fastapi")
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.server_run as run_module
    from mrv2.entrypoints.cli import main

    seen: dict[str, Any] = {}

    def run_server(*args: Any, **kwargs: Any) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(engine_module, "LLMEngine", lambda config: object())
    monkeypatch.setattr(run_module, "run_server", run_server)
    monkeypatch.setattr(run_module, "listen_socket", lambda host, port: None)
    base = ["serve", "m", "--device", "cpu", "--load-format", "dummy", "--no-engine-process",
            "--structured-outputs-config"]
    assert main([*base, '{"reasoning_parser": "deepseek_r1"}']) == 0
    assert seen["reasoning_parser"] == "deepseek_r1"
    assert main([*base, '{"reasoning_parser": "qwen3"}', "--reasoning-parser", "qwen3"]) == 0
    assert seen["reasoning_parser"] == "qwen3"
    seen.clear()
    assert main([*base, '{"reasoning_parser": "qwen3"}', "--reasoning-parser",
                 "deepseek_r1"]) == 2
    assert "disagree" in capsys.readouterr().err and not seen
    assert main([*base, '{"reasoning_parser": "nope"}']) == 2
    assert "reasoning_parser='nope'" in capsys.readouterr().err and not seen


# ---- its effect on the engine --------------------------------------------------------------

def test_disable_any_whitespace_makes_every_requests_json_compact(checkpoint: Path) -> None:
    """A model biased towards whitespace writes it between JSON tokens, unless the engine's
    ``disable_any_whitespace`` (the request's own flag unset) allows none."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema)
    for config, whitespace in ((None, True), ({"disable_any_whitespace": True}, False)):
        llm = _llm(checkpoint, config)
        assert (" " in _allowed_after(llm, spec, "{")) == whitespace
        tokenizer = llm.get_tokenizer()
        bias = {tokenizer.encode(t, add_special_tokens=False)[0]: 50.0 for t in (" ", "\n")}
        out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=16,
                                                   logit_bias=bias, structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
        assert out.text.lstrip().startswith("{"), out.text
        assert any(c in out.text for c in " \n") == whitespace, out.text
        if not whitespace:
            assert out.finish_reason == "stop" and json.loads(out.text) == {
                "a": json.loads(out.text)["a"]}, out.text


@pytest.mark.parametrize("config", [{"disable_additional_properties": True},
                                    {"backend": "xgrammar"}, {"backend": "outlines"}])
def test_objects_are_closed_by_the_config(checkpoint: Path, config: dict[str, Any]) -> None:
    """``disable_additional_properties`` (and xgrammar's / outlines' own rule): an object
    schema that says nothing of other properties takes none, so after its last listed one
    only ``}`` may come; without it (or backend ``guidance`` / ``lm-format-enforcer``) an
    extra key may."""
    schema = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert _allowed_after(_llm(checkpoint, config), spec, '{"a":1') == {"}"}
    for open_ in (None, {"backend": "guidance"}, {"backend": "lm-format-enforcer"}):
        assert _allowed_after(_llm(checkpoint, open_), spec, '{"a":1') == {",", "}"}


def test_enable_in_reasoning_holds_the_thinking_block_too(checkpoint: Path) -> None:
    """With a reasoning parser, a prompt that opened the block is free until ``</think>``
    (biased: it comes first); with ``enable_in_reasoning`` the grammar holds from the first
    token, so it never comes."""
    choices = ["Paris", "London"]
    for config, free in ((None, True), ({"enable_in_reasoning": True}, False)):
        llm = _llm(checkpoint, config)
        tokenizer = llm.get_tokenizer()
        start, end = (tokenizer.encode(t, add_special_tokens=False)[0]
                      for t in ("<think>", "</think>"))
        params = SamplingParams(temperature=0.9, seed=0, max_tokens=30, logit_bias={end: 100.0},
                                structured_outputs=StructuredOutputsParams(choice=choices),
                                _reasoning="deepseek_r1")
        out = llm.generate({"prompt_token_ids": [5, 6, 7, start]}, params,
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text in choices, out.text
        assert (out.token_ids[0] == end) == free, out.token_ids
