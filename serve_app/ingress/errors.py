"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause ends here as a 4xx with a clear message; only faults of the
service itself are 5xx.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error answered to the client in the OpenAI shape."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 error_type: str | None = None) -> None:
        """``error_type`` overrides the type the status code implies (a spent budget is a 429
        of type ``insufficient_quota``, as OpenAI answers it)."""
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param, self.code,
                          self.error_type)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(status_code: int, message: str, param: str | None = None,
               code: str | None = None, error_type: str | None = None) -> dict[str, Any]:
    err_type = error_type or _TYPES.get(status_code, "server_error" if status_code >= 500 else
                                        "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI raises into the OpenAI error shape."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Our fault, whatever it is: an OpenAI-shaped 500 that tells the client nothing about
        # the internals; the cause goes to the log.
        logger.error("unhandled error serving %s %s", request.method, request.url.path,
                     exc_info=exc)
        return JSONResponse(error_body(500, "the server failed to handle this request; "
                                       "retry shortly"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such route; the API lives under /v1 (see GET /v1/models)"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
