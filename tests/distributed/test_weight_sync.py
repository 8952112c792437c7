"""New weights from a trainer in another process group (SGLang's
``init_weights_update_group`` / ``update_weights_from_distributed``, what OpenRLHF-style
trainers build on vLLM's ``collective_rpc``), over gloo on the CPU: the trainer's rank 0
broadcasts each tensor and every engine rank loads its part, after which the engine answers as
a fresh one on the trainer's checkpoint, at one rank and at two; ``collective_rpc`` runs a
function on every rank and names a failing rank; bad arguments are refused by name."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.distributed.weight_sync import trainer_group
from mrv2.model_loader.loader import iter_safetensors
from mrv2.testing import (
    fail_past_rank_0,
    make_tiny_checkpoint,
    make_tiny_tokenizer,
    rank_and_args,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sync")
    out = []
    for name, seed in (("served", 1), ("trained", 2)):
        path = make_tiny_checkpoint(root / name, "Qwen3ForCausalLM", vocab_size=320,
                                    seed=seed)
        make_tiny_tokenizer(path)
        out.append(path)
    return out[0], out[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(["Hello world", "Paris is"], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _beside(work: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``work`` in a thread now (the trainer's side); the returned call joins it and
    returns its result or raises its error."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as error:  # (re-raised in the test's thread)
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(120)
        assert not thread.is_alive(), "the trainer's side hung"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    return join


@pytest.mark.parametrize("size", [1, 2])
def test_a_trainers_broadcast_weights_load_on_every_rank(checkpoints: tuple[Path, Path],
                                                         size: int) -> None:
    served, trained = checkpoints
    with LLM(str(trained), device="cpu", dtype="float32") as fresh:
        want = _tokens(fresh)
    tensors = list(iter_safetensors(str(trained)))
    port, world = _port(), 1 + size
    llm = LLM(str(served), device="cpu", dtype="float32", tensor_parallel_size=size)
    try:
        assert _tokens(llm) != want
        joined = _beside(lambda: trainer_group("127.0.0.1", port, world, backend="gloo"))
        llm.init_weights_update_group("127.0.0.1", port, 1, world, backend="gloo")
        group = joined()

        def send() -> None:
            for _, tensor in tensors:
                group.broadcast(tensor.contiguous())

        sent = _beside(send)
        loaded = llm.update_weights_from_distributed(
            [n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])
        sent()
        assert "model.embed_tokens.weight" in loaded
        assert _tokens(llm) == want
        # a name the model lacks: refused on every rank, the trainer's tensors all received
        sent = _beside(lambda: group.broadcast(torch.ones(2, 2)))
        with pytest.raises(ValueError):
            llm.update_weights_from_distributed(["model.no_such.weight"], ["float32"],
                                                [[2, 2]])
        sent()
        assert _tokens(llm) == want
        assert llm.destroy_weights_update_group() is True
        assert llm.destroy_weights_update_group() is False
        group.close()
        ranks = llm.collective_rpc(rank_and_args, (7,))
        assert ranks == [(r, (7,)) for r in range(size)]
    finally:
        llm.shutdown()


def test_collective_rpc_names_the_rank_that_failed_and_goes_on(
        checkpoints: tuple[Path, Path]) -> None:
    llm = LLM(str(checkpoints[0]), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed: KeyError: 'only rank 0 may'"):
            llm.collective_rpc(fail_past_rank_0)
        with pytest.raises(ValueError, match="no public method '_forward'"):
            llm.collective_rpc("_forward")
        assert llm.collective_rpc("load_weights", ([],)) == [set(), set()]
        with pytest.raises(ValueError, match="must be picklable"):
            llm.collective_rpc(lambda runner: 0)
        with pytest.raises(RuntimeError, match="rank 1 failed: ModuleNotFoundError"):
            llm.collective_rpc(_local)  # (this test module: not importable by the workers)
        assert _tokens(llm)  # every rank still in step
    finally:
        llm.shutdown()


def _local(runner: Any) -> int:
    return 0


def test_bad_arguments_are_refused_by_name(checkpoints: tuple[Path, Path]) -> None:
    llm = LLM(str(checkpoints[0]), device="cpu", dtype="float32")
    for kwargs, field in [({"backend": "mpi"}, "backend"), ({"rank_offset": 0}, "rank_offset"),
                          ({"world_size": 1}, "world_size"), ({"master_port": 0}, "master_port"),
                          ({"group_name": ""}, "group_name")]:
        args: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": 29500,
                                "rank_offset": 1, "world_size": 2, **kwargs}
        with pytest.raises(ValueError, match=f"^{field} must"):
            llm.init_weights_update_group(**args)
    with pytest.raises(ValueError, match="names, dtypes and shapes must be as long"):
        llm.update_weights_from_distributed(["a", "b"], ["float32"], [[1]])
    with pytest.raises(ValueError, match="dtypes: 'float33'"):
        llm.update_weights_from_distributed(["a"], ["float33"], [[1]])
    with pytest.raises(ValueError, match="group_name: no weight group 'weight_update_group'"):
        llm.update_weights_from_distributed(["a"], ["float32"], [[1]])
