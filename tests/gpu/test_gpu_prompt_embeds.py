"""GPU: prompts given as embeddings (``enable_prompt_embeds``) beside token prompts, through
chunked prefill, the mixed-step and decode CUDA graphs and async scheduling: the model's own
embedding rows give the token prompt's tokens, random rows HF ``inputs_embeds``' greedy
tokens (fp32), and a step that adds and computes such a prompt makes no host sync.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.contract.params import SamplingParams as StepParams
from mrv2.contract.prompt_embeds import prompt_embeds_item
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 250 for i in range(300)], [64, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pe"), "Qwen3ForCausalLM", std=0.15,
                                vocab_size=320, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                max_position_embeddings=1024)


def _llm(ckpt: Path, **kwargs: Any) -> LLM:
    return LLM(str(ckpt), device="cuda", dtype="float32", block_size=16,
               gpu_memory_utilization=0.3, max_model_len=1024, enable_prompt_embeds=True,
               **kwargs)


def _hf_greedy_embeds(hf: Any, embeds: torch.Tensor, n: int) -> list[int]:
    table = hf.get_input_embeddings()
    x, out = embeds[None].cuda(), []
    with torch.no_grad():
        for _ in range(n):
            token = int(hf(inputs_embeds=x).logits[0, -1].argmax())
            out.append(token)
            x = torch.cat([x, table(torch.tensor([[token]], device="cuda"))], dim=1)
    return out


def test_prompt_embeds_beside_token_prompts_fp32(ckpt: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = _llm(ckpt, max_num_batched_tokens=128)  # (the 300-row prompt over three steps)
    model: Any = llm.engine.runner.model
    with torch.no_grad():
        rows = [model.embed_input_ids(torch.tensor(p, device="cuda")).float().cpu()
                for p in PROMPTS]
    by_ids = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    gen = torch.Generator().manual_seed(0)
    random = [torch.randn(n, 256, generator=gen) * 0.5 for n in (40, 200)]
    prompts: list[Any] = [{"prompt_embeds": r} for r in rows]
    prompts += [{"prompt_token_ids": p} for p in PROMPTS]
    prompts += [{"prompt_embeds": r} for r in random]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert outs[:3] == by_ids and outs[3:6] == by_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32).cuda().eval()
    assert outs[6:] == [_hf_greedy_embeds(hf, r, 16) for r in random]


def test_adding_and_computing_embeddings_makes_no_host_sync(ckpt: Path) -> None:
    runner = _llm(ckpt).engine.runner
    embeds = torch.randn(20, 256, generator=torch.Generator().manual_seed(1))
    item = prompt_embeds_item(embeds, 256, 1024)
    params = StepParams(temperature=0.0, max_tokens=4)
    new = [NewRequest("e", [0] * 20, params, 0, [1, 2], mm_items=[item]),
           NewRequest("t", PROMPTS[0], params, 1, [3])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = runner.execute(SchedulerOutput({"e": 20, "t": 8}, new_requests=new))
        second = runner.execute(SchedulerOutput({"e": 1, "t": 1}))  # a decode graph
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(first.result()["e"]) == 1 and len(second.result()["e"]) == 1
