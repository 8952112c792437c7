"""Every hook, implemented by a throwaway plugin and seen to take effect in a real run."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams, hookimpl
from mrv2.attention.torch_backend import TorchAttentionBackend
from mrv2.contract.batch import InputBatch
from mrv2.contract.model_state import ModelState
from mrv2.contract.speculator import Speculator, SpeculatorInputs, StepSamples
from mrv2.plugins import PluginManager
from mrv2.sample.logits_processor import LogitsProcessor
from mrv2.sample.sampler import Sampler
from mrv2.testing import make_tiny_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [9, 8]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM")


def _manager(**hooks: Callable[..., Any]) -> PluginManager:
    manager = PluginManager(autoload=True, allow=["qwen"], block=[])
    plugin = types.ModuleType("throwaway")
    for name, function in hooks.items():
        setattr(plugin, name, hookimpl(function))
    manager.register(plugin, name="throwaway")
    return manager


def _run(ckpt: Path, manager: PluginManager, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(ckpt), plugins=manager, device="cpu", dtype="float32", block_size=4, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(ckpt: Path) -> list[list[int]]:
    return _run(ckpt, PluginManager(autoload=True, allow=["qwen"], block=[]))


class LifecycleState(ModelState):
    """Records every ModelState call the runner makes."""

    calls: dict[str, list[Any]] = {}

    def add_request(self, request: Any, row: int) -> None:
        self.calls["add"].append((request.req_id, row))

    def remove_request(self, req_id: str, row: int) -> None:
        self.calls["remove"].append((req_id, row))

    def get_mm_embeddings(self, batch: InputBatch) -> None:
        self.calls["mm"].append(batch.num_reqs)

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        self.calls["inputs"].append(batch.num_tokens)
        return super().prepare_inputs(batch)

    def prepare_attn(self, batch: InputBatch) -> Any:
        self.calls["attn"].append(batch.max_seq_len)
        return super().prepare_attn(batch)


class OtherFamilyState(ModelState):
    """Another family's state, registered beside LifecycleState: must never be called."""

    calls = 0

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        OtherFamilyState.calls += 1
        return super().prepare_inputs(batch)


def _private_copy(ckpt: Path, tmp: Path, architecture: str) -> Path:
    import json
    import shutil

    private = tmp / architecture
    shutil.copytree(ckpt, private)
    config = json.loads((private / "config.json").read_text())
    config["architectures"] = [architecture]
    (private / "config.json").write_text(json.dumps(config))
    return private


def test_model_state_methods_see_every_request_and_step_of_their_model_only(
    ckpt: Path, baseline: list[list[int]], tmp_path: Path
) -> None:
    def mrv2_register_models(register: Callable[..., None]) -> None:
        register("LifecycleLM", "mrv2_qwen.model:Qwen3ForCausalLM",
                 model_state=f"{__name__}:LifecycleState")
        register("OtherLM", "mrv2_qwen.model:Qwen3ForCausalLM",
                 model_state=f"{__name__}:OtherFamilyState")

    OtherFamilyState.calls = 0
    LifecycleState.calls = {"add": [], "remove": [], "mm": [], "inputs": [], "attn": []}
    private = _private_copy(ckpt, tmp_path, "LifecycleLM")
    assert _run(private, _manager(mrv2_register_models=mrv2_register_models)) == baseline
    calls = LifecycleState.calls
    assert sorted(req for req, _ in calls["add"]) == sorted(req for req, _ in calls["remove"])
    assert len(calls["add"]) == 2
    assert calls["inputs"][0] == 5  # first step: both prompts
    assert len(calls["mm"]) == len(calls["inputs"]) == len(calls["attn"]) >= 4
    assert OtherFamilyState.calls == 0  # another family's state never runs for this model


class Sevens(ModelState):
    """Feeds token 7 whatever the batch holds: the model must see it."""

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        return {**super().prepare_inputs(batch), "input_ids": torch.full_like(batch.input_ids, 7)}


