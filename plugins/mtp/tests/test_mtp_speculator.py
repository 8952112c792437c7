"""The MTP speculator on a tiny GLM-4.x checkpoint with an MTP layer, on CPU: its first draft is
the MTP layer's prediction from the right hidden state, token and position; greedy and seeded
outputs equal the plain path's under chunked prefill and preemption; a target without MTP
layers is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.attention import set_forward_context
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.testing import (
    emulate_cuda_graphs,
    make_tiny_checkpoint,
    poisoned_caches,
    step_metadata,
    torch_context,
)
from mrv2.testing_checkpoints import append_mtp_layer

GLM: dict[str, Any] = {
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
    "partial_rotary_factor": 0.5, "attention_bias": True, "num_nextn_predict_layers": 1,
    "head_dim": 16,
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64]]
NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-4.x (HF init) whose checkpoint also holds an MTP layer with weights far from
    their init (HF does not model MTP layers: they are written as GLM-4.5's are named)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("glm"), "Glm4MoeForCausalLM", **GLM)
    config = transformers.AutoConfig.from_pretrained(path)
    append_mtp_layer(path, Glm4MoeDecoderLayer(config, config.num_hidden_layers))
    return path


def _run(path: Path, spec: dict[str, Any] | None, params: Any, **kwargs: Any
         ) -> tuple[list[list[int]], LLM]:
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


MTP = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def test_first_draft_is_the_mtp_prediction(checkpoint: Path) -> None:
    """After a prefill that sampled ``t_L``, the draft at position ``L + 1`` is the argmax of
    the MTP layer over the whole prompt: row ``p`` = (hidden state of ``p``, token ``p + 1``,
    position ``p``), read at ``p = L - 1``."""
    config = EngineConfig.from_kwargs(model=str(checkpoint), device="cpu", dtype="float32",
                                      block_size=4, speculative_config=MTP)
    runner = Runner.from_config(config)
    prompt = PROMPTS[2]
    request = NewRequest("r", prompt, SamplingParams(temperature=0.0), seed=0,
                         block_ids=list(range(12)))
    sampled = runner.execute(SchedulerOutput({"r": len(prompt)}, new_requests=[request]))
    token = sampled.result()["r"][0]
    draft = int(runner.table.token_ids[runner.table.row_of("r"), len(prompt) + 1])

    # the same by hand, on fresh caches: the main layers', then the MTP layer's
    model, mtp = runner.model, runner.speculator.mtp  # type: ignore[union-attr]
    layers = runner.hf_config.num_hidden_layers
    caches = poisoned_caches(runner.hf_config.num_key_value_heads, 16, layers + 1)
    metadata = step_metadata([0], [len(prompt)], [list(range(12))])
    positions = torch.arange(len(prompt))
    with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
        hidden = model(torch.tensor(prompt, dtype=torch.int32), positions)
        following = torch.tensor(prompt[1:] + [token], dtype=torch.int32)
        out = mtp(following, positions, hidden, step=0)
        want = int(mtp.compute_logits(out[-1:], step=0).argmax())
    assert draft == want


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 8},
                                    {"num_gpu_blocks_override": 20}],
                         ids=["plain", "chunked", "tiny-cache"])
def test_greedy_equals_plain(checkpoint: Path, kwargs: dict[str, Any]) -> None:
    expected, _ = _run(checkpoint, None, GREEDY)
    got, llm = _run(checkpoint, MTP, GREEDY, **kwargs)
    assert got == expected
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if "num_gpu_blocks_override" in kwargs:
        assert stats["num_preemptions"] > 0
    assert llm.engine.block_manager.usage == 0.0


def test_seeded_sampling_equals_plain(checkpoint: Path) -> None:
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=NEW, ignore_eos=True)
              for s in range(len(PROMPTS))]
    expected, _ = _run(checkpoint, None, params)
    got, _ = _run(checkpoint, {**MTP, "num_speculative_tokens": 3}, params)
    assert got == expected


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafting_graphs_equal_plain(checkpoint: Path, temperature: float) -> None:
    """The padded graph path (emulated on the CPU): three requests pad to four, drafting
    replays its graph; greedy and seeded outputs equal the plain path's."""
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=NEW, ignore_eos=True)
              for s in range(len(prompts))]

    def run(spec: dict[str, Any] | None) -> tuple[list[list[int]], LLM]:
        kwargs = {} if spec is None else {"speculative_config": spec}
        llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, max_num_seqs=4,
                  **kwargs)
        emulate_cuda_graphs(llm.engine.runner)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    expected = run(None)[0]
    got, llm = run(MTP)
    assert got == expected
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.draft_graphs[(3, 4)].replays > 0  # type: ignore


def test_target_without_mtp_layers_is_refused(tmp_path: Path) -> None:
    qwen = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="has no MTP layers"):
        LLM(str(qwen), device="cpu", speculative_config=MTP)
