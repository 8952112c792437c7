"""GPU: embedding requests beside generation requests, through the mixed-step CUDA graphs and
async scheduling: fp32 vectors equal HF's normalized last hidden states, and the generation
requests' tokens are those they give alone.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mrv2 import LLM, PoolingParams, SamplingParams
from mrv2.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 250 for i in range(300)], [64, 9]]


def test_embeddings_beside_generation_fp32(tmp_path_factory: pytest.TempPathFactory) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("emb"), "Qwen3ForCausalLM",
                                vocab_size=320, hidden_size=256, intermediate_size=512,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                max_position_embeddings=1024)
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1],
                                              dim=-1) for p in PROMPTS]
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, max_model_len=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    engine = llm.engine
    gen = [engine.add_request(p, greedy) for p in PROMPTS]
    emb = [engine.add_request(p, greedy, pooling_params=PoolingParams()) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[r].outputs[0].token_ids for r in gen] == alone
    for req_id, w in zip(emb, want, strict=True):
        torch.testing.assert_close(torch.tensor(done[req_id].embedding), w, rtol=1e-4,
                                   atol=1e-5)
