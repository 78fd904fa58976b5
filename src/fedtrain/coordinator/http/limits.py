"""What one client can hold of the coordinator: body sizes, uploads in flight, connections.

More: docs/architecture.md, "coordinator/http/limits.py".
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from fedtrain.errors import error_body
from fedtrain.transport.protocols import READINTO
from fedtrain.transport.server_limits import ServerLimits

__all__ = ["MAX_JSON_BYTES", "BodyLimit", "ServerLimits", "UploadsInFlight"]

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
    """ASGI middleware: at most `max_bytes` of body on every request but tensor uploads, whose
    bodies, answered before they were read, may be dropped up to `upload_limit()` bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_JSON_BYTES, exempt: re.Pattern[str] = UPLOAD_PATH,
                 upload_limit: Callable[[], int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt
        self.upload_limit = upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.exempt.match(scope.get("path", "")):
            source = scope.get("extensions", {}).get(READINTO)
            if source is not None and self.upload_limit is not None:
                source.allow_drop(self.upload_limit())
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


class UploadsInFlight:
    """Requests in progress by key, at most one each (an upload per participant and round).
    Used from the event loop's thread only."""

    def __init__(self) -> None:
        self._keys: set[Hashable] = set()

    def take(self, key: Hashable) -> bool:
        """Take `key` for a request now starting; False when one holding it is in progress."""
        if key in self._keys:
            return False
        self._keys.add(key)
        return True

    def give_back(self, key: Hashable) -> None:
        self._keys.discard(key)

    def holds(self, key: Hashable) -> bool:
        """Whether a request holding `key` is in progress."""
        return key in self._keys

    @property
    def count(self) -> int:
        return len(self._keys)
