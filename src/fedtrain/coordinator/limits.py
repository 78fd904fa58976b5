"""Request body size limits of the coordinator, enforced before a route reads a byte.

Control requests are small JSON documents: `BodyLimit` refuses any body over
`max_bytes` (default 1 MiB) with 413 in the one JSON error shape — at once when the
Content-Length says so, or as soon as a chunked body grows past it. Tensor uploads are
exempt here: the service refuses them by Content-Length against the run's
`max_upload_mb`, and its streaming reader never accepts more bytes than declared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from fedtrain.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_JSON_BYTES = 1 << 20
UPLOAD_PATH = re.compile(r"^/v1/rounds/[^/]+/updates/[^/]+$")


def _too_large(limit: int) -> str:
    return f"request body exceeds the limit of {limit:,} bytes for control requests"


class BodyLimit:
    """ASGI middleware: at most `max_bytes` of body on every request but tensor uploads."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_JSON_BYTES, exempt: re.Pattern[str] = UPLOAD_PATH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _answer_413(send, self.max_bytes)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the route's body read; FastAPI passes HTTPException through.
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer_413(send: Send, limit: int) -> None:
    body = json.dumps(error_body(413, "too_large", _too_large(limit))).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
