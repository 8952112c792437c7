"""Warm starts for tensor-parallel workers and the server's engine process (opt-in:
``MRV2_WORKER_ZYGOTE=1``).

A fresh ``python -m mrv2.executor.worker`` spends seconds importing (torch, transformers'
config machinery, the runner, the plugins) before it builds anything, and a process that builds
engine after engine (a sweep over configs, a test suite) pays that for every worker of every
engine. With the zygote, the first tensor-parallel engine of a process starts one helper,
``python -m mrv2.executor.zygote``, that imports all that once and then forks each worker from
itself: the same program (:func:`mrv2.executor.worker.main`, its spec on stdin, its error pipe)
started in milliseconds. :meth:`Zygote.fork_call` forks any top-level function the same way
(the server's engine process: :class:`~mrv2.entrypoints.engine_process.EngineProcess`), with
pickled arguments, the caller's ``sys.path``, ``multiprocessing`` key, stdout and stderr, and
file descriptors of the caller's (its pipes' ends) passed over the socket.

The zygote stays single-threaded and never initializes CUDA (it checks after its imports:
a process forked after that could not use the GPU), so its forks are safe. It exits when its
parent does (``PR_SET_PDEATHSIG``) or closes its socket, and its workers exit with it (theirs).
It reports each worker's pid and exit status over a Unix socket; :class:`ForkedWorker` turns
them into a ``subprocess.Popen``-like handle, so rank 0's watchdog and shutdown treat both
kinds of worker alike (its ``is_alive`` / ``exitcode`` / ``join`` are a
``multiprocessing.Process``'s, for the engine process). A zygote forks only for the
environment it was started with (a child must see the variables a fresh interpreter would):
another ``os.environ`` gets another zygote, and the process keeps the last two.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import IO, Any

#: Variables that change under a running process without meaning a new environment.
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})
#: Seconds a fork request may wait for the zygote (its imports first, on its first request).
FORK_TIMEOUT_S = 300.0
#: The most file descriptors one fork request passes (the payload pipe, stdout, stderr, the
#: caller's).
_MAX_FDS = 16


def zygote_enabled() -> bool:
    """Whether workers are forked from a zygote (``MRV2_WORKER_ZYGOTE=1``)."""
    return os.environ.get("MRV2_WORKER_ZYGOTE", "0") == "1"


#: Modules a zygote imports beside the worker's, named by the higher layers that fork their
#: own processes from it (:func:`preload`; the server's engine process), so this module
#: imports nothing above the executor.
_PRELOADS: list[str] = []


def preload(module: str) -> None:
    """Have zygotes started from now on import ``module`` too (a top-level target's module,
    given by the layer that forks it with :meth:`Zygote.fork_call`); a zygote started before
    gets a successor with it at the next :func:`worker_zygote`."""
    if module not in _PRELOADS:
        _PRELOADS.append(module)


def _environment() -> dict[str, str]:
    """What a zygote is keyed by: ``os.environ`` less the volatile variables, and what it
    preloads."""
    env = {k: v for k, v in os.environ.items() if k not in _VOLATILE}
    env[" preloads"] = ",".join(_PRELOADS)  # (a key no variable can have)
    return env


class ForkedWorker:
    """A process forked by the zygote, with the part of ``subprocess.Popen``'s interface rank 0
    uses (``pid``, ``stdin``: a worker's spec pipe, ``returncode``, ``poll``, ``wait``,
    ``kill``) and of ``multiprocessing.Process``'s the engine process's owner uses
    (``is_alive``, ``exitcode``, ``join``)."""

    def __init__(self, pid: int, stdin: IO[bytes] | None) -> None:
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

    def is_alive(self) -> bool:
        """Whether it runs (its exit not yet reported)."""
        return self.returncode is None

    @property
    def exitcode(self) -> int | None:
        """As :attr:`returncode` (``multiprocessing.Process``'s name)."""
        return self.returncode

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for it to exit (no error if it has not)."""
        self._done.wait(timeout)


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
                                     str(sock.fileno()), ",".join(_PRELOADS)],
                                    stdin=subprocess.DEVNULL, pass_fds=(sock.fileno(),))
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
            pid = self._request("worker", [read_fd, error_fd], ())
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return self._register(ForkedWorker(pid, os.fdopen(write_fd, "wb")))

    def fork_call(self, target: Callable[..., Any], args: tuple[Any, ...] = (),
                  fds: Sequence[int] = ()) -> ForkedWorker:
        """A new process that runs ``target(child_fds, *args)`` and exits (0 when it returns;
        1, its traceback on stderr, when it raises), as a ``multiprocessing`` "spawn" child
        would: ``target`` a module's top-level function, ``args`` pickled, this process's
        working directory, ``sys.path``, ``multiprocessing`` authentication key (a tensor sent
        over a ``multiprocessing`` pipe shares its storage with it), stdout and stderr.
        ``child_fds``: the child's copies of ``fds`` (the caller keeps and closes its own)."""
        caller = (list(sys.path), bytes(multiprocessing.current_process().authkey))
        payload = pickle.dumps(caller) + pickle.dumps((target, args))
        std = tuple(fd for fd in (1, 2) if _is_open(fd))
        read_fd, write_fd = os.pipe()
        try:
            pid = self._request("call", [read_fd, *std, *fds], std)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        process = self._register(ForkedWorker(pid, None))
        with contextlib.suppress(BrokenPipeError), open(write_fd, "wb") as pipe:
            pipe.write(payload)  # (it reads it all first: a dead child is its exit code)
        return process

    def _request(self, kind: str, fds: list[int], std: tuple[int, ...]) -> int:
        """Ask the zygote to fork a ``kind`` child with copies of ``fds`` (``std``: which of
        stdout and stderr follow the first): its pid."""
        if len(fds) > _MAX_FDS:
            raise ValueError(f"at most {_MAX_FDS - 3} file descriptors pass to a forked call")
        with self._fork_lock:
            if not self.alive:
                raise RuntimeError("the worker zygote has exited")
            socket.send_fds(self._sock, [pickle.dumps((kind, os.getcwd(), std))], fds)
            try:
                pid = self._pids.get(timeout=FORK_TIMEOUT_S)
            except queue.Empty:  # (a late reply would answer the next request: retire)
                self.alive = False
                raise RuntimeError(f"the worker zygote started no process within "
                                   f"{FORK_TIMEOUT_S:.0f} s") from None
        if pid is None:
            raise RuntimeError("the worker zygote exited before starting the process")
        return pid

    def _register(self, process: ForkedWorker) -> ForkedWorker:
        with self._state:
            code = self._early.pop(process.pid, None)
            if code is None:
                self._workers[process.pid] = process
        if code is not None:
            process._exited(code)
        return process

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


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


#: How many zygotes (each of another environment) a process keeps: a test suite that sets a
#: variable for one test and goes back finds the earlier one still there.
KEEP_ZYGOTES = 2
_zygotes: list[Zygote] = []  # (the least recently used first)
_zygote_lock = threading.Lock()


def worker_zygote() -> Zygote:
    """This process's zygote for ``os.environ`` as it is now: started on first use, and
    again when it has exited; a new environment gets a new one, and the least recently used
    beyond :data:`KEEP_ZYGOTES` leaves (once its last child has exited)."""
    environment = _environment()
    with _zygote_lock:
        for dead in [z for z in _zygotes if not z.alive]:
            _zygotes.remove(dead)
            dead.retire()
        found = next((z for z in _zygotes if z.environment == environment), None)
        if found is not None:
            _zygotes.remove(found)
        _zygotes.append(found or Zygote())
        while len(_zygotes) > KEEP_ZYGOTES:
            _zygotes.pop(0).retire()
        return _zygotes[-1]


# -- the zygote process --------------------------------------------------------------------


def _preload(modules: list[str]) -> None:
    """What every worker imports before it builds its runner, then ``modules``
    (:func:`preload`'s)."""
    import importlib

    import transformers.modeling_rope_utils  # noqa: F401
    import transformers.models.auto.auto_factory  # noqa: F401 (torch._dynamo, sympy...)
    from transformers.models.auto import configuration_auto  # noqa: F401

    import mrv2.executor.worker  # noqa: F401 (torch, the runner)
    from mrv2.plugins import get_plugin_manager

    get_plugin_manager()
    for module in modules:
        importlib.import_module(module)


def _child(kind: str, fds: list[int], cwd: str, std: tuple[int, ...], zygote: int) -> int:
    """In the forked process: its parent-death signal (the zygote's exit ends it), Ctrl-C as a
    fresh interpreter takes it, then the worker or the call."""
    from mrv2.executor import worker

    worker._die_with_parent()
    if os.getppid() != zygote:  # (the zygote died before the line above)
        return 1
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    if kind == "call":
        return _call(fds, std)
    stdin_fd, error_fd = fds
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (a fresh reader of the new fd 0)
    try:
        return worker.main(["mrv2-zygote-worker", str(error_fd)])
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


def _call(fds: list[int], std: tuple[int, ...]) -> int:
    """A :meth:`Zygote.fork_call` child: the caller's stdout and stderr, its ``sys.path``,
    then its target; the exit handlers it registered run as at a fresh interpreter's exit
    (not the zygote's: they would act on the zygote's state, its temporary files...)."""
    atexit._clear()
    payload_fd, theirs = fds[0], fds[1 + len(std):]
    for fd, number in zip(fds[1:1 + len(std)], std, strict=True):
        os.dup2(fd, number)
        os.close(fd)
    code = 1
    try:
        with open(payload_fd, "rb") as pipe:
            payload = io.BytesIO(pipe.read())
        sys.path[:], authkey = pickle.load(payload)
        multiprocessing.current_process().authkey = authkey  # (tensors cross its pipes so)
        target, args = pickle.load(payload)
        target(theirs, *args)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 (reported as a spawned child's: traceback, exit 1)
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


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
    """``python -m mrv2.executor.zygote SOCKET_FD [MODULE,...]``: import (the worker's modules,
    then those named), then fork a process per request
    until the socket closes. Ctrl-C (which reaches the caller's process group) is ignored: the
    caller stops the zygote, and an engine process forked here stops when its server says."""
    sock = socket.socket(fileno=int(argv[1]))
    from mrv2.executor.worker import _die_with_parent

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _preload([m for m in (argv[2] if len(argv) > 2 else "").split(",") if m])
    import torch

    if torch.cuda.is_initialized():  # (a fork could not use the GPU)
        raise RuntimeError("the worker zygote initialized CUDA while importing")
    children: set[int] = set()
    zygote = os.getpid()
    try:
        while True:
            ready, _, _ = select.select([sock], [], [], 0.05)
            _report_exits(sock, children)
            if not ready:
                continue
            message, fds, _, _ = socket.recv_fds(sock, 65536, _MAX_FDS)
            if not message:
                break
            kind, cwd, std = pickle.loads(message)
            pid = os.fork()
            if pid == 0:
                sock.close()
                code = 1
                try:
                    code = _child(kind, list(fds), cwd, std, zygote)
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
