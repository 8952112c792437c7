"""``kv_cache_dtype="fp8"``: float8 e4m3 caches of half (bf16) or a quarter (fp32) the bytes,
written and read by both paged backends alike, refused where a backend cannot, rejected by
name when misspelled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.runner.runner import Runner
from mrv2.testing import make_tiny_checkpoint, prefill_logits

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]

pytestmark = pytest.mark.filterwarnings(  # the Triton interpreter, harmlessly
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM")


def _runner(checkpoint: Path, **kwargs: Any) -> Runner:
    config = EngineConfig.from_kwargs(model=str(checkpoint), device="cpu", dtype="float32",
                                      block_size=4, cpu_kv_cache_gb=0.01, **kwargs)
    return Runner.from_config(config)


def test_fp8_cache_holds_four_times_the_blocks_of_an_fp32_one(checkpoint: Path) -> None:
    plain, fp8 = _runner(checkpoint), _runner(checkpoint, kv_cache_dtype="fp8")
    assert all(t.dtype == torch.float32 for t in plain.kv.tensors)
    assert all(t.dtype == torch.float8_e4m3fn for t in fp8.kv.tensors)
    assert fp8.kv.bytes_per_block(4, torch.float32) * 4 == plain.kv.bytes_per_block(
        4, torch.float32)
    assert 0 <= fp8.num_kv_blocks - 4 * plain.num_kv_blocks < 4  # (each rounded down)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_prefill_logits_near_the_full_precision_ones(checkpoint: Path, backend: str) -> None:
    """The rounding shows (the logits move) but stays small, the same on both backends."""
    want = prefill_logits(_runner(checkpoint), PROMPTS)
    got = prefill_logits(_runner(checkpoint, kv_cache_dtype="fp8", attention_backend=backend),
                         PROMPTS)
    err = (got - want).abs().max() / want.abs().max()
    assert 1e-5 < err < 0.05, err
    if backend == "triton":  # the same stored bytes, attention in fp32 on both: equal logits
        other = prefill_logits(_runner(checkpoint, kv_cache_dtype="fp8",
                                       attention_backend="torch"), PROMPTS)
        torch.testing.assert_close(got, other, atol=1e-4, rtol=1e-4)


def test_fp8_generation_same_on_both_backends(checkpoint: Path) -> None:
    """Decode steps read back what earlier steps stored (prefill chunks, then one token at a
    time): the two backends' greedy continuations agree. (The long prompt cut to 21 tokens,
    for time: still split over three steps of 16 tokens, decodes beside its chunks.)"""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [*PROMPTS[:2], PROMPTS[2][:21], PROMPTS[3]]
    tokens = []
    for backend in ("torch", "triton"):
        llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4,
                  kv_cache_dtype="fp8", attention_backend=backend, max_num_batched_tokens=16)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens.append([o.outputs[0].token_ids for o in outputs])
    assert tokens[0] == tokens[1]
    assert all(len(t) == 8 for t in tokens[0])


def test_misspelled_kv_cache_dtype_names_field_and_choices() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        EngineConfig.from_kwargs(model="x", kv_cache_dtype="fp8_e5m2")
    text = str(info.value)
    assert "kv_cache_dtype" in text and "'auto'" in text and "'fp8_e4m3'" in text


def test_mla_cache_refuses_fp8(tmp_path: Path) -> None:
    """DeepSeek's latent cache has no fp8 path: refused before any memory is sized, naming
    the setting and what is allowed."""
    mla = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
           "first_k_dense_replace": 1, "tie_word_embeddings": False, "q_lora_rank": None,
           "topk_method": "greedy"}
    ckpt = make_tiny_checkpoint(tmp_path, "DeepseekV2ForCausalLM", **mla)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*latent.*allowed here: 'auto'"):
        _runner(ckpt, kv_cache_dtype="fp8")


@pytest.mark.parametrize("path", ["cpu", "reference"])
def test_torch_backend_writes_what_to_cache_dtype_stores(path: str) -> None:
    """Both of the torch backend's writes into an fp8 cache (the CPU one and the
    device-agnostic one other devices use): the reference's bytes, saturation included,
    padding rows not written."""
    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2_kernels.kv_cache import write_kv_ref

    gen = torch.Generator().manual_seed(4)
    key = torch.randn(6, 2, 8, generator=gen) * 200  # beyond +-448 too
    value = torch.randn(6, 2, 8, generator=gen) * 1e-3  # subnormals
    slots = torch.tensor([5, -1, 0, 11, 3, -1])
    cache = torch.full((2, 3, 4, 2, 8), 7.0).to(torch.float8_e4m3fn)
    want, got = cache.clone(), cache.clone()
    write_kv_ref(key, value, want, slots)
    backend = TorchAttentionBackend()
    if path == "cpu":
        backend.write_kv(key, value, got, slots)
    else:
        backend.write_kv_reference(key, value, got, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().max() == 448.0
