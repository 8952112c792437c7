"""GPU: the server's engine process forked from the zygote (``MRV2_WORKER_ZYGOTE=1``,
:meth:`mrv2.executor.zygote.Zygote.fork_call`) builds its engine on the GPU and answers as the
spawned one does: the zygote imports the engine's modules without initializing CUDA, so the
process it forks can.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mrv2 import EngineConfig
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer, serve_in_thread

pytestmark = pytest.mark.gpu


def _answer(model_dir: Path) -> tuple[str, list[int], str]:
    """The engine process's kind and its greedy answer to one prompt, over HTTP."""
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    engine = RemoteEngine(EngineConfig.from_kwargs(
        model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=128,
        gpu_memory_utilization=0.3))
    try:
        assert engine.process.info.device.startswith("cuda")
        for url in serve_in_thread(create_app(engine, served_model_name="tiny")):
            response = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": [5, 17, 99, 3], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
    finally:
        engine.shutdown()
    return type(engine.process._process).__name__, choice["token_ids"], choice["text"]


def test_the_forked_engine_process_serves_on_the_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM", vocab_size=320,
                                hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64)
    make_tiny_tokenizer(ckpt)
    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", "0")
    spawned = _answer(ckpt)
    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", "1")
    forked = _answer(ckpt)
    assert spawned[0] != "ForkedWorker" and forked[0] == "ForkedWorker"
    assert forked[1:] == spawned[1:] and len(forked[1]) == 8
