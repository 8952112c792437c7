"""GPU: LoRA adapters through the Triton shrink/expand kernels, CUDA graphs (decode and
mixed) and async scheduling. In fp32 a batch mixing the base model and two adapters gives HF's
greedy tokens of each adapter merged into the weights; in bf16 (the serving dtype) each
adapter's tokens are those it gives alone, with and without CUDA graphs.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 250 for i in range(70)], [64, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "Qwen3ForCausalLM", vocab_size=320,
                                hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64)
    adapters = {"all": make_lora_adapter(base, root / "all", rank=16, seed=1, std=0.1),
                "some": make_lora_adapter(base, root / "some", rank=8, seed=2, std=0.1,
                                          targets=("q_proj", "v_proj", "down_proj"))}
    return base, adapters


def _mixed(llm: LLM, adapters: dict[str, Path]) -> list[list[int]]:
    loras = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    prompts = [{"prompt_token_ids": p} for _ in loras for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[lora for lora in loras for _ in PROMPTS])
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_adapters_match_merged_references_fp32(case: tuple[Path, dict[str, Path]],
                                                     tmp_path: Path) -> None:
    base, adapters = case
    torch.backends.cuda.matmul.allow_tf32 = False
    want = [hf_greedy(base, p, 12) for p in PROMPTS]
    for name, path in adapters.items():
        merged = merge_lora_checkpoint(base, path, tmp_path / name)
        want += [hf_greedy(merged, p, 12) for p in PROMPTS]
    llm = LLM(str(base), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, enable_lora=True, max_loras=2)
    assert _mixed(llm, adapters) == want
    llm.shutdown()
    del llm  # (its KV cache counts as in use for the next engine's budget until freed)


def test_bf16_graphs_give_the_eager_tokens(case: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = case
    got, alone = {}, {}
    for eager in (True, False):
        llm = LLM(str(base), device="cuda", dtype="bfloat16", block_size=16,
                  gpu_memory_utilization=0.3, enable_lora=True, max_loras=2,
                  enforce_eager=eager)
        got[eager] = _mixed(llm, adapters)
        # no adapter live: the graphs captured without the adapters' kernels
        alone[eager] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
        llm.shutdown()
        del llm
    assert got[True] == got[False]
    assert alone[True] == alone[False]
    n = len(PROMPTS)
    assert got[True][:n] != got[True][n:2 * n]  # the adapter reached the outputs
