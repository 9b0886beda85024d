"""API keys for the OpenAI surface of a worker and of the router (vLLM's `--api-key`).

With keys in $PHASEFLEET_API_KEY (comma-separated, so a new key can be added before the old one
is dropped) or in the file $PHASEFLEET_API_KEY_FILE names (comma- or line-separated; re-read
when it changes, at most once a second: a mounted Secret the kubelet updates rotates the keys
without a restart), every request needs `Authorization: Bearer <one of them>`, OpenAI's header;
without it, 401 in OpenAI's shape (code `invalid_api_key`). Open to all: the probes, /metrics (the
autoscaler and Prometheus), /version, the API description, and /internal/* (the hand-off, which
checks its own token). A key is never logged nor echoed.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from phasefleet.api.contract import (
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    HEALTH_PATH,
    LIVENESS_PATH,
    METRICS_PATH,
)
from phasefleet.server.api_keys import ApiKeys
from phasefleet.server.errors import APIError

OPEN_PATHS = frozenset(
    {HEALTH_PATH, LIVENESS_PATH, METRICS_PATH, "/version", "/openapi.json", "/docs", "/redoc"}
)
OPEN_PREFIXES = ("/internal/",)


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme in any case)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class ApiKeyAuth:
    """ASGI middleware: requests outside the open paths need one of `keys`."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        if not keys:
            raise ValueError("ApiKeyAuth needs at least one key")
        self.app = app
        self.keys = keys

    def refusal(self, headers: Headers) -> APIError | None:
        given = bearer(headers.get("authorization"))
        if given is None:
            return unauthorized(
                f"missing API key: send it as 'Authorization: Bearer <key>' (the keys are in"
                f" ${API_KEY_ENV} or ${API_KEY_FILE_ENV})"
            )
        # every key compared in full: the time taken says nothing about which one was close
        matches = [hmac.compare_digest(given.encode(), key.encode()) for key in self.keys.current()]
        if not any(matches):
            return unauthorized("incorrect API key provided")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_open(scope["path"]):
            refused = self.refusal(Headers(scope=scope))
            if refused is not None:
                await refused.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
