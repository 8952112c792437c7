"""The development routes of ``mrv2 serve`` (``MRV2_SERVER_DEV_MODE=1``, as vLLM's
``VLLM_SERVER_DEV_MODE``): engine operations run between steps on the engine's thread or
process (:mod:`mrv2.entrypoints.engine_calls`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from mrv2.entrypoints.engine_calls import EngineBusy
from mrv2.entrypoints.responses import APIError

__all__ = ["add_dev_routes"]


def add_dev_routes(app: Any, worker: Any,
                   json_object: Callable[[Any], Awaitable[dict[str, Any]]]) -> None:
    """The development routes (``MRV2_SERVER_DEV_MODE=1``; :mod:`mrv2.entrypoints.engine_calls`):
    ``POST /reset_prefix_cache`` and ``POST /update_weights_from_disk`` (``{"model_path":
    DIR}``), each run between steps; 409 while requests are in flight, 400 for a bad path."""

    async def run(op: str, arg: Any, param: str | None) -> None:
        try:
            await worker.call(op, arg)
        except EngineBusy as error:
            raise APIError(409, str(error), "conflict") from None
        except ValueError as error:
            raise APIError(400, str(error), param=param) from None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        await run("reset_prefix_cache", None, None)
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        path = (await json_object(request)).get("model_path")
        await run("update_weights_from_disk", path, "model_path")
        return {"success": True, "message": f"weights updated from {path}"}
