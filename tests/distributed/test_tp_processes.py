"""Tensor parallelism's processes on the CPU: a worker killed mid-run ends the engine with an
error naming its rank within seconds; ``mrv2 serve`` then answers 503 and exits non-zero;
``torchrun`` launches give rank 0's tokens; the shared-memory step ring carries messages in
order, larger than itself, to several readers; leaving the group drops the CUDA graphs first
and never hangs on a peer that does not leave."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.config import EngineConfig
from mrv2.distributed.channel import ChannelClosed, ShmRing
from mrv2.engine.engine import LLMEngine
from mrv2.executor.tensor_parallel import WorkerDiedError
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer, rank_and_args
from mrv2.testing_checkpoints import make_lora_adapter


@pytest.fixture(autouse=True)
def _fresh_interpreter_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the default launch (``python -m mrv2.executor.worker`` per rank):
    no zygote (``test_zygote.py`` has its own), unless a test asks for :func:`forked`."""
    monkeypatch.delenv("MRV2_WORKER_ZYGOTE", raising=False)


@pytest.fixture
def forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked from the zygote: for the tests of what the ranks compute, not of how
    their processes start and end (four engines' fresh interpreters cost ~25 s)."""
    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path)
    return path


def test_ring_messages_in_order_through_a_small_ring() -> None:
    ring = ShmRing(2, capacity=4096)
    readers = [ShmRing.attach(ring.name, 2, 4096, r) for r in range(2)]
    messages = [{"i": i, "blob": bytes(range(256)) * (i * 7)} for i in range(30)]  # to 53 KB
    got: list[list[object]] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].receive())

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        ring.publish(m)
    for t in threads:
        t.join(30)
    assert got == [messages, messages]
    ring.close()
    with pytest.raises(ChannelClosed):
        readers[0].receive()
    for reader in readers:
        reader.close()


def test_killed_worker_ends_the_engine_naming_it(model: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The step raises within seconds; the engine, idle after that, is not torn down by the
    last-resort exit (which is for a process stuck in a collective): this test's own process
    outlives the grace period."""
    monkeypatch.setenv("MRV2_TP_ABORT_S", "1")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), device="cpu",
                                                dtype="float32", tensor_parallel_size=2,
                                                max_model_len=256))
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        (pid,) = engine.runner.worker_pids  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1.*signal 9"):
            while time.monotonic() - start < 30:
                engine.step()
        assert time.monotonic() - start < 10
        time.sleep(1.5)  # past MRV2_TP_ABORT_S: still here
    finally:
        engine.shutdown()


def test_three_ranks_then_one_killed_the_others_leave_at_shutdown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks (a vocabulary of 256, not divisible by 3: the last rank's rows padded)
    give one rank's tokens. Then rank 1 is killed: shutdown tells rank 2, idle and waiting
    for a step, to leave (the ring closed), rather than kill it after waiting 10 s. (Rank 2
    idle for sure: CI saw it exit 1 from inside the last step's logits gather, rank 1 killed
    while rank 2 still waited for its part.)"""
    monkeypatch.setenv("MRV2_TP_ABORT_S", "1")
    model = make_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", num_attention_heads=6,
                                 num_key_value_heads=3, head_dim=16, intermediate_size=192,
                                 std=0.15)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=64) as llm:
        want = llm.generate({"prompt_token_ids": [5, 6, 7]}, params,
                            use_tqdm=False)[0].outputs[0].token_ids
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), device="cpu",
                                                dtype="float32", tensor_parallel_size=3,
                                                max_model_len=64))
    runner = engine.runner
    try:
        engine.add_request([5, 6, 7], params)
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                got = list(out.outputs[0].token_ids)
        assert got == want
        # Every rank past the steps' collectives before rank 1 dies: ranks leave a collective
        # at different times (rank 2 may still wait for rank 1's part of the logits' gather
        # after rank 0 has its own), and a rank killed inside one fails the others, rightly.
        # An RPC answered by every rank comes after all of them on the FIFO step channel.
        ranks = runner.collective_rpc(rank_and_args)  # type: ignore[attr-defined]
        assert ranks == [(0, ()), (1, ()), (2, ())]
        first, second = runner.worker_pids  # type: ignore[attr-defined]
        os.kill(first, signal.SIGKILL)
        start = time.monotonic()  # (noticed while idle: rank 2 is in no collective)
        while runner._failure is None and time.monotonic() - start < 10:  # type: ignore[attr-defined]
            time.sleep(0.05)
        engine.add_request([5, 6, 7], params)
        with pytest.raises(WorkerDiedError, match="rank 1"):
            engine.step()
        start = time.monotonic()
    finally:
        engine.shutdown()
    assert time.monotonic() - start < 8
    codes = [w.proc.returncode for w in runner._workers]  # type: ignore[attr-defined]
    assert codes == [-signal.SIGKILL, 0]


