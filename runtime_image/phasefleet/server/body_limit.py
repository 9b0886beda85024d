"""BodyLimit: request bodies larger than the worker's --max-request-bytes get 413.

An ASGI middleware rather than FastAPI's own `max_body_size`, whose 413 is plain text: a body
whose Content-Length is over the limit is answered before it is read; one without (chunked) is
counted as it arrives, and the read that crosses the limit raises an HTTPException that the
worker's error handlers turn into the OpenAI error shape.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phasefleet.server.errors import too_large


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, too_large(self.max_bytes).message)
            return message

        await self.app(scope, counting_receive, send)
