"""GPU: Qwen3-Next (Gated DeltaNet layers with per-request state, gated attention, the gated
shared expert) through the engine on the Triton state kernels: fp32 greedy tokens are HF's with
CUDA graphs (decode and mixed steps) and without, prompts split across steps and requests
preempted, and with n-gram speculation (rejected drafts leave no trace in the state); bf16
graphs on and off agree and start with HF's tokens; a step never synchronizes. Qwen3.5 (dense
and MoE) in the graphs test too; Qwen3.5 with its delta-net projections in FP8 and GPTQ,
and LoRA adapters on the delta-net projections (both families).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import hf_greedy, run_steps_without_sync

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [1 + (7 * i) % 120 for i in range(97)],
           [64]]
ARCH = {"hidden_size": 256, "intermediate_size": 512, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "head_dim": 64, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256}


def _generate(path: Path, dtype: str, prompts: list[list[int]] = PROMPTS,
              **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _save(family: str, path: Path) -> None:
    """The tiny checkpoint of ``family`` at :data:`ARCH`'s sizes (Qwen3.5's dense one without
    the experts' fields)."""
    from mrv2_qwen.testing import save_tiny_qwen3_5, save_tiny_qwen3_next

    if family == "qwen3_next":
        save_tiny_qwen3_next(path, **ARCH)
        return
    moe = family == "qwen3_5_moe"
    arch = {k: v for k, v in ARCH.items() if moe or "expert" not in k}
    if moe:
        arch.pop("intermediate_size")
    save_tiny_qwen3_5(path, moe=moe, **arch)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_qwen3_next_with_graphs(tmp_path: Path, family: str) -> None:
    """With a prompt of 130 tokens, past the chunked delta rule's threshold, the first step's
    prompts take the chunked kernels eagerly as in a mixed graph (whose padded token count is
    its query bound), so bf16 graphs and eager run the same kernels (a step of shorter prompts
    would run token-serial eagerly: TF32 products against fp32 ones, another bf16 rounding).
    Qwen3.5 (dense and MoE: its projections loaded by kind) alike."""
    from mrv2_kernels.chunk_delta_rule import CHUNKED_MIN_QUERY_LEN_DELTA

    prompts = [*PROMPTS, [1 + (11 * i + 3) % 120 for i in range(130)]]
    assert len(prompts[-1]) >= CHUNKED_MIN_QUERY_LEN_DELTA
    _save(family, tmp_path)
    expected = [hf_greedy(tmp_path, p, 40) for p in prompts]
    assert _generate(tmp_path, "float32", prompts) == expected
    assert _generate(tmp_path, "float32", prompts, enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", prompts, max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", prompts, num_gpu_blocks_override=12) == expected
    graphs = _generate(tmp_path, "bfloat16", prompts)
    eager = _generate(tmp_path, "bfloat16", prompts, enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(prompts) - 1


def test_qwen3_next_steps_never_synchronize(tmp_path: Path) -> None:
    from mrv2_qwen.testing import save_tiny_qwen3_next

    save_tiny_qwen3_next(tmp_path, **ARCH)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.keeps_request_state and runner.graphs is not None
    tokens = run_steps_without_sync(runner, PROMPTS)
    assert tokens
    runner.shutdown()


def test_qwen3_next_speculative_decoding_with_graphs(tmp_path: Path) -> None:
    """n-gram drafts (3 a step) verified through the Triton state kernels with their rows per
    request (``row_slots`` 4), in CUDA graphs and eager: fp32 greedy tokens are HF's, drafts
    both kept and rejected; then the same with prefix caching's snapshots beside them."""
    from mrv2_qwen.testing import save_tiny_qwen3_next

    save_tiny_qwen3_next(tmp_path, **ARCH)
    prompts = [[5, 9, 13, 17, 21] * 4, [40, 3] * 9 + [7], PROMPTS[2][:40]]
    expected = [hf_greedy(tmp_path, p, 40) for p in prompts]
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    for kwargs in ({}, {"enforce_eager": True}, {"enable_prefix_caching": True,
                                                  "max_num_batched_tokens": 32}):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, **spec, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.stats()
        llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats


def test_qwen3_next_mtp_drafts_in_graphs(tmp_path: Path) -> None:
    """Qwen3-Next's MTP head drafting (k = 3) in its drafting graphs, the verify steps in the
    decode graphs: an MTP head made to draft the last token repeated (kept exactly where the
    greedy output repeats it), fp32 greedy tokens HF's, eager and in graphs alike, some drafts
    kept."""
    from safetensors.torch import save_file

    from mrv2_qwen.testing import checkpoint_with_mtp, identity_mtp

    save_file(identity_mtp(checkpoint_with_mtp(tmp_path, **ARCH)),
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    expected = [hf_greedy(tmp_path, p, 40) for p in PROMPTS]
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    for kwargs in ({}, {"enforce_eager": True}):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, speculative_config=spec, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.engine.stats()
        llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs
        assert stats["spec_num_draft_tokens"] > 0, stats


@pytest.mark.parametrize("fmt", ["fp8", "gptq"])
def test_qwen3_5_quantized_delta_net_projections(tmp_path: Path, fmt: str) -> None:
    """Qwen3.5-MoE with its Gated DeltaNet ``in_proj_qkv`` (split into q, k and v as it
    loads) and ``in_proj_z`` quantized as the other projections: block FP8 (128 x 128, as
    Qwen3.5-*-FP8) on the FP8 GEMM kernel, GPTQ (act-order) on the integer kernel, the fused
    ``in_proj_qkvz`` kept quantized. GPTQ in fp32 gives HF's greedy tokens on the dequantized
    weights, graphs on and off; in bf16 (FP8's activations quantized per token group) graphs
    on and off agree and start with HF's tokens."""
    from mrv2 import testing_quant
    from mrv2.layers.fp8 import Fp8LinearMixin
    from mrv2.layers.int_quant import IntLinearMixin
    from mrv2.testing_checkpoints import fp8_checkpoint

    also = (".in_proj_qkv.weight", ".in_proj_z.weight")
    src, q, ref = tmp_path / "src", tmp_path / "q", tmp_path / "ref"
    _save("qwen3_5_moe", src)
    if fmt == "fp8":
        fp8_checkpoint(src, q, ref, also=also)
    else:
        testing_quant.gptq_checkpoint(src, q, ref, group_size=64, desc_act=True, also=also)
    expected = [hf_greedy(ref, p, 40) for p in PROMPTS]
    if fmt == "gptq":
        assert _generate(q, "float32") == expected
        assert _generate(q, "float32", enforce_eager=True) == expected
    llm = LLM(str(q), device="cuda", dtype="bfloat16", block_size=16,
              gpu_memory_utilization=0.3)
    kind = Fp8LinearMixin if fmt == "fp8" else IntLinearMixin
    fused = [m.in_proj_qkvz for m in llm.engine.runner.model.modules()
             if hasattr(m, "in_proj_qkvz")]
    assert fused and all(isinstance(layer, kind) for layer in fused)
    llm.shutdown()
    del llm  # (its KV cache counts as in use for the next engine's budget until freed)
    graphs = _generate(q, "bfloat16")
    eager = _generate(q, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_lora_on_the_delta_net_with_graphs(tmp_path: Path, family: str) -> None:
    """A LoRA adapter on every Gated DeltaNet projection (Qwen3-Next's ``in_proj_qkvz`` /
    ``in_proj_ba``, rows regrouped as the weight's; Qwen3.5's ``in_proj_qkv`` / ``in_proj_z``
    / ``in_proj_b`` / ``in_proj_a``) and ``out_proj``, and on the attention's ``q_proj`` /
    ``o_proj``, through the Triton LoRA kernels: fp32 greedy tokens are HF's on the adapter
    merged into the base, in CUDA graphs and eager."""
    import torch

    from mrv2_qwen.testing import lora_against_merged

    torch.backends.cuda.matmul.allow_tf32 = False
    _save(family, tmp_path / "base")
    targets = ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
               "in_proj_a", "out_proj", "q_proj", "o_proj")
    for eager in (False, True):
        got, want, plain = lora_against_merged(
            tmp_path / "base", tmp_path / f"eager{eager}", targets, PROMPTS[:2], 16,
            device="cuda", block_size=16, gpu_memory_utilization=0.3, max_model_len=128,
            enforce_eager=eager)
        assert want != plain
        assert got == want, eager
