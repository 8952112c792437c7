"""Checkpoints that carry per-layer KV-cache scales (compressed-tensors' ``kv_cache_scheme``,
ModelOpt's ``kv_cache_quant_algo``, FP8 checkpoints' ``self_attn.k_scale`` /
``self_attn.attn.k_scale`` / ``k_proj.output_scale``): with the model-dtype cache the scales
are not used (vLLM ignores them too) and the tokens are the same checkpoint's without them;
mrv2's fp8 cache stores values unscaled, so scales other than 1 are refused at start-up,
naming ``kv_cache_dtype`` and the scales."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint
from mrv2.testing_quant import compressed_tensors_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
#: How the published formats name layer ``i``'s scales.
NAMINGS = {
    "self_attn": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
    "attn": ("model.layers.{i}.self_attn.attn.k_scale",
             "model.layers.{i}.self_attn.attn.v_scale"),
    "output_scale": ("model.layers.{i}.self_attn.k_proj.output_scale",
                     "model.layers.{i}.self_attn.v_proj.output_scale"),
}
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


def _greedy(path: Path, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _with_scales(src: Path, dst: Path, naming: str, value: float,
                 config_fields: dict[str, Any]) -> None:
    """``src`` copied to ``dst`` with a k and a v scale per layer (fp32 scalars) and
    ``config_fields`` set in its ``quantization_config`` (made if absent)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    config = json.loads((dst / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        for name in NAMINGS[naming]:
            tensors[name.format(i=i)] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, path)
    if config_fields:
        config["quantization_config"] = {**config.get("quantization_config", {}),
                                         **config_fields}
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plain"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory: pytest.TempPathFactory, plain: Path) -> Path:
    root = tmp_path_factory.mktemp("w4a16")
    compressed_tensors_checkpoint(plain, root / "q", root / "ref", bits=4, group_size=32)
    return root / "q"


def test_compressed_tensors_kv_scales_ignored_with_a_model_dtype_cache(
        tmp_path: Path, w4a16: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A W4A16 checkpoint with ``kv_cache_scheme`` and its ``self_attn.k_scale`` tensors
    generates what the same checkpoint without them does; a log line says they are unused."""
    _with_scales(w4a16, tmp_path / "kv", "self_attn", 0.25, {"kv_cache_scheme": KV_SCHEME})
    with caplog.at_level(logging.INFO, logger="mrv2"):
        got = _greedy(tmp_path / "kv")
    assert got == _greedy(w4a16)
    assert any("k_scale" in r.getMessage() and "kv_cache_dtype" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("naming", ["attn", "output_scale"])
def test_fp8_style_kv_scale_names_ignored_with_a_model_dtype_cache(
        tmp_path: Path, plain: Path, naming: str) -> None:
    _with_scales(plain, tmp_path / "kv", naming, 0.5, {})
    assert _greedy(tmp_path / "kv") == _greedy(plain)


def test_kv_scales_with_an_fp8_cache_refused_at_start_up(tmp_path: Path, plain: Path) -> None:
    """mrv2's fp8 cache stores values unscaled: scales other than 1 cannot be honoured, so
    the engine refuses, naming the setting, the scales and what to do."""
    _with_scales(plain, tmp_path / "kv", "self_attn", 0.25, {})
    with pytest.raises(ValueError, match="kv_cache_dtype") as info:
        _greedy(tmp_path / "kv", kv_cache_dtype="fp8")
    text = str(info.value)
    assert "model.layers.0.self_attn.k_scale" in text and "kv_cache_dtype='auto'" in text


def test_unit_kv_scales_with_an_fp8_cache_load(tmp_path: Path, w4a16: Path) -> None:
    """Scales of 1 are what mrv2's fp8 cache applies: the checkpoint loads and generates as
    without them."""
    _with_scales(w4a16, tmp_path / "kv", "output_scale", 1.0, {"kv_cache_scheme": KV_SCHEME})
    assert _greedy(tmp_path / "kv", kv_cache_dtype="fp8") == _greedy(w4a16, kv_cache_dtype="fp8")


def test_kv_cache_only_compressed_tensors_checkpoint_loads(tmp_path: Path, plain: Path) -> None:
    """llm-compressor's KV-cache-only scheme (no weight config group: the weights are the
    model dtype's) passes the configuration check and generates the plain checkpoint's
    tokens."""
    _with_scales(plain, tmp_path / "kv", "self_attn", 0.25, {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "ignore": [], "quantization_status": "compressed", "kv_cache_scheme": KV_SCHEME})
    assert _greedy(tmp_path / "kv") == _greedy(plain)
