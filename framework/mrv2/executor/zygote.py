"""Warm starts for tensor-parallel workers (opt-in: ``MRV2_WORKER_ZYGOTE=1``).

A fresh ``python -m mrv2.executor.worker`` spends seconds importing (torch, transformers'
config machinery, the runner, the plugins) before it builds anything, and a process that builds
engine after engine (a sweep over configs, a test suite) pays that for every worker of every
engine. With the zygote, the first tensor-parallel engine of a process starts one helper,
``python -m mrv2.executor.zygote``, that imports all that once and then forks each worker from
itself: the same program (:func:`mrv2.executor.worker.main`, its spec on stdin, its error pipe)
started in milliseconds.

The zygote stays single-threaded and never initializes CUDA (it checks after its imports:
a process forked after that could not use the GPU), so its forks are safe. It exits when its
parent does (``PR_SET_PDEATHSIG``) or closes its socket, and its workers exit with it (theirs).
It reports each worker's pid and exit status over a Unix socket; :class:`ForkedWorker` turns
them into a ``subprocess.Popen``-like handle, so rank 0's watchdog and shutdown treat both
kinds of worker alike. A zygote whose environment no longer matches ``os.environ`` is replaced
(a worker must see the variables a fresh interpreter would).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any

#: Variables that change under a running process without meaning a new environment.
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
#: Seconds a fork request may wait for the zygote (its imports first, on its first request).
FORK_TIMEOUT_S = 300.0


def zygote_enabled() -> bool:
    """Whether workers are forked from a zygote (``MRV2_WORKER_ZYGOTE=1``)."""
    return os.environ.get("MRV2_WORKER_ZYGOTE", "0") == "1"


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


class ForkedWorker:
    """A worker forked by the zygote, with the part of ``subprocess.Popen``'s interface rank 0
    uses: ``pid``, ``stdin`` (the spec pipe), ``returncode``, ``poll``, ``wait``, ``kill``."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"mrv2 worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL it (nothing if it has exited)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """Rank 0's handle on a zygote process: :meth:`fork` starts a worker. See the module
    docstring; :func:`worker_zygote` gives the process's current one."""

    def __init__(self) -> None:
        self.environment = _environment()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started: queue.Queue[Any] = queue.Queue()
        # started from a thread that lives as long as the zygote: Linux sends the zygote's
        # parent-death signal when the *thread* that started it ends
        threading.Thread(target=self._run, args=(theirs, started), daemon=True,
                         name="mrv2-zygote").start()
        proc = started.get()
        theirs.close()
        if isinstance(proc, BaseException):
            mine.close()
            raise proc
        self.proc: subprocess.Popen[bytes] = proc
        self._sock = mine
        self._fork_lock = threading.Lock()  # one fork request (and its pid reply) at a time
        self._state = threading.Lock()
        self._pids: queue.Queue[int | None] = queue.Queue()
        self._workers: dict[int, ForkedWorker] = {}
        self._early: dict[int, int] = {}  # exits read before their worker was registered
        self._retired = False  # replaced: leaves once its last worker has exited
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="mrv2-zygote-read").start()

    @staticmethod
    def _run(sock: socket.socket, started: queue.Queue[Any]) -> None:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "mrv2.executor.zygote",
                                     str(sock.fileno())], stdin=subprocess.DEVNULL,
                                    pass_fds=(sock.fileno(),))
        except BaseException as error:
            started.put(error)
            return
        started.put(proc)
        proc.wait()

    def _read(self) -> None:
        """Pids and exit codes from the zygote, until it goes away; then every worker it
        leaves is dead too (their parent-death signal)."""
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                break
            kind, pid, code = pickle.loads(data)
            if kind == "pid":
                self._pids.put(pid)
                continue
            with self._state:
                worker = self._workers.pop(pid, None)
                if worker is None:
                    self._early[pid] = code
                done = self._retired and not self._workers
            if worker is not None:
                worker._exited(code)
            if done:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        self.alive = False
        self._pids.put(None)
        with self._state:
            left, self._workers = list(self._workers.values()), {}
        for worker in left:
            worker._exited(-signal.SIGTERM)

    def fork(self, error_fd: int) -> ForkedWorker:
        """A new worker (``mrv2.executor.worker``'s ``main``) whose error pipe is
        ``error_fd`` (a copy is passed; the caller keeps and closes its own) and whose stdin
        is the returned handle's ``stdin``; working directory: this process's."""
        read_fd, write_fd = os.pipe()
        try:
            with self._fork_lock:
                if not self.alive:
                    raise RuntimeError("the worker zygote has exited")
                socket.send_fds(self._sock, [pickle.dumps(("fork", os.getcwd()))],
                                [read_fd, error_fd])
                try:
                    pid = self._pids.get(timeout=FORK_TIMEOUT_S)
                except queue.Empty:  # (a late reply would answer the next request: retire)
                    self.alive = False
                    raise RuntimeError(f"the worker zygote started no worker within "
                                       f"{FORK_TIMEOUT_S:.0f} s") from None
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        if pid is None:
            os.close(write_fd)
            raise RuntimeError("the worker zygote exited before starting the worker")
        worker = ForkedWorker(pid, os.fdopen(write_fd, "wb"))
        with self._state:
            code = self._early.pop(pid, None)
            if code is None:
                self._workers[pid] = worker
        if code is not None:
            worker._exited(code)
        return worker

    def retire(self) -> None:
        """Stop the zygote once its last worker has exited (now, if it has none): an engine
        still running keeps its workers."""
        with self._state:
            self._retired = True
            idle = not self._workers
        if idle:
            self.close()

    def close(self) -> None:
        """Stop the zygote (its workers with it) and wait for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)
        self._sock.close()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def worker_zygote() -> Zygote:
    """This process's zygote, started on first use and replaced when it has exited or
    ``os.environ`` differs from the environment it was started with."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None and (not _zygote.alive
                                    or _zygote.environment != _environment()):
            _zygote.retire()
            _zygote = None
        if _zygote is None:
            _zygote = Zygote()
        return _zygote


