"""ASGI middleware every response passes through: ``HEAD`` on the GET routes, and the
``X-Request-Id`` header (the client's echoed, or a new one)."""

from __future__ import annotations

import uuid

MAX_REQUEST_ID_BYTES = 256  # a longer X-Request-Id is not echoed: the response gets a new one


class HeadAndRequestId:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        request_id = given if 0 < len(given) <= MAX_REQUEST_ID_BYTES else uuid.uuid4().hex.encode()
        head = scope["method"] == "HEAD"
        if head:  # answered as GET, without the body (its headers, Content-Length included, as GET's)
            scope = {**scope, "method": "GET"}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            elif head and message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {**message, "body": b""}
            await send(message)

        await self.app(scope, receive, send_with_id)
