"""vLLM's compilation and CUDA graph flags (``-O0``, ``-cc '{...}'``, ``-O.key=value``,
``--cudagraph-capture-sizes``) and its download-only flags: each parses in ``mrv2 serve``,
reaches the config as mrv2's graph settings, and a key mrv2 cannot honour is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.config_cli import config_from_cli
from mrv2.config_compat import expand_dotted_args
from mrv2.entrypoints.cli import build_parser
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("compile"), "Qwen3ForCausalLM")


def _serve(*argv: str) -> EngineConfig:
    """The config ``mrv2 serve ARGV`` builds (its parser, after main's argv rewriting)."""
    args = build_parser().parse_args(expand_dotted_args(["serve", *argv]))
    return config_from_cli(args, None)


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=4,
               max_model_len=64, **kwargs)


@pytest.mark.parametrize("argv,eager", [
    (["-O0"], True), (["-O", "0"], True), (["--optimization-level", "0"], True),
    (["-O3"], False), (["-O2"], False), (["-O1"], False),
    (["-O.cudagraph_mode=NONE"], True), (["-cc.cudagraph_mode=NONE"], True),
    (["--compilation-config.cudagraph_mode", "none"], True),
    (["-cc", '{"cudagraph_mode": "NONE"}'], True),
    (["--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE", "mode": 3}'], False),
    (["-O.mode=0"], False),  # vLLM's: no torch.compile only (mrv2 compiles nothing)
])
def test_optimization_level_and_cudagraph_mode_none_mean_eager(argv: list[str],
                                                               eager: bool) -> None:
    assert _serve(*argv).device.enforce_eager is eager


def test_compilation_config_graph_fields_reach_the_config() -> None:
    device = _serve("-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY", '
                    '"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 4}'
                    ).device
    assert (device.max_mixed_graph_tokens, device.cudagraph_capture_sizes) == (0, [1, 2, 4])
    assert device.cuda_graph_sizes is None and not device.enforce_eager
    # dotted keys override -cc's JSON, values parsed as JSON
    device = _serve("-cc", '{"cudagraph_capture_sizes": [8]}',
                    "-O.cudagraph_capture_sizes=[2, 6]").device
    assert device.cudagraph_capture_sizes == [2, 6]
    assert _serve("-cc.max_cudagraph_capture_size=16").device.cuda_graph_sizes == [16]
    assert _serve("--cudagraph-capture-sizes", "8").device.cudagraph_capture_sizes == [8]
    config = EngineConfig.from_kwargs(compilation_config={"cudagraph_mode": "PIECEWISE"},
                                      optimization_level=2)
    assert config.device == EngineConfig().device  # mrv2's graphs as they are
    assert EngineConfig.from_kwargs(compilation_config=0).device == EngineConfig().device


def test_download_flags_are_accepted_with_no_effect() -> None:
    config = _serve("--hf-token", "--ignore-patterns", "original/**/*", "*.pt",
                    "--max-parallel-loading-workers", "2")
    assert config == _serve("--hf-token", "hf_abc")
    assert config == EngineConfig.from_kwargs(hf_token="hf_abc", ignore_patterns=["x"],
                                              max_parallel_loading_workers=4)
    assert config == EngineConfig()


@pytest.mark.parametrize("kwargs,named", [
    ({"compilation_config": {"backend": "eager"}}, "compilation_config key 'backend'"),
    ({"compilation_config": '{"cudagraph_mode": "FULL_ONLY"}'}, "cudagraph_mode='FULL_ONLY'"),
    ({"compilation_config": {"mode": 7}}, r"compilation_config.mode=7"),
    ({"compilation_config": "{"}, "compilation_config is not valid JSON"),
    ({"optimization_level": 4}, "optimization_level=4"),
    ({"compilation_config": {"cudagraph_mode": "NONE"}, "enforce_eager": False},
     "enforce_eager=False disagrees"),
    ({"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
      "max_mixed_graph_tokens": 64}, "max_mixed_graph_tokens=64 disagrees"),
    ({"cudagraph_capture_sizes": [8], "cuda_graph_sizes": [8]}, "not both"),
    ({"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 16},
     "max_cudagraph_capture_size=16 must be the largest"),
    ({"cudagraph_capture_sizes": [0]}, "batch sizes >= 1"),
])
def test_refusals_name_the_key(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig.from_kwargs(**kwargs)


def test_serve_refuses_an_unknown_dotted_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="'use_inductor'"):
        _serve("-O.use_inductor=false")
    with pytest.raises(ValueError, match="-O.key=value"):
        _serve("-O.cudagraph_mode")


def test_cudagraph_capture_sizes_are_the_exact_decode_graphs(model: Path) -> None:
    """One value is that size only (``cuda_graph_sizes=[3]`` would be 1, 2, 3);
    FULL_DECODE_ONLY captures no mixed-step graph; the output is the eager engine's."""
    from mrv2.runner.cuda_graphs import capture_sizes

    assert capture_sizes(4, sizes=[3]) == [1, 2, 3]
    assert capture_sizes(4, exact=[3]) == [3]
    assert capture_sizes(4, exact=[2, 8]) == [2]  # (past max_num_seqs: dropped)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm = _llm(model, cudagraph_capture_sizes=[3],
               compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    emulate_cuda_graphs(llm.engine.runner)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.plan[1] == [3] and not graphs.mixed_graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    default = _llm(model)
    emulate_cuda_graphs(default.engine.runner)
    assert default.engine.runner.graphs is not None
    assert default.engine.runner.graphs.mixed_graphs  # (what FULL_DECODE_ONLY turns off)
    default.shutdown()
    eager = _llm(model, optimization_level=0)
    assert eager.engine.config.device.enforce_eager
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params,
                                                                  use_tqdm=False)]
    eager.shutdown()