# -- the zygote process --------------------------------------------------------------------


def _preload() -> None:
    """What every worker imports before it builds its runner."""
    import transformers.modeling_rope_utils  # noqa: F401
    import transformers.models.auto.auto_factory  # noqa: F401 (torch._dynamo, sympy...)
    from transformers.models.auto import configuration_auto  # noqa: F401

    import mrv2.executor.worker  # noqa: F401 (torch, the runner)
    from mrv2.plugins import get_plugin_manager

    get_plugin_manager()


def _child(fds: list[int], cwd: str) -> int:
    """In the forked worker: stdin from the spec pipe, then the worker's ``main``."""
    from mrv2.executor import worker

    stdin_fd, error_fd = fds
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (a fresh reader of the new fd 0)
    os.chdir(cwd)
    try:
        return worker.main(["mrv2-zygote-worker", str(error_fd)])
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


def _report_exits(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if done:
            children.discard(pid)
            sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))


def main(argv: list[str]) -> int:
    """``python -m mrv2.executor.zygote SOCKET_FD``: import, then fork a worker per request
    until the socket closes."""
    sock = socket.socket(fileno=int(argv[1]))
    from mrv2.executor.worker import _die_with_parent

    _die_with_parent()
    _preload()
    import torch

    if torch.cuda.is_initialized():  # (a fork could not use the GPU)
        raise RuntimeError("the worker zygote initialized CUDA while importing")
    children: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([sock], [], [], 0.05)
            _report_exits(sock, children)
            if not ready:
                continue
            message, fds, _, _ = socket.recv_fds(sock, 65536, 2)
            if not message:
                break
            _, cwd = pickle.loads(message)
            pid = os.fork()
            if pid == 0:
                sock.close()
                code = 1
                try:
                    code = _child(list(fds), cwd)
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            sock.send(pickle.dumps(("pid", pid, 0)))
    except OSError:
        pass  # the parent went away
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
