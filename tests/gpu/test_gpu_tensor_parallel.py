"""GPU, two or more devices (``nvidia-h200-x2``): tensor parallelism over NCCL with the
all-reduces captured in the decode graphs. TP=2 equals TP=1 in fp32 (graphs on); in bf16,
graphs on and off agree; rank 0's steps never synchronize with the GPU; new weights load on
every rank and every rank sleeps and wakes; a MoE model too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrv2 import LLM, EngineConfig, SamplingParams
from mrv2.executor import make_runner
from mrv2.testing import make_tiny_checkpoint, run_steps_without_sync

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]
ARCH = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}
MOE = {**ARCH, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256}


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = ARCH if request.param == "Qwen3ForCausalLM" else MOE
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param, **arch)


def _tokens(ckpt: Path, **kwargs: object) -> list[list[int]]:
    with LLM(str(ckpt), device="cuda", block_size=16, gpu_memory_utilization=0.3,
             **kwargs) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24,
                                ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [greedy, greedy, greedy, seeded], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_tp2_equals_tp1_with_graphs(ckpt: Path) -> None:
    assert _tokens(ckpt, dtype="float32", tensor_parallel_size=2) == \
        _tokens(ckpt, dtype="float32")


def test_bf16_tp2_graphs_on_off_agree(ckpt: Path) -> None:
    graphs = _tokens(ckpt, dtype="bfloat16", tensor_parallel_size=2)
    eager = _tokens(ckpt, dtype="bfloat16", tensor_parallel_size=2, enforce_eager=True)
    for a, b in zip(graphs, eager, strict=True):
        assert a[:8] == b[:8]  # as the single-GPU test: a late bf16 near-tie may flip


def test_rank0_steps_never_synchronize(ckpt: Path) -> None:
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3, tensor_parallel_size=2)
    runner = make_runner(config)
    try:
        assert runner.graphs is not None and runner.graphs.graphs
        tokens = run_steps_without_sync(runner, PROMPTS)
        assert set(tokens[-1]) == {"0", "1", "2", "3"}
    finally:
        runner.shutdown()


def test_tp2_loads_new_weights_and_sleeps(ckpt: Path, tmp_path: Path) -> None:
    """RL under TP=2 over NCCL: ``update_weights`` broadcasts each whole tensor and every
    rank loads its part (TP=2 then equals TP=1 on the new checkpoint, in fp32 with graphs);
    both ranks sleep (level 2 too) and wake, the graphs captured again on both."""
    from mrv2.model_loader.loader import iter_safetensors

    arch = ARCH if _arch(ckpt) == "Qwen3ForCausalLM" else MOE
    other = make_tiny_checkpoint(tmp_path / "other", _arch(ckpt), seed=11, **arch)
    want = _tokens(other, dtype="float32")
    with LLM(str(ckpt), device="cuda", block_size=16, gpu_memory_utilization=0.3,
             dtype="float32", tensor_parallel_size=2) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24,
                                ignore_eos=True)

        def tokens() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                [greedy, greedy, greedy, seeded], use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

        before = tokens()
        llm.update_weights(iter_safetensors(str(other)))
        assert tokens() == want
        llm.sleep(level=2)
        llm.wake_up()
        llm.reload_weights()
        assert llm.engine.runner.graphs is not None and tokens() == before


def _arch(ckpt: Path) -> str:
    import json

    return str(json.loads((ckpt / "config.json").read_text())["architectures"][0])


def test_weights_from_a_trainer_over_nccl(ckpt: Path, tmp_path: Path) -> None:
    """A trainer on GPU 1 broadcasts a checkpoint's tensors over NCCL to an engine on GPU 0
    (SGLang's init_weights_update_group / update_weights_from_distributed); the engine then
    answers as a fresh one on that checkpoint."""
    import socket
    import threading

    from mrv2.distributed.weight_sync import trainer_group
    from mrv2.model_loader.loader import iter_safetensors

    arch = ARCH if _arch(ckpt) == "Qwen3ForCausalLM" else MOE
    other = make_tiny_checkpoint(tmp_path / "other", _arch(ckpt), seed=12, **arch)
    want = _tokens(other, dtype="float32")
    tensors = list(iter_safetensors(str(other)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    box: dict[str, object] = {}

    def trainer() -> None:
        torch.cuda.set_device(1)
        group = trainer_group("127.0.0.1", port, 2, backend="nccl")
        for _, tensor in tensors:
            group.broadcast(tensor.to("cuda:1").contiguous())
        torch.cuda.synchronize(1)
        box["done"] = True

    with LLM(str(ckpt), device="cuda", block_size=16, gpu_memory_utilization=0.3,
             dtype="float32") as llm:
        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, backend="nccl")
        llm.update_weights_from_distributed(
            [n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])
        thread.join(120)
        assert box.get("done")
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24,
                                ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [greedy, greedy, greedy, seeded], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        llm.destroy_weights_update_group()
