"""ASGI guards around the app: a request size limit and a last-resort 500.

``RequestGuard`` reads a request's body before the app sees it: a body over ``max_request_bytes``
(by its Content-Length, or counted as it arrives when chunked) is answered 413 with OpenAI's error
body before it is parsed; a client that goes away mid-body is logged (INFO) and forgotten. Any
exception that escapes the app becomes a 500 with OpenAI's error body and a logged traceback,
and the connection stays open for the client's next request (uvicorn would close it and Starlette
would answer plain text).
"""

from __future__ import annotations

import json
import logging

from verispec.serve.protocol import ApiError

logger = logging.getLogger("verispec.serve")

# The default --max-request-bytes: a prompt of max_model_len tokens is far smaller; a 10 MB
# prompt still reaches the prompt-length check (a 400 that names its length).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


async def send_error(send, error: ApiError) -> None:
    """Send ``error`` as a whole JSON response."""
    body = json.dumps(error.body()).encode()  # ensure_ascii: any text can be sent
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """The ASGI app ``app`` behind the size limit and the last-resort 500."""

    def __init__(self, app, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        label = f"{scope.get('method')} {scope.get('path')}"
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            receive = await self._read_body(scope, receive, send, label)
            if receive is None:  # refused or abandoned; answered (or nobody to answer)
                return
            await self.app(scope, receive, tracked_send)
        except Exception as e:  # an unexpected error: log it, answer JSON, keep the connection
            logger.exception("%s failed", label)
            if not started:
                await send_error(send, ApiError(500, f"{label}: internal error: "
                                                f"{type(e).__name__}"))

    async def _read_body(self, scope, receive, send, label: str):
        """A ``receive`` that replays the whole body, then passes through (disconnects reach the
        app); None after refusing the request or when the client left."""
        limit = self.max_request_bytes
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(send, _too_large(label, f"Content-Length {int(length)}", limit))
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                logger.info("%s: the client disconnected while sending the body", label)
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_error(send, _too_large(label, f"more than {limit} bytes", limit))
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = list(reversed(chunks))  # replayed as received: the app joins them once

        async def replay():
            if pending:
                chunk = pending.pop()
                return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
            return await receive()

        return replay


def _too_large(label: str, size: str, limit: int) -> ApiError:
    return ApiError(413, f"{label}: the request body ({size}) exceeds max_request_bytes={limit} "
                    "(--max-request-bytes)", None, "request_too_large")