def test_an_engine_built_in_a_thread_that_ended_keeps_its_workers(model: Path) -> None:
    """Linux's parent-death signal follows the thread that started a process: workers
    started by the thread that built the engine were killed (SIGTERM) once it ended. They
    serve on, and leave at shutdown with exit code 0."""
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(LLM(
        str(model), device="cpu", dtype="float32", max_model_len=64, tensor_parallel_size=2)))
    thread.start()
    thread.join()
    (llm,) = built
    workers = llm.engine.runner._workers  # type: ignore[attr-defined]
    try:
        time.sleep(0.5)
        assert [w.proc.poll() for w in workers] == [None]
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert [w.proc.returncode for w in workers] == [0]


@pytest.mark.usefixtures("forked")
def test_workers_take_rank0s_lora_adapter_not_its_files(model: Path, tmp_path: Path) -> None:
    """Rank 0 reads and checks an adapter when its request comes in; the workers used to
    read the files themselves at its first step: removed since (or rewritten), the worker
    failed and the engine with it (or ran other weights than rank 0's). Rank 0 sends them
    what it read."""
    adapter = make_lora_adapter(model, tmp_path / "adapter", rank=4)
    lora = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=64,
             enable_lora=True) as llm:
        want = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False,
                            lora_request=lora)[0].outputs[0].token_ids
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model), device="cpu",
                                                dtype="float32", tensor_parallel_size=2,
                                                max_model_len=64, enable_lora=True))
    try:
        engine.add_request([5, 6, 7], params, lora_request=lora)
        shutil.rmtree(adapter)
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                got = list(out.outputs[0].token_ids)
        assert got == want
    finally:
        engine.shutdown()


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_serve_answers_503_then_exits_nonzero_when_a_worker_dies(model: Path, mode: str) -> None:
    """Rank 1 killed: 503, then exit 1 naming the rank; with the engine in a process of its
    own (the default: rank 0 is that child, the worker its child) and on a thread."""
    port = 18000 + os.getpid() % 1000 + (mode == "--engine-process")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mrv2.entrypoints.cli", "serve", str(model), "--device", "cpu",
         "--dtype", "float32", "--tensor-parallel-size", "2", "--port", str(port),
         "--max-model-len", "256", mode], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        workers = [c for c in _descendants(proc.pid)
                   if b"mrv2.executor.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        statuses = []
        while proc.poll() is None and len(statuses) < 100:
            try:
                statuses.append(_get(f"http://127.0.0.1:{port}/health"))
            except OSError:
                break
            time.sleep(0.05)
        code = proc.wait(30)
        stderr = proc.stderr.read() if proc.stderr else ""
        assert code != 0
        assert "rank 1" in stderr
        assert 503 in statuses
    finally:
        if proc.poll() is None:
            proc.kill()


def test_torchrun_ranks_give_rank0_the_same_tokens(model: Path, tmp_path: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(model), device="cpu", dtype="float32", max_model_len=256) as llm:
        expected = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params,
                                use_tqdm=False)[0].outputs[0].token_ids
    script = (
        "import json, sys\n"
        "from mrv2 import LLM, SamplingParams\n"
        f"llm = LLM({str(model)!r}, device='cpu', dtype='float32', max_model_len=256, "
        "tensor_parallel_size=2)\n"
        "out = llm.generate({'prompt_token_ids': [5, 6, 7, 8]}, SamplingParams("
        "temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', json.dumps(out[0].outputs[0].token_ids))\n"
        "llm.shutdown()\n"
    )
    (tmp_path / "run.py").write_text(script)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(19000 + os.getpid() % 1000), str(tmp_path / "run.py")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("TOKENS")]
    assert len(lines) == 1  # rank 0 only: the other rank served as a worker and exited
    assert json.loads(lines[0].split(" ", 1)[1]) == expected


