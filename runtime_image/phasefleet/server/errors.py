"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the worker answers with goes through `APIError`, including FastAPI's own request
validation errors (422 by default), which become 400s that name the offending field.
"""

from __future__ import annotations

import json
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# Seconds a client is told to wait (Retry-After) when the queue is full or the worker drains.
RETRY_AFTER_SECONDS = 1

# Union-member tags pydantic puts in an error's location; they are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answered to the client; `param` names the request field at fault."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


def queue_full(limit: int) -> APIError:
    return APIError(
        429,
        f"the worker's waiting queue is full ({limit} requests); retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def unavailable(message: str, code: str) -> APIError:
    return APIError(
        503,
        message,
        type="service_unavailable",
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def engine_failed(message: str) -> APIError:
    return APIError(500, message, type="internal_server_error", code="engine_error")


def request_failed(message: str) -> APIError:
    """This request alone failed inside the engine; its batch neighbours were not affected."""
    return APIError(500, message, type="internal_server_error", code="request_failed")


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (the worker's --max-request-bytes)",
        code="request_too_large",
    )


def param_of(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages.0.role"; union tags are dropped."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and _is_type_tag(p))]
    return ".".join(parts) or None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in _TYPE_TAGS or part.startswith("constrained-")


def _describe(error: dict[str, Any]) -> str:
    kind = error.get("type", "")
    param = param_of(tuple(error.get("loc", ())))
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "invalid JSON")
        return f"malformed JSON body: {detail}"
    if kind == "missing":
        return f"missing required field '{param}'" if param else "a JSON request body is required"
    got = json.dumps(error.get("input"), default=str)
    if len(got) > 80:
        got = got[:77] + "..."
    msg = str(error.get("msg", "invalid value"))
    return f"invalid value for '{param}': {msg}, got {got}" if param else f"{msg}, got {got}"


def validation_error(exc: RequestValidationError) -> APIError:
    # A union field fails once per member; the type mismatches ("should be a valid string") are
    # the least telling, so they go last.
    errors = sorted(exc.errors(), key=lambda e: str(e.get("type", "")).endswith("_type"))
    if not errors:
        return bad_request("invalid request", None)
    first = errors[0]
    param = None if first.get("type") == "json_invalid" else param_of(tuple(first["loc"]))
    messages = list(dict.fromkeys(_describe(e) for e in errors))
    return bad_request("; ".join(messages), param)


def install_error_handlers(app: FastAPI) -> None:
    # Each handler is registered for one exception class, hence the casts.
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return cast(APIError, exc).response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        return validation_error(cast(RequestValidationError, exc)).response()

    async def on_http_error(_: Request, error: Exception) -> JSONResponse:
        exc = cast(StarletteHTTPException, error)
        if exc.status_code == 413:  # raised by BodyLimit
            return APIError(413, str(exc.detail), code="request_too_large").response()
        error_type = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return APIError(
            exc.status_code, str(exc.detail), type=error_type, headers=dict(exc.headers or {})
        ).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
