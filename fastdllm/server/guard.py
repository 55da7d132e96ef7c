"""An ASGI layer in front of the app: API-key authentication and a cap on request bodies.

The body is read here, up to the cap, before the app sees the request: a body over the cap gets
413 without being buffered whole (a 10 MB body no longer costs the event loop), and a client that
disconnects mid-body ends the request quietly. With an API key, every route except /health,
/ready and /version needs `Authorization: Bearer <key>` (401 otherwise, in OpenAI's error shape).
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = ("/health", "/ready", "/version")


async def _send_error(send, status: int, message: str, type_: str, code: str, headers=()) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = 4 * 1024 * 1024):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.api_key and scope.get("path", "") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await _send_error(
                    send,
                    401,
                    "Incorrect API key provided",
                    "invalid_request_error",
                    "invalid_api_key",
                    [(b"www-authenticate", b"Bearer")],
                )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _send_error(
                send, 413, f"request body over {self.max_body_bytes} bytes", "invalid_request_error", "body_too_large"
            )
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left mid-body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await _send_error(
                    send,
                    413,
                    f"request body over {self.max_body_bytes} bytes",
                    "invalid_request_error",
                    "body_too_large",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
