"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``): an idle engine gives its weights' and KV
cache's memory back and takes it again, and then answers as before; level 2 discards the
weights until they are loaded again; requests are refused while anything sleeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.runner.sleep import Stash, module_storages
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint
from mrv2.testing_checkpoints import make_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 200, 31, 4]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM", seed=3)


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("other"), "Qwen3ForCausalLM", seed=8)


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               max_num_seqs=4, **kwargs)


def _tokens(llm: LLM, lora: LoRARequest | None = None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def _weight_storages(llm: LLM) -> list[torch.UntypedStorage]:
    runner = llm.engine.runner
    return [p.untyped_storage() for p in runner.model.parameters()]


@pytest.mark.parametrize("graphs", [False, True])
def test_level_1_frees_the_memory_and_wakes_to_the_same_answers(ckpt: Path,
                                                                 graphs: bool) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = _llm(ckpt, speculative_config=spec)
    runner = llm.engine.runner
    if graphs:
        emulate_cuda_graphs(runner)
    before = _tokens(llm)
    first_graphs = runner.graphs
    sizes = [s.nbytes() for s in _weight_storages(llm)]
    llm.sleep()
    assert llm.is_sleeping() and runner.asleep == ("weights", "kv_cache")
    assert all(s.nbytes() == 0 for s in _weight_storages(llm))
    assert runner.graphs is None and runner.builder.graphs is None
    with pytest.raises(RuntimeError, match=r"asleep \(weights, kv_cache\): wake_up"):
        llm.generate([{"prompt_token_ids": [1, 2]}], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert [s.nbytes() for s in _weight_storages(llm)] == sizes
    if graphs:  # captured again, with the capture the graphs were made with
        assert runner.graphs is not None and runner.graphs is not first_graphs
    else:
        assert runner.graphs is None
    after = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in after] == before
    assert all(o.num_cached_tokens == 0 for o in after)  # the prefix cache was forgotten
    llm.wake_up()  # awake already: nothing to do, no capture
    if graphs:
        assert runner.graphs is not None


def test_a_draft_models_weights_sleep_and_wake_with_the_target(ckpt: Path) -> None:
    # the model drafting for itself: every draft is kept while its weights are its own
    spec = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 2}
    llm = _llm(ckpt, speculative_config=spec)
    speculator = llm.engine.runner.speculator
    drafter = module_storages([speculator], torch.device("cpu"))
    assert drafter  # (its modules are found among the speculator's attributes)
    before = _tokens(llm)
    llm.sleep()
    assert all(s.nbytes() == 0 for s in drafter)
    llm.wake_up()
    assert _tokens(llm) == before
    assert llm.engine.stats()["spec_acceptance_rate"] == 1.0  # its weights back too


def test_the_tags_wake_apart_and_new_weights_load_before_the_cache_wakes(
        ckpt: Path, other: Path) -> None:
    expected = _tokens(_llm(other))
    llm = _llm(ckpt)
    _tokens(llm)
    llm.sleep(level=1)
    with pytest.raises(RuntimeError, match=r"wake_up\(tags=\['weights'\]\) first"):
        llm.update_weights([])
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and llm.engine.runner.asleep == ("kv_cache",)
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache\)"):
        _tokens(llm)
    from mrv2.model_loader.loader import iter_safetensors

    llm.update_weights(iter_safetensors(str(other)))  # an RL trainer's new weights
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == expected


def test_level_2_discards_the_weights_until_they_are_loaded_again(ckpt: Path,
                                                                  tmp_path: Path) -> None:
    lora = LoRARequest("a", 1, str(make_lora_adapter(ckpt, tmp_path / "a", rank=8)))
    llm = _llm(ckpt, enable_lora=True, max_loras=1, max_lora_rank=8)
    before = _tokens(llm)
    adapted = _tokens(llm, lora)
    assert adapted != before
    llm.sleep(level=2)
    assert all(s.nbytes() == 0 for s in _weight_storages(llm))
    llm.wake_up()
    assert not llm.is_sleeping()
    model = llm.engine.runner.model
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())  # zeros, not old
    # the buffers (the adapter's slot) were kept, not discarded
    assert any(torch.count_nonzero(b) > 0 for b in model.buffers())
    with pytest.raises(RuntimeError, match=r"discarded by sleep\(level=2\).*reload_weights"):
        _tokens(llm)
    loaded = llm.reload_weights()
    assert loaded == {name for name, _ in model.named_parameters()}
    assert _tokens(llm) == before
    assert _tokens(llm, lora) == adapted