def test_leaving_a_stuck_nccl_group_aborts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's finalize waits for every peer: if one never gets there, leaving aborts the
    communicators after the timeout instead of hanging."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from mrv2.distributed import parallel_state

    released = threading.Event()
    aborted: list[bool] = []
    monkeypatch.setattr(parallel_state, "_GROUP",
                        parallel_state.TensorParallelGroup(0, 2, backend="nccl"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: released.wait(30))
    monkeypatch.setattr(distributed_c10d, "_abort_process_group",
                        lambda: (aborted.append(True), released.set()))
    start = time.monotonic()
    parallel_state.destroy_tensor_parallel(timeout_s=0.2)
    assert aborted == [True] and time.monotonic() - start < 5
    assert parallel_state.tp_size() == 1 and parallel_state.tp_group().backend == "gloo"


def test_shutdown_drops_the_graphs_before_leaving_the_group(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live graph holding captured collectives keeps NCCL's finalize waiting (it hung on the
    H200 before): rank 0 drops its graphs, then leaves together with the workers."""
    import mrv2.executor.tensor_parallel as tp_module
    from mrv2.runner.cuda_graphs import StepGraphs

    llm = LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=2)
    runner = llm.engine.runner
    runner.graphs = runner.builder.graphs = StepGraphs([1], [1], 8)  # a stand-in capture
    seen: list[tuple[object, object]] = []
    leave = tp_module.destroy_tensor_parallel

    def record(timeout_s: float = 20.0) -> None:
        builder = vars(runner).get("builder")  # (dropped with the rest of the device state)
        seen.append((runner.graphs, builder.graphs if builder is not None else None))
        leave(timeout_s)

    monkeypatch.setattr(tp_module, "destroy_tensor_parallel", record)
    start = time.monotonic()
    llm.shutdown()
    assert seen == [(None, None)]
    assert all(worker.proc.returncode == 0 for worker in runner._workers)
    assert time.monotonic() - start < 10  # the workers left with rank 0, none was killed


@pytest.mark.usefixtures("forked")
def test_structured_outputs_under_tensor_parallelism(model: Path) -> None:
    """Every rank masks with rank 0's bitmasks, filled during the forward (async scheduling:
    the step goes out as "execute_late" and the masks follow) or with the step (the request
    waiting for its token: ``late_token_masks`` off): two ranks give the constrained samples
    one rank gives, either way, and they match; with n-gram speculation too (a mask a logits
    row, over the drafts rank 0 copied back)."""
    from mrv2 import StructuredOutputsParams

    params = SamplingParams(temperature=0.9, seed=5, max_tokens=20, n=2,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]"))
    prompts = ["Hello world", "Paris"]

    def run(size: int, late: bool = True, spec: bool = False) -> list[list[str]]:
        extra: dict[str, object] = {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}} if spec else {}
        llm = LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=size,
                  **extra)
        try:
            assert llm.engine.scheduler.late_token_masks
            llm.engine.scheduler.late_token_masks = late
            return [[c.text for c in o.outputs] for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
        finally:
            llm.shutdown()

    one, two = run(1), run(2)
    assert two == one
    assert run(2, late=False) == one
    assert run(2, spec=True) == one and run(2, late=False, spec=True) == one
    assert all(len(t) == 5 and t[:3].isdigit() and t[3] == "-" for ts in two for t in ts), two


@pytest.mark.usefixtures("forked")
def test_every_rank_loads_new_weights_and_sleeps(model: Path, tmp_path: Path) -> None:
    """RL under tensor parallelism: ``update_weights`` sends each whole tensor to every rank
    (its name on the step channel, its bytes by broadcast) and each loads its part, so two
    ranks then answer as one rank on the new checkpoint; a name the model lacks is refused on
    every rank and the engine goes on. Every rank sleeps and wakes, at level 2 too (its
    weights loaded again from the checkpoint)."""
    from mrv2.model_loader.loader import iter_safetensors

    other = make_tiny_checkpoint(tmp_path / "other", "Qwen3ForCausalLM", vocab_size=320,
                                 seed=9)
    make_tiny_tokenizer(other)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(["Hello world", "Paris is"], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    with LLM(str(other), device="cpu", dtype="float32") as one:
        want = tokens(one)
    llm = LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=2)
    try:
        before = tokens(llm)
        assert before != want
        loaded = llm.update_weights(iter_safetensors(str(other)))
        assert "model.embed_tokens.weight" in loaded
        assert tokens(llm) == want
        with pytest.raises(ValueError):
            llm.update_weights([("model.no_such.weight", torch.zeros(3))])
        assert tokens(llm) == want  # (every rank refused it and stayed in step)
        llm.sleep()
        llm.wake_up(["weights"])
        llm.wake_up(["kv_cache"])
        assert tokens(llm) == want
        llm.sleep(level=2)
        llm.wake_up()
        llm.reload_weights()  # the served checkpoint's own weights, on every rank
        assert tokens(llm) == before
    finally:
        llm.shutdown()
