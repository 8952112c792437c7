"""OpenAI's error JSON, and a pydantic validation error as its 400 body (the field a
``SamplingParams`` error is about: :func:`mrv2.entrypoints.openai_protocol.value_error_param`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error",
                    "server_error", "service_unavailable"]


def error_body(message: str, type_: str, param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error_body(error: ValidationError) -> dict[str, Any]:
    """A pydantic error as OpenAI's 400 body, naming the first bad field."""
    items = error.errors()
    lines, param = [], None
    for item in items:
        where = ".".join(str(part) for part in item["loc"])
        param = param or (str(item["loc"][0]) if item["loc"] else None)
        lines.append(f"{where}: {item['msg']} (got {item.get('input')!r})")
    return error_body("; ".join(lines), "invalid_request_error", param, 400)
