"""GPU: a sequence classifier's label probabilities and a reranker's scores against HF
transformers (fp32), through the CUDA graphs and async scheduling, beside generation-free
pooling steps of several prompts at once.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mrv2 import LLM
from mrv2.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 250 for i in range(70)], [64, 9]]
SHAPE = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def _hf(path: object, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def test_classify_and_score_match_hf_fp32(tmp_path_factory: pytest.TempPathFactory) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    root = tmp_path_factory.mktemp("cls")
    path = make_tiny_checkpoint(root / "cls", "Qwen3ForSequenceClassification", seed=4,
                                num_labels=3, **SHAPE)
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, max_model_len=256)
    for out, ids in zip(llm.classify([{"prompt_token_ids": p} for p in PROMPTS],
                                     use_tqdm=False), PROMPTS, strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), _hf(path, ids),
                                   rtol=1e-4, atol=1e-5)
    llm.shutdown()
    path = make_tiny_checkpoint(root / "rerank", "Qwen3ForSequenceClassification", seed=5,
                                num_labels=1, **SHAPE)
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, max_model_len=256)
    got = llm.score({"prompt_token_ids": [11, 12]}, [{"prompt_token_ids": p} for p in PROMPTS],
                    use_tqdm=False)
    for g, p in zip(got, PROMPTS, strict=True):
        assert abs(g.outputs.score - float(_hf(path, [11, 12] + p)[0])) < 1e-4
    llm.shutdown()


def test_token_classify_matches_hf_fp32_chunk_by_chunk(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A token classifier's per-token label probabilities (``LLM.reward``) against HF's, the
    70-token prompt in chunks of 32 through the mixed graphs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tok"), "Qwen3ForTokenClassification",
                                seed=6, num_labels=3, **SHAPE)
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, max_model_len=256, max_num_batched_tokens=32)
    for out, ids in zip(llm.reward([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False),
                        PROMPTS, strict=True):
        with torch.no_grad():
            want = torch.softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
        torch.testing.assert_close(out.outputs.data, want, rtol=1e-4, atol=1e-5)
    llm.shutdown()