def test_prepare_inputs_method_changes_the_model_input(ckpt: Path, tmp_path: Path) -> None:
    seen: list[torch.Tensor] = []

    def mrv2_register_models(register: Callable[..., None]) -> None:
        register("SevensLM", "mrv2_qwen.model:Qwen3ForCausalLM", model_state=f"{__name__}:Sevens")

    private = _private_copy(ckpt, tmp_path, "SevensLM")
    manager = _manager(mrv2_register_models=mrv2_register_models)
    llm = LLM(str(private), plugins=manager, device="cpu", dtype="float32", block_size=4)
    forward = llm.engine.runner.model.forward

    def spy(input_ids: torch.Tensor, positions: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(input_ids.clone())
        return forward(input_ids, positions, **kw)  # type: ignore[no-any-return]

    llm.engine.runner.model.forward = spy  # type: ignore[method-assign]
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert seen and all(bool((ids == 7).all()) for ids in seen)


def test_dummy_inputs_and_graph_capture_methods(ckpt: Path) -> None:
    llm = LLM(str(ckpt), plugins=PluginManager(autoload=True, allow=["qwen"], block=[]),
              device="cpu", dtype="float32", block_size=4)
    state = llm.engine.runner.model_state
    batch = state.prepare_dummy_inputs(num_reqs=3, num_tokens=10)
    assert (batch.num_reqs, batch.num_tokens) == (3, 10)
    assert batch.query_start_loc.tolist() == [0, 4, 7, 10]
    assert bool((batch.slot_mapping == -1).all())
    assert batch.logits_indices.tolist() == [3, 6, 9]  # no speculation: last tokens only
    assert state.capture_cuda_graph(batch, lambda: 0) is None  # CPU: no graphs


def test_profile_step_fits_the_block_table(ckpt: Path) -> None:
    """One request never holds more than ``max_model_len`` tokens: with ``max_num_seqs=1`` the
    profiling forward (the largest step) is ``max_model_len`` tokens, not the whole token
    budget, and a dummy batch longer than a block-table row is refused (on the GPU its
    attention read past the row: an illegal memory access at start-up)."""
    from mrv2 import EngineConfig, Runner
    from mrv2.runner.capture import profile_batch

    config = EngineConfig.from_kwargs(model=str(ckpt), device="cpu", dtype="float32",
                                      block_size=4, max_num_seqs=1, max_model_len=64,
                                      max_num_batched_tokens=256)
    runner = Runner.from_config(config)
    assert runner.profile_shape() == (1, 64)
    batch = profile_batch(runner)  # (its query bound: the step's tokens, any step's of its size)
    assert batch.num_tokens == batch.max_query_len == 64
    with torch.inference_mode():
        hidden = runner._forward(batch)
    assert hidden.shape[0] == 64
    with pytest.raises(ValueError, match="a block-table row holds 64"):
        runner.model_state.prepare_dummy_inputs(1, 256)
    # Four requests of 8 tokens: the profile step still bounds its queries by 32, as any step
    # of 32 tokens may (a layer's chunked form and its scratch are measured at start-up).
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cpu", dtype="float32",
                                      block_size=4, max_num_seqs=4, max_model_len=64,
                                      max_num_batched_tokens=32)
    runner = Runner.from_config(config)
    batch = profile_batch(runner)
    assert (batch.num_reqs, batch.num_tokens, batch.max_query_len) == (4, 32, 32)
    assert batch.query_start_loc.tolist() == [0, 8, 16, 24, 32]


def test_sampler_hook_replaces_the_sampler(ckpt: Path) -> None:
    class Always11(Sampler):
        def __call__(self, logits: torch.Tensor, batch: InputBatch, table: Any,
                     plan: Any = None) -> torch.Tensor:
            return torch.full((batch.num_logits,), 11, dtype=torch.int64)

    def mrv2_make_sampler(config: Any, vocab_size: int, device: torch.device) -> Sampler:
        return Always11(config.scheduler.max_num_seqs, vocab_size, device)

    assert _run(ckpt, _manager(mrv2_make_sampler=mrv2_make_sampler)) == [[11] * 4] * 2


class Force5(LogitsProcessor):
    """Bans every token but 5."""

    def apply(self, logits: torch.Tensor, batch: InputBatch, table: Any) -> None:
        logits[:, :5] = float("-inf")
        logits[:, 6:] = float("-inf")


