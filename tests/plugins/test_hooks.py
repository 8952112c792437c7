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
from mrv2.plugins import PluginManager
from mrv2.runner.input_batch import InputBatch
from mrv2.runner.model_state import ModelState
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


def test_lifecycle_hooks_see_every_request_and_step(ckpt: Path, baseline: list[list[int]]) -> None:
    calls: dict[str, list[Any]] = {"add": [], "remove": [], "mm": [], "inputs": [], "attn": []}

    def mrv2_add_request(model_state: ModelState, request: Any, row: int) -> None:
        calls["add"].append((request.req_id, row))

    def mrv2_remove_request(req_id: str, row: int) -> None:
        calls["remove"].append((req_id, row))

    def mrv2_get_mm_embeddings(batch: InputBatch) -> None:
        calls["mm"].append(batch.num_reqs)

    def mrv2_prepare_inputs(batch: InputBatch) -> dict[str, Any]:
        calls["inputs"].append(batch.num_tokens)
        return {}

    def mrv2_prepare_attn(batch: InputBatch) -> None:
        calls["attn"].append(batch.max_seq_len)

    manager = _manager(
        mrv2_add_request=mrv2_add_request, mrv2_remove_request=mrv2_remove_request,
        mrv2_get_mm_embeddings=mrv2_get_mm_embeddings, mrv2_prepare_inputs=mrv2_prepare_inputs,
        mrv2_prepare_attn=mrv2_prepare_attn,
    )
    assert _run(ckpt, manager) == baseline
    assert sorted(req for req, _ in calls["add"]) == sorted(req for req, _ in calls["remove"])
    assert len(calls["add"]) == 2
    assert calls["inputs"][0] == 5  # first step: both prompts
    assert len(calls["mm"]) == len(calls["inputs"]) == len(calls["attn"]) >= 4


def test_prepare_inputs_hook_adds_a_model_input(ckpt: Path) -> None:
    seen: list[torch.Tensor] = []

    def mrv2_prepare_inputs(batch: InputBatch) -> dict[str, Any]:
        return {"input_ids": torch.full_like(batch.input_ids, 7)}

    manager = _manager(mrv2_prepare_inputs=mrv2_prepare_inputs)
    llm = LLM(str(ckpt), plugins=manager, device="cpu", dtype="float32", block_size=4)
    forward = llm.engine.runner.model.forward

    def spy(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seen.append(input_ids.clone())
        return forward(input_ids, positions)  # type: ignore[no-any-return]

    llm.engine.runner.model.forward = spy  # type: ignore[method-assign]
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert seen and all(bool((ids == 7).all()) for ids in seen)


def test_dummy_inputs_and_graph_capture_hooks(ckpt: Path) -> None:
    sentinel = object()

    def mrv2_prepare_dummy_inputs(num_reqs: int, num_tokens: int) -> None:
        return None  # defer to the default

    def mrv2_capture_cuda_graph(batch: InputBatch, forward: Callable[[], Any]) -> object:
        return sentinel

    manager = _manager(mrv2_prepare_dummy_inputs=mrv2_prepare_dummy_inputs,
                       mrv2_capture_cuda_graph=mrv2_capture_cuda_graph)
    llm = LLM(str(ckpt), plugins=manager, device="cpu", dtype="float32", block_size=4)
    state = llm.engine.runner.model_state
    batch = manager.hook.mrv2_prepare_dummy_inputs(model_state=state, num_reqs=3, num_tokens=10)
    assert (batch.num_reqs, batch.num_tokens) == (3, 10)
    assert batch.query_start_loc.tolist() == [0, 4, 7, 10]
    assert bool((batch.slot_mapping == -1).all())
    got = manager.hook.mrv2_capture_cuda_graph(model_state=state, batch=batch, forward=lambda: 0)
    assert got is sentinel
    default = PluginManager(autoload=False)
    assert default.hook.mrv2_capture_cuda_graph(model_state=state, batch=batch,
                                                forward=lambda: 0) is None  # CPU: no graphs


def test_sampler_hook_replaces_the_sampler(ckpt: Path) -> None:
    class Always11(Sampler):
        def __call__(self, logits: torch.Tensor, batch: InputBatch, table: Any) -> torch.Tensor:
            return torch.full((batch.num_reqs,), 11, dtype=torch.int64)

    def mrv2_make_sampler(config: Any, vocab_size: int) -> Sampler:
        return Always11()

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


def test_speculator_hooks(ckpt: Path) -> None:
    def mrv2_register_speculators(register: Callable[..., None]) -> None:
        register("eagle", "some_pkg.eagle:Eagle")

    made: list[str] = []

    def mrv2_make_speculator(config: Any) -> None:
        made.append(str(config.speculative.method))
        return None

    manager = _manager(mrv2_register_speculators=mrv2_register_speculators,
                       mrv2_make_speculator=mrv2_make_speculator)
    assert manager.registries.speculators["eagle"].plugin == "throwaway"
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'; registered: eagle"):
        _run(ckpt, manager, method="medusa", num_speculative_tokens=2)
    assert made == ["medusa"]


def test_register_models_hook_with_private_model_state(ckpt: Path,
                                                       baseline: list[list[int]]) -> None:
    def mrv2_register_models(register: Callable[..., None]) -> None:
        register("PrivateLM", "mrv2_qwen.model:Qwen3ForCausalLM",
                 model_state=f"{__name__}:RecordingState")

    import json
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        private = Path(tmp) / "private"
        shutil.copytree(ckpt, private)
        config = json.loads((private / "config.json").read_text())
        config["architectures"] = ["PrivateLM"]
        (private / "config.json").write_text(json.dumps(config))
        RecordingState.steps = 0
        assert _run(private, _manager(mrv2_register_models=mrv2_register_models)) == baseline
    assert RecordingState.steps > 0


class RecordingState(ModelState):
    """A private ModelState: counts the steps it prepared."""

    steps = 0

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        RecordingState.steps += 1
        return super().prepare_inputs(batch)
