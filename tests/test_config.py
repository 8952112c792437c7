"""Engine configuration from keywords, files and CLI flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from mrv2.config import EngineConfig, format_validation_error
from mrv2.config_cli import add_cli_args, config_from_cli


def test_flat_kwargs_land_in_sections() -> None:
    config = EngineConfig.from_kwargs(
        model="/m", dtype="bfloat16", max_model_len=512, block_size=64, max_num_seqs=8,
        device="cpu", async_scheduling=False, num_gpu_blocks_override=100,
    )
    assert config.model.max_model_len == 512 and config.model.dtype == "bfloat16"
    assert config.cache.block_size == 64 and config.cache.num_gpu_blocks_override == 100
    assert config.scheduler.max_num_seqs == 8 and not config.scheduler.async_scheduling
    assert config.device.device == "cpu"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"dtype": "float64"}, "model.dtype"), ({"max_num_seqs": 0}, "scheduler.max_num_seqs"),
     ({"tensor_parallel_size": 0}, "parallel.tensor_parallel_size"),
     ({"num_speculative_tokens": 3}, "speculative"), ({"device": "tpu"}, "device.device"),
     ({"max_lora_rank": 24}, "lora.max_lora_rank"),
     ({"max_loras": 4, "max_cpu_loras": 2}, "lora"),
     ({"cpu_kv_cache_gb": float("inf")}, "cache.cpu_kv_cache_gb")],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        EngineConfig.from_kwargs(**kwargs)
    assert format_validation_error(info.value).splitlines()[1].strip().startswith(field)


def test_yaml_and_json_files(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("dtype: float32\ncache:\n  block_size: 8\n")
    config = EngineConfig.from_file(tmp_path / "c.yaml", max_model_len=99)
    assert (config.model.dtype, config.cache.block_size, config.model.max_model_len) == (
        "float32", 8, 99)
    (tmp_path / "c.json").write_text(json.dumps({"max_num_batched_tokens": 256}))
    assert EngineConfig.from_file(tmp_path / "c.json").scheduler.max_num_batched_tokens == 256


def test_cli_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    (tmp_path / "c.yaml").write_text("block_size: 8\nmax_model_len: 64\n")
    args = parser.parse_args([
        "--config", str(tmp_path / "c.yaml"), "--max-model-len", "128", "--no-async-scheduling",
        "--gpu-memory-utilization", "0.5", "--device", "cpu",
    ])
    config = config_from_cli(args, "/model")
    assert config.model.model == "/model"
    assert config.model.max_model_len == 128  # the flag beats the file
    assert config.cache.block_size == 8
    assert config.cache.gpu_memory_utilization == 0.5
    assert config.scheduler.async_scheduling is False
    with pytest.raises(ValidationError, match="block_size"):
        config_from_cli(parser.parse_args(["--block-size", "5"]), None)


def test_speculative_config_by_vllm_name_cli_and_server() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2, "rejection_sample_method": "probabilistic"}
    config = EngineConfig.from_kwargs(speculative_config=spec)
    assert config.speculative.model_dump(exclude_none=True) == spec
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(spec)])
    assert config_from_cli(args, None).speculative == config.speculative
    from mrv2.entrypoints.cli import build_parser

    serve = build_parser().parse_args(["serve", "/m", "--speculative-config", json.dumps(spec)])
    assert config_from_cli(serve, "/m").speculative == config.speculative
    with pytest.raises(ValueError, match="speculative_config must be a mapping"):
        EngineConfig.from_kwargs(speculative_config="[1, 2]")
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        EngineConfig.from_kwargs(speculative_config={**spec, "prompt_lookup_min": 6})


def test_hf_overrides_change_the_model_built(tmp_path: Path) -> None:
    """``--hf-overrides '{"num_hidden_layers": 1}'`` builds the first layer only (a benchmark
    of part of a model too big for the machine)."""
    from mrv2 import LLM
    from mrv2.testing import make_tiny_checkpoint

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--hf-overrides", '{"num_hidden_layers": 1}'])
    assert config_from_cli(args, None).model.hf_overrides == {"num_hidden_layers": 1}
    model = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(model), device="cpu", dtype="float32", load_format="dummy",
              hf_overrides={"num_hidden_layers": 1})
    assert len(llm.engine.runner.model.model.layers) == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("flag", ["--hf-overrides", "--override-generation-config"])
def test_a_mapping_flag_that_is_not_json_names_the_flag(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse said ``invalid loads value`` (the name of the parser function)."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "{num_hidden_layers: 2}"])
    assert f"argument {flag}: not valid JSON" in capsys.readouterr().err


def test_hf_overrides_of_rope_scaling_keep_the_rope_theta(tmp_path: Path) -> None:
    """``--hf-overrides '{"rope_scaling": {"rope_type": "yarn", ...}}'`` (vLLM's way to extend
    a Qwen's context) scales the checkpoint's RoPE: transformers 5 holds ``rope_theta`` in
    that dict, and the override dropped it (10000 was used instead of the model's 1e6)."""
    from mrv2.layers.rotary import rope_parameters_of
    from mrv2.model_loader.build import load_hf_config
    from mrv2.testing import make_tiny_checkpoint

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM",
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    theta, scaling = rope_parameters_of(load_hf_config(path, {"rope_scaling": yarn}))
    assert theta == 1e6 and scaling is not None and scaling["factor"] == 4.0
    assert yarn == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    theta, _ = rope_parameters_of(load_hf_config(path, {"rope_parameters": {
        **yarn, "rope_theta": 5e5}}))
    assert theta == 5e5  # (one the override gives wins)


def test_hf_overrides_of_a_wrong_type_are_a_value_error_naming_the_field(tmp_path: Path
                                                                         ) -> None:
    """transformers 5 refuses ``{"num_hidden_layers": "1"}`` with an error that is no
    ValueError: ``mrv2 serve`` printed a traceback instead of its one-line message."""
    from mrv2.entrypoints.cli import main
    from mrv2.model_loader.build import load_hf_config
    from mrv2.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ValueError, match="hf_overrides: num_hidden_layers='1' is refused"):
        load_hf_config(path, {"num_hidden_layers": "1"})
    assert main(["generate", "--model", str(path), "--device", "cpu", "--load-format", "dummy",
                 "--hf-overrides", '{"num_hidden_layers": "1"}']) == 2


@pytest.mark.parametrize(("value", "expected"), [
    ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1M", 1_048_576), ("4096", 4096)])
def test_token_counts_take_vllms_human_readable_forms(value: str, expected: int) -> None:
    """vLLM's ``--max-model-len`` and ``--max-num-batched-tokens`` take ``32k`` (10**3) and
    ``32K`` (2**10); argparse said ``invalid int value: '32k'``."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--max-model-len", value, "--max-num-batched-tokens", value])
    config = config_from_cli(args, None)
    assert config.model.max_model_len == expected
    assert config.scheduler.max_num_batched_tokens == expected


def test_a_bad_human_readable_token_count_names_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "1.5K"])
    assert "argument --max-model-len:" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "expected"), [
    ("half", "float16"), ("float", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16")])
def test_dtype_takes_vllms_aliases(value: str, expected: str) -> None:
    """vLLM's ``--dtype`` takes ``half`` (float16) and ``float`` (float32) too."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert config_from_cli(parser.parse_args(["--dtype", value]), None).model.dtype == expected
    assert EngineConfig.from_kwargs(dtype=value).model.dtype == expected


def test_limit_mm_per_prompt_takes_vllms_json_form(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``--limit-mm-per-prompt`` is a JSON object of counts per modality (argparse said
    ``invalid int value``); mrv2's one limit counts each modality's items alike."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    for value, expected in (('{"image": 2}', 2), ('{"image": 3, "audio": 3}', 3),
                            ('{"video": 1}', 1), ("5", 5)):
        args = parser.parse_args(["--limit-mm-per-prompt", value])
        assert config_from_cli(args, None).multimodal.limit_mm_per_prompt == expected
    assert EngineConfig.from_kwargs(
        limit_mm_per_prompt={"image": 2}).multimodal.limit_mm_per_prompt == 2
    for bad in ('{"image": 2, "video": 0}', '{"imag": 1}', '{"image": "x"}', "{}",
                '{"image": {"count": 2}}', '{"image": [2]}'):
        with pytest.raises(ValidationError, match="limit_mm_per_prompt"):
            config_from_cli(parser.parse_args(["--limit-mm-per-prompt", bad]), None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--limit-mm-per-prompt", "{image: 2}"])
    assert "argument --limit-mm-per-prompt: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "text"), [("c.yaml", "dtype: [unclosed\n"),
                                            ("c.json", '{"dtype": ')])
def test_a_config_file_that_does_not_parse_names_the_file(
        tmp_path: Path, name: str, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A YAML error was a traceback out of ``mrv2 ... --config``, a JSON error a message
    naming neither the file nor the flag."""
    from mrv2.entrypoints.cli import main

    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=f"{name}: not valid"):
        EngineConfig.from_file(tmp_path / name)
    assert main(["generate", "--config", str(tmp_path / name)]) == 2
    assert f"{name}: not valid" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto ", "-1"])
def test_vllms_auto_max_model_len_is_taken(value: str, tmp_path: Path) -> None:
    """vLLM's ``max_model_len`` ``auto`` / ``-1`` (the longest that fits in the KV cache,
    resolved at start-up) is taken as vLLM stores it, -1, from the flag (``mrv2 serve``,
    ``mrv2 generate``), a keyword (``LLM``, ``EngineConfig.from_kwargs``), a config file and
    an assignment; it was refused. Its readers at build time see no fixed length."""
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "/m", "--max-model-len", value])
    configs = [config_from_cli(args, args.model_dir),
               EngineConfig.from_kwargs(max_model_len=value),
               EngineConfig.from_kwargs(max_model_len=-1)]
    (tmp_path / "c.yaml").write_text(f"max_model_len: {value.strip()}\n")
    configs.append(EngineConfig.from_file(tmp_path / "c.yaml"))
    assigned = EngineConfig.from_kwargs(max_model_len=512)
    assigned.model.max_model_len = value  # type: ignore[assignment]
    for config in [*configs, assigned]:
        assert config.model.max_model_len == -1 and config.model.auto_max_model_len
        assert config.model.fixed_max_model_len is None
    fixed = EngineConfig.from_kwargs(max_model_len=512).model
    assert not fixed.auto_max_model_len and fixed.fixed_max_model_len == 512


@pytest.mark.parametrize("value", [0, -2, "0"])
def test_a_max_model_len_below_one_other_than_auto_is_refused(value: int | str) -> None:
    with pytest.raises(ValidationError, match="expected a length >= 1, or 'auto' / -1"):
        EngineConfig.from_kwargs(max_model_len=value)


def test_vllms_short_flags() -> None:
    """``-tp`` and ``-q`` (vLLM's short names of ``--tensor-parallel-size`` and
    ``--quantization``, common in its recipes) were unrecognized arguments."""
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "/m", "-tp", "2", "-q", "fp8"])
    config = config_from_cli(args, args.model_dir)
    assert config.parallel.tensor_parallel_size == 2 and config.model.quantization == "fp8"


def test_vllms_scheduling_policy_names() -> None:
    """vLLM's ``--scheduling-policy`` flag and ``scheduling_policy`` keyword (``LLM(...,
    scheduling_policy="priority")``, a config file's key) set ``policy``; the flag was an
    unrecognized argument and the keyword an unknown one."""
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "/m", "--scheduling-policy", "priority"])
    assert config_from_cli(args, args.model_dir).scheduler.policy == "priority"
    args = build_parser().parse_args(["serve", "/m", "--policy", "priority"])
    assert config_from_cli(args, args.model_dir).scheduler.policy == "priority"
    assert EngineConfig.from_kwargs(scheduling_policy="priority").scheduler.policy == "priority"
    assert EngineConfig.from_kwargs(scheduling_policy="fcfs", policy="fcfs").scheduler.policy \
        == "fcfs"
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig.from_kwargs(scheduling_policy="priority", policy="fcfs")
    with pytest.raises(ValidationError, match="policy"):
        EngineConfig.from_kwargs(scheduling_policy="lifo")