def test_logits_processor_registration(ckpt: Path) -> None:
    def mrv2_register_logits_processors(register: Callable[..., None]) -> None:
        register("force5", f"{__name__}:Force5")

    manager = _manager(mrv2_register_logits_processors=mrv2_register_logits_processors)
    assert _run(ckpt, manager, logits_processors=["force5"]) == [[5] * 4] * 2
    with pytest.raises(ValueError, match="unknown logits processor 'nope'; registered: force5"):
        _run(ckpt, manager, logits_processors=["nope"])


class CountingBackend(TorchAttentionBackend):
    """The torch backend, counting its forwards."""

    name = "counting"
    calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        CountingBackend.calls += 1
        return super().forward(*args, **kwargs)


def test_attention_backend_registration(ckpt: Path, baseline: list[list[int]]) -> None:
    def mrv2_register_attention_backends(register: Callable[..., None]) -> None:
        register("counting", f"{__name__}:CountingBackend", devices=("cpu",))

    manager = _manager(mrv2_register_attention_backends=mrv2_register_attention_backends)
    CountingBackend.calls = 0
    assert _run(ckpt, manager, attention_backend="counting") == baseline
    assert CountingBackend.calls > 0
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        _run(ckpt, manager, attention_backend="flash")


class Repeater(Speculator):
    """Drafts the last known token k times (written where the speculator interface says)."""

    proposals = 0

    def propose(self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
                table: Any) -> None:
        Repeater.proposals += 1
        rows = batch.idx_mapping.long()
        last = table.token_ids[rows, (table.num_tokens[rows] - 1).long()]
        for j in range(self.num_speculative_tokens):
            pos = (table.num_tokens[rows] + j).clamp(max=table.token_ids.shape[1] - 1).long()
            keep = samples.num_sampled > 0
            table.token_ids[rows, pos] = torch.where(keep, last, table.token_ids[rows, pos])


def test_speculator_hooks(ckpt: Path, baseline: list[list[int]]) -> None:
    def mrv2_register_speculators(register: Callable[..., None]) -> None:
        register("repeat", f"{__name__}:Repeater")

    made: list[str] = []

    def mrv2_make_speculator(config: Any, model_state: Any, device: torch.device) -> Any:
        made.append(str(config.speculative.method))
        if config.speculative.method == "direct":  # not registered: built by this hook
            return Repeater(config, model_state, device)
        return None  # the core's default builds the registered one

    manager = _manager(mrv2_register_speculators=mrv2_register_speculators,
                       mrv2_make_speculator=mrv2_make_speculator)
    assert manager.registries.speculators["repeat"].plugin == "throwaway"
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'; registered: "
                                         "draft_model, ngram, repeat"):
        _run(ckpt, manager, method="medusa", num_speculative_tokens=2)
    Repeater.proposals = 0
    llm = LLM(str(ckpt), plugins=manager, device="cpu", dtype="float32", block_size=4,
              speculative_config={"method": "repeat", "num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert made == ["medusa", "repeat"] and Repeater.proposals > 0
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    Repeater.proposals = 0
    llm = LLM(str(ckpt), plugins=manager, device="cpu", dtype="float32", block_size=4,
              speculative_config={"method": "direct", "num_speculative_tokens": 1})
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline and Repeater.proposals > 0


def test_register_models_hook_with_private_model_state(ckpt: Path, baseline: list[list[int]],
                                                       tmp_path: Path) -> None:
    def mrv2_register_models(register: Callable[..., None]) -> None:
        register("PrivateLM", "mrv2_qwen.model:Qwen3ForCausalLM",
                 model_state=f"{__name__}:RecordingState")

    private = _private_copy(ckpt, tmp_path, "PrivateLM")
    RecordingState.steps = 0
    assert _run(private, _manager(mrv2_register_models=mrv2_register_models)) == baseline
    assert RecordingState.steps > 0


class RecordingState(ModelState):
    """A private ModelState: counts the steps it prepared."""

    steps = 0

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        RecordingState.steps += 1
        return super().prepare_inputs(batch)
