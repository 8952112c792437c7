"""Tensor-parallel workers forked from the zygote (``MRV2_WORKER_ZYGOTE=1``,
:mod:`mrv2.executor.zygote`): rank 0's tokens as with one rank, one zygote for engine after
engine, a new one when the environment changes, and a killed worker ends the engine naming it,
as with workers started as fresh interpreters."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.executor import zygote
from mrv2.executor.tensor_parallel import WorkerDiedError
from mrv2.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [64, 3]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("zygote"), "Qwen3ForCausalLM", std=0.15)


def _llm(model: Path, tp: int) -> LLM:
    return LLM(str(model), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               tensor_parallel_size=tp)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_workers_fork_from_one_zygote_until_the_environment_changes(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", "1")
    with _llm(model, 1) as llm:
        want = _tokens(llm)
    pids = []
    for _ in range(2):
        with _llm(model, 2) as llm:
            (worker,) = llm.engine.runner.worker_pids
            pids.append(_parent_of(worker))
            assert _tokens(llm) == want
            assert isinstance(llm.engine.runner._workers[0].proc,
                              zygote.ForkedWorker)
        assert llm.engine.runner._workers[0].proc.returncode == 0
    first = zygote.worker_zygote()
    assert pids == [first.proc.pid] * 2  # (one zygote, the workers' parent)
    monkeypatch.setenv("MRV2_TEST_ZYGOTE_MARK", "1")  # a worker must see it: a new zygote
    with _llm(model, 2) as llm:
        (worker,) = llm.engine.runner.worker_pids
        env = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
        assert b"MRV2_TEST_ZYGOTE_MARK=1" in env
        assert _parent_of(worker) == zygote.worker_zygote().proc.pid != first.proc.pid
        assert _tokens(llm) == want
    assert first.proc.wait(10) == 0 and not first.alive  # the old one left


def test_a_retired_zygote_leaves_with_its_last_worker() -> None:
    """A replaced zygote keeps the workers it forked (a running engine's) and leaves after
    the last; a worker that gets no spec says why on its error pipe and exits 1."""
    z = zygote.Zygote()
    read_fd, write_fd = os.pipe()
    try:
        worker = z.fork(write_fd)
    finally:
        os.close(write_fd)
    z.retire()
    assert z.proc.poll() is None and z.alive  # (its worker waits for its spec)
    assert worker.stdin is not None
    worker.stdin.close()
    assert worker.wait(60) == 1
    with os.fdopen(read_fd) as errors:
        assert errors.read().startswith("EOFError")
    assert z.proc.wait(10) == 0
    deadline = time.monotonic() + 5
    while z.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not z.alive


def test_a_second_engine_in_the_process_is_refused(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tensor-parallel engine per process: a second one fails at once, naming the
    first, and the first serves on (it used to hang: its group waited for ranks that never
    joined)."""
    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", "1")
    with _llm(model, 2) as first:
        want = _tokens(first)
        with pytest.raises(RuntimeError, match=r"tensor-parallel engine \(2 ranks\) is "
                                               r"already running in this process"):
            _llm(model, 2)
        assert _tokens(first) == want
    with _llm(model, 2) as again:  # after shutdown, a new one starts
        assert _tokens(again) == want


def test_a_killed_forked_worker_ends_the_engine_naming_it(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", "1")
    llm = _llm(model, 2)
    try:
        (worker,) = llm.engine.runner.worker_pids
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 20
        with pytest.raises(WorkerDiedError, match="rank 1 died: killed by signal 9"):
            while time.monotonic() < deadline:
                _tokens(llm)
                time.sleep(0.05)
    finally:
        llm.shutdown()
    assert zygote.worker_zygote().alive  # (the zygote serves the next engine)
