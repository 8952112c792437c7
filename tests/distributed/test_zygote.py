"""Tensor-parallel workers forked from the zygote (``MRV2_WORKER_ZYGOTE=1``,
:mod:`mrv2.executor.zygote`): rank 0's tokens as with one rank, one zygote for engine after
engine, a new one when the environment changes (the last two kept), and a killed worker ends
the engine naming it, as with workers started as fresh interpreters. A function forked with
:meth:`~mrv2.executor.zygote.Zygote.fork_call` (the server's engine process) gets its
arguments, the caller's file descriptors, stdout, stderr, working directory and ``sys.path``,
and reports its exit as a spawned ``multiprocessing`` child would."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

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
        second = zygote.worker_zygote()
        assert _parent_of(worker) == second.proc.pid != first.proc.pid
        assert _tokens(llm) == want
    monkeypatch.delenv("MRV2_TEST_ZYGOTE_MARK")  # back: the first one, kept
    assert zygote.worker_zygote() is first and first.alive
    monkeypatch.setenv("MRV2_TEST_ZYGOTE_MARK", "2")  # a third: the least recent one leaves
    third = zygote.worker_zygote()
    assert third not in (first, second) and first.alive
    assert second.proc.wait(10) == 0 and not second.alive
    third.proc.kill()  # (unused: not left importing; the next call drops it)


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


def _forked_target(fds: list[int], message: str, code: int) -> None:
    """What :meth:`~mrv2.executor.zygote.Zygote.fork_call` runs in the child (a top-level
    function: pickled by name)."""
    reply_fd, request_fd = fds
    with os.fdopen(request_fd, "rb") as requests, os.fdopen(reply_fd, "wb") as replies:
        asked = requests.read()
        pickle.dump({"message": message, "asked": asked, "cwd": os.getcwd(),
                     "parent": os.getppid(), "path": sys.path,
                     "authkey": bytes(multiprocessing.current_process().authkey)}, replies)
    print(f"forked child says {message}", flush=True)
    os.write(2, b"forked child on stderr\n")
    if code:
        raise RuntimeError(f"forked child fails with {message}")


def test_a_forked_call_gets_its_arguments_and_descriptors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A top-level function forked with two pipe ends: its pickled arguments, the pipes (one
    read, one written), the caller's working directory, ``sys.path`` (this test module is
    found by it), ``multiprocessing`` key, stdout and stderr; exit code 0, or 1 with the
    traceback when it raises."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    z = zygote.worker_zygote()
    for code in (0, 1):
        reply_read, reply_write = os.pipe()
        request_read, request_write = os.pipe()
        try:
            process = z.fork_call(_forked_target, (f"hello {code}", code),
                                  [reply_write, request_read])
        finally:
            os.close(reply_write)
            os.close(request_read)
        with os.fdopen(request_write, "wb") as requests:
            requests.write(b"x" * 200_000)  # (more than a pipe holds)
        with os.fdopen(reply_read, "rb") as replies:
            got: dict[str, Any] = pickle.load(replies)
        process.join(30)
        assert not process.is_alive() and process.exitcode == code
        assert got["message"] == f"hello {code}" and got["asked"] == b"x" * 200_000
        assert got["cwd"] == str(tmp_path) and got["parent"] == z.proc.pid
        assert got["path"] == sys.path  # (and the key a tensor's shared storage needs)
        assert got["authkey"] == bytes(multiprocessing.current_process().authkey)
        out, err = capfd.readouterr()
        assert f"forked child says hello {code}" in out and "forked child on stderr" in err
        assert ("RuntimeError: forked child fails with hello 1" in err) == (code == 1)


def test_a_killed_forked_call_reports_the_signal() -> None:
    """A forked call killed by a signal: its exit code is the negative signal, as a
    ``multiprocessing.Process``'s (the engine process's owner names it so)."""
    read_fd, write_fd = os.pipe()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        process = zygote.worker_zygote().fork_call(_forked_target, ("blocked", 0),
                                                   [null, read_fd])
    finally:
        os.close(read_fd)
        os.close(null)
    try:
        assert process.pid is not None and process.is_alive()  # (it waits on the pipe)
        process.join(0.2)
        assert process.is_alive() and process.exitcode is None
        process.kill()
        process.join(30)
        assert process.exitcode == -signal.SIGKILL and not process.is_alive()
    finally:
        os.close(write_fd)