def test_bad_arguments_and_a_busy_engine_are_refused_by_name(ckpt: Path) -> None:
    llm = _llm(ckpt, enable_sleep_mode=True)  # (vLLM's flag: accepted, not needed)
    for level in (0, 3, "1", True):
        with pytest.raises(ValueError, match=r"level must be one of \[1, 2\]"):
            llm.sleep(level)  # type: ignore[arg-type]
    for tags in (["weight"], [], "kv"):
        with pytest.raises(ValueError, match=r"tags must be a non-empty subset of \['weights', "
                                             r"'kv_cache'\]"):
            llm.wake_up(tags)  # type: ignore[arg-type]
    llm.engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="sleep needs an idle engine"):
        llm.sleep()
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert not llm.is_sleeping()
    llm.sleep()
    llm.wake_up(["kv_cache"])  # a tag at a time, either order
    llm.wake_up("weights")  # type: ignore[arg-type]
    assert _tokens(llm)
    llm.sleep()
    llm.shutdown()  # asleep: the host copies go too


def test_a_stash_restores_shared_storages_and_keeps_what_cannot_be_resized() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 4)
    tied = torch.nn.Linear(6, 4, bias=False)
    tied.weight = layer.weight  # one storage, two modules
    layer.derived = layer.weight.t()  # a view kept as an attribute  # type: ignore[assignment]
    cache = torch.frombuffer(bytearray(64), dtype=torch.float32)  # not resizable
    cache.copy_(torch.randn(16))
    model = torch.nn.ModuleList([layer, tied])
    weights = module_storages([model], torch.device("cpu"))
    assert len(weights) == 2  # the weight (shared three ways) and the bias
    expected = [layer.weight.clone(), layer.bias.clone()]
    stash = Stash.put_to_sleep(weights, keep=lambda s: True)
    assert layer.weight.untyped_storage().nbytes() == 0 and stash.kept_bytes == 4 * (24 + 4)
    kv = Stash.put_to_sleep([cache.untyped_storage()], keep=lambda s: False)
    assert kv.freed_bytes == 0 and cache.untyped_storage().nbytes() == 64
    stash.wake()
    kv.wake()
    torch.testing.assert_close(layer.weight, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(layer.bias, expected[1], rtol=0, atol=0)
    torch.testing.assert_close(layer.derived, expected[0].t(), rtol=0, atol=0)
    assert tied.weight.data_ptr() == layer.weight.data_ptr()
    assert torch.count_nonzero(cache) == 16  # not freed: left as it was (never zeroed)
    from mrv2.runner.sleep import _page_aligned

    assert _page_aligned(10).data_ptr() % 4096 == 0 and _page_aligned(10).numel() == 10
    scratch = torch.randn(8) + 3
    Stash.put_to_sleep([scratch.untyped_storage()], keep=lambda s: False).wake()
    assert torch.count_nonzero(scratch) == 0  # freed and discarded: zeros, not garbage


class _Storage:
    """A storage whose second growth fails, as a device without room would."""

    device = torch.device("cpu")
    grows = 0

    def __init__(self) -> None:
        self.size = 8

    def nbytes(self) -> int:
        return self.size

    def resizable(self) -> bool:
        return True

    def resize_(self, size: int) -> None:
        if size:
            _Storage.grows += 1
            if _Storage.grows == 2:
                raise torch.OutOfMemoryError("no room")
        self.size = size


def test_a_wake_without_room_gives_back_what_it_took_and_stays_asleep() -> None:
    storages = [_Storage(), _Storage()]
    stash = Stash.put_to_sleep(storages, keep=lambda s: False)  # type: ignore[arg-type]
    assert [s.size for s in storages] == [0, 0]
    with pytest.raises(torch.OutOfMemoryError):
        stash.wake()
    assert [s.size for s in storages] == [0, 0]
