"""Reading an OpenAI request off the wire: a bounded body, parsed and validated into its model,
every failure a 4xx naming what is wrong; and the wait for a client's disconnect."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from serve_app.ingress.errors import OpenAIError

RequestT = TypeVar("RequestT", bound=BaseModel)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request body parsed as JSON, refusing more than ``max_bytes`` before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise OpenAIError(413, f"request body is larger than {max_bytes} bytes")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise OpenAIError(413, f"request body is larger than {max_bytes} bytes")
        parts.append(part)
    raw = b"".join(parts)
    if not raw:
        raise OpenAIError(400, "the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise OpenAIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # e.g. thousands of nested `[`
        raise OpenAIError(400, "the request body is nested too deeply") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise OpenAIError(400, f"the request body has a value out of range: {err}") from None


def parse_request(model_cls: type[RequestT], data: Any) -> RequestT:
    """Validate ``data`` into ``model_cls`` or raise a 400 that names the first bad field."""
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        # `param` is the top-level field, as OpenAI reports it; nested locations stay in the text.
        param = str(first["loc"][0]) if first["loc"] else None
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            msg = "this field is required"
        elif len([e for e in errors if e["loc"][:1] == first["loc"][:1]]) > 1:
            msg = "has the wrong type or shape; see the OpenAI API reference for this field"
        raise OpenAIError(400, f"{param}: {msg}" if param else msg, param=param) from None


async def disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the client disconnects. Call it once the body has been read: the next ASGI
    message can then only be ``http.disconnect``, so this does not poll."""
    while (await receive())["type"] != "http.disconnect":
        # Only a server that answers receive() with empty body messages gets here; don't spin.
        await asyncio.sleep(0.05)
