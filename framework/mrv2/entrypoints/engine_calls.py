"""Engine operations the server runs between steps, on the engine's own thread or process
(``EngineThread.call``, ``EngineProcess.call``), for the development routes
(``MRV2_SERVER_DEV_MODE=1``, as vLLM's ``VLLM_SERVER_DEV_MODE``): ``POST /reset_prefix_cache``
(vLLM's), ``POST /update_weights_from_disk`` (SGLang's: an RL trainer's new checkpoint,
loaded in place; :meth:`~mrv2.engine.engine.LLMEngine.update_weights`), and sleep mode's
``POST /sleep``, ``POST /wake_up`` and ``GET /is_sleeping`` (vLLM's), a trainer's weights
over a process group (SGLang's ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), ``POST /collective_rpc`` (vLLM's) and SGLang's ``POST
/pause_generation`` / ``/continue_generation``. All but waking, pausing and asking need the
engine idle or paused; a busy one refuses with :class:`EngineBusy`."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["CALLS", "DEV_MODE_ENV", "EngineBusy", "call_reply", "dev_mode", "reply_result",
           "run_engine_call"]

#: ``1`` adds the development routes to ``mrv2 serve``.
DEV_MODE_ENV = "MRV2_SERVER_DEV_MODE"
#: The operations a worker runs.
CALLS = ("reset_prefix_cache", "update_weights_from_disk", "sleep", "wake_up", "is_sleeping",
         "init_weights_update_group", "update_weights_from_distributed",
         "destroy_weights_update_group", "collective_rpc", "pause_generation",
         "continue_generation", "is_paused", "is_draining")
#: The operations whose argument is the engine method's keyword arguments.
_KEYWORDS = ("init_weights_update_group", "update_weights_from_distributed",
             "destroy_weights_update_group", "collective_rpc")
#: The operations that run on a busy engine too.
_ANY_TIME = ("wake_up", "is_sleeping", "pause_generation", "continue_generation", "is_paused",
             "is_draining")
#: The prefix of a refusal's message that means "busy" (it crosses the process pipe as text).
BUSY = "busy: "


class EngineBusy(RuntimeError):
    """The engine has requests in flight: the operation was not run."""


def dev_mode() -> bool:
    """Whether ``MRV2_SERVER_DEV_MODE=1``."""
    return os.environ.get(DEV_MODE_ENV, "") == "1"


def run_engine_call(engine: Any, op: str, arg: Any) -> Any:
    """Run ``op`` on ``engine`` (on its thread) and return its result: ValueError for a bad
    ``op`` or argument, :class:`EngineBusy` while requests are in flight."""
    if op not in CALLS:
        raise ValueError(f"unknown engine call {op!r}: one of {list(CALLS)}")
    if op not in _ANY_TIME and engine.has_unfinished() and not engine.is_paused():
        raise EngineBusy(f"{op}: requests are in flight; retry when the engine is idle "
                         "(or POST /pause_generation first)")
    if op in ("is_sleeping", "is_paused", "is_draining", "continue_generation"):
        return getattr(engine, op)()
    if op == "pause_generation":
        return engine.pause_generation(arg)
    if op == "sleep":
        return engine.sleep(arg)
    if op == "wake_up":
        return engine.wake_up(arg)
    if op == "reset_prefix_cache":
        return engine.reset_prefix_cache()
    if op in _KEYWORDS:
        try:
            return getattr(engine, op)(**arg)
        except TypeError as error:  # (a field the method does not take, or one missing)
            raise ValueError(f"{op}: {error}") from None
    if not isinstance(arg, str) or not os.path.isdir(arg):
        raise ValueError(f"model_path must be a checkpoint directory, got {arg!r}")
    try:
        engine.update_weights_from_disk(arg)
    except (KeyError, FileNotFoundError) as error:
        raise ValueError(f"model_path: {error}") from None
    return None


def call_reply(engine: Any, op: str, arg: Any) -> tuple[str | None, Any]:
    """:func:`run_engine_call` as it crosses to the server: ``(None, result)``, or
    ``(refusal, None)`` (:func:`refusal`) when it raised."""
    try:
        return None, run_engine_call(engine, op, arg)
    except Exception as error:  # (the server's 400 / 409)
        return refusal(error), None


def reply_result(reply: tuple[str | None, Any]) -> Any:
    """A :func:`call_reply`'s result, or its refusal raised (:func:`raise_refusal`)."""
    refused, result = reply
    if refused is not None:
        raise_refusal(refused)
    return result


def refusal(error: BaseException) -> str:
    """A failed call's message as it crosses a pipe (busy ones marked)."""
    return (BUSY if isinstance(error, EngineBusy) else "") + str(error)


def raise_refusal(message: str) -> None:
    """The exception a refusal's message stands for."""
    if message.startswith(BUSY):
        raise EngineBusy(message[len(BUSY):])
    raise ValueError(message)
