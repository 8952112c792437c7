"""The development routes of ``mrv2 serve`` (``MRV2_SERVER_DEV_MODE=1``, as vLLM's
``VLLM_SERVER_DEV_MODE``): engine operations run between steps on the engine's thread or
process (:mod:`mrv2.entrypoints.engine_calls`): the prefix cache, weights loaded in place
(from disk, or broadcast by a trainer's process group), sleep mode, and ``collective_rpc``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.encoders import jsonable_encoder

from mrv2.entrypoints.engine_calls import EngineBusy
from mrv2.entrypoints.engine_thread import QueueFullError
from mrv2.entrypoints.responses import APIError

__all__ = ["add_dev_routes"]


def add_dev_routes(app: Any, worker: Any,
                   json_object: Callable[[Any], Awaitable[dict[str, Any]]]) -> None:
    """The development routes (``MRV2_SERVER_DEV_MODE=1``; :mod:`mrv2.entrypoints.engine_calls`):
    ``POST /reset_prefix_cache`` and ``POST /update_weights_from_disk`` (``{"model_path":
    DIR}``), each run between steps; 409 while requests are in flight, 400 for a bad path.
    Sleep mode as vLLM's routes: ``POST /sleep?level=1`` (409 while busy), ``POST
    /wake_up`` (``?tags=weights&tags=kv_cache``; none: all) and ``GET /is_sleeping``
    (``{"is_sleeping": bool}``); while the engine sleeps, new requests get 503. A trainer's
    weights as SGLang's routes: ``POST /init_weights_update_group`` (``master_address``,
    ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``), ``POST
    /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``, ``group_name``),
    ``POST /destroy_weights_update_group``; and vLLM's ``POST /collective_rpc``
    (``{"method": NAME, "args": [...], "kwargs": {...}}``: a runner method by name;
    ``{"results": [...]}``, one per rank). SGLang's ``POST /pause_generation``
    (``{"mode": "keep" | "recompute" | "abort" | "wait"}``, or its ``in_place`` /
    ``retract``) and ``POST /continue_generation``, vLLM's ``POST /pause``
    (``?wait_for_inflight_requests=&clear_cache=``; 409 if a resume comes before the
    requests in flight end) and ``POST /resume``, and ``GET
    /is_paused``: while paused, requests wait and the routes above run with them in
    flight."""

    async def run(op: str, arg: Any, param: str | None) -> Any:
        try:
            return await worker.call(op, arg)
        except EngineBusy as error:
            raise APIError(409, str(error), "conflict") from None
        except QueueFullError as error:  # the engine failed, or the server stops
            raise APIError(503, str(error), "service_unavailable") from None
        except ValueError as error:
            raise APIError(400, str(error), param=param) from None

    discarded = False  # weights discarded by /sleep?level=2, not loaded since

    async def mark() -> None:
        """Why new requests get 503 now (the worker's ``unavailable``), from the engine."""
        if await run("is_sleeping", None, None):
            worker.unavailable = "the engine is asleep (POST /sleep): POST /wake_up first"
        elif discarded:
            worker.unavailable = ("the weights were discarded by POST /sleep?level=2: POST "
                                  "/update_weights_from_disk first")
        else:
            worker.unavailable = None

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        await run("reset_prefix_cache", None, None)
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        nonlocal discarded
        path = (await json_object(request)).get("model_path")
        await run("update_weights_from_disk", path, "model_path")
        discarded = False
        await mark()
        return {"success": True, "message": f"weights updated from {path}"}

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        nonlocal discarded
        text = request.query_params.get("level", "1")
        if text not in ("1", "2"):
            raise APIError(400, f"level must be one of [1, 2], got {text!r}", param="level")
        await run("sleep", int(text), "level")
        discarded = discarded or text == "2"
        await mark()
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        try:
            await run("wake_up", tags, "tags")
        finally:  # (a tag that had no room stays asleep)
            await mark()
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> dict[str, Any]:
        return {"is_sleeping": bool(await run("is_sleeping", None, None))}

    def fields(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        return {name: body[name] for name in names if name in body}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        await run("init_weights_update_group", fields(body, (
            "master_address", "master_port", "rank_offset", "world_size", "group_name",
            "backend")), None)
        return {"success": True, "message": "joined the weight update group"}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
        nonlocal discarded
        body = await json_object(request)  # (flush_cache: the prefix cache is always flushed)
        await run("update_weights_from_distributed",
                  fields(body, ("names", "dtypes", "shapes", "group_name")), None)
        discarded = False
        await mark()
        return {"success": True, "message": f"{len(body.get('names') or [])} tensors loaded"}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        left = await run("destroy_weights_update_group", fields(body, ("group_name",)), None)
        return {"success": bool(left), "message": "left the group" if left else "not joined"}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body = await json_object(request)
        method = body.get("method")
        if not isinstance(method, str):
            raise APIError(400, f"method must be the name of a runner method, got {method!r}",
                           param="method")
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise APIError(400, "args must be a list and kwargs an object", param="args")
        results = await run("collective_rpc", {"method": method, "args": tuple(args),
                                               "kwargs": kwargs}, "method")
        return {"results": jsonable_encoder(results)}

    #: SGLang's pause modes, by their names there.
    sglang_modes = {"in_place": "keep", "retract": "recompute"}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        mode = (await json_object(request)).get("mode", "keep")
        await run("pause_generation", sglang_modes.get(mode, mode), "mode")
        return {"success": True, "message": "paused"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, Any]:
        await run("continue_generation", None, None)
        return {"success": True, "message": "continued"}

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        """vLLM's: abort the requests in flight (``wait_for_inflight_requests=false``, the
        default) or let them finish first, then pause; ``clear_cache`` (default true)
        forgets the prefix cache."""
        flags = {}
        for name, default in (("wait_for_inflight_requests", "false"), ("clear_cache", "true")):
            text = request.query_params.get(name, default).lower()
            if text not in ("true", "false", "1", "0"):
                raise APIError(400, f"{name} must be true or false, got {text!r}", param=name)
            flags[name] = text in ("true", "1")
        wait = flags["wait_for_inflight_requests"]
        await run("pause_generation", "wait" if wait else "abort", None)
        while wait and not await run("is_paused", None, None):  # (the started requests end)
            if not await run("is_draining", None, None) and not await run("is_paused", None,
                                                                           None):
                raise APIError(409, "a resume (POST /resume or /continue_generation) came "
                               "before the requests in flight ended: the engine is not "
                               "paused", "conflict", param="wait_for_inflight_requests")
            await asyncio.sleep(0.02)
        if flags["clear_cache"]:
            await run("reset_prefix_cache", None, None)
        return Response(status_code=200)

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        await run("continue_generation", None, None)
        return Response(status_code=200)

    @app.get("/is_paused")
    async def is_paused(request: Request) -> dict[str, Any]:
        return {"is_paused": bool(await run("is_paused", None, None))}
