"""What one request may ask of the OpenAI server, checked before anything expensive runs.

Each limit has a flag of `dlite-trt serve` and a default that protects one machine:

- the request body: ``--max-body-mb`` (8 MiB), a 413 before the body is read when its
  Content-Length says so, else as soon as the bytes read pass it;
- the prompt's characters, before it is tokenized: ``--max-prompt-chars`` (default: the engine's
  --max-seq-len times the longest token's characters, the most text that can ever fit);
- stop strings: ``--max-stops`` (16) of at most ``--max-stop-chars`` (1,024) characters each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
CLOSE_ABOVE = 8  # a declared body this many times the limit gets its 413 and the connection closed (not read)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * MIB
    max_prompt_chars: int | None = None  # None: the engine's --max-seq-len x the longest token's characters
    max_stops: int = 16
    max_stop_chars: int = 1024
    shutdown_timeout: float = 5.0  # seconds requests in flight get to finish after Ctrl-C (new ones: 503)
    api_key: str | None = field(default=None, repr=False)  # /v1 routes want "Authorization: Bearer <it>" where set


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this tokenizer decodes to: a text longer than that many
    characters per allowed token can never fit the engine."""
    return max(len(text) for text in tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 in OpenAI's error shape, from
    its Content-Length before any byte is read, else as soon as the bytes read pass the limit (the
    app then sees a client that went away, and whatever it answers is dropped). The connection
    stays open: uvicorn discards the rest of the body, so a client that sends it all before it
    reads (most do) gets the 413 rather than a broken pipe; but a declared body more than
    CLOSE_ABOVE times the limit is not worth reading, and its connection is closed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, int(length), close=int(length) > CLOSE_ABOVE * self.max_bytes)
            return
        seen, refused = 0, False

        async def limited_receive() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    await self._refuse(send, None)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, send: Any, length: int | None, close: bool = False) -> None:
        size = f"{length:,} bytes" if length is not None else f"over {self.max_bytes:,} bytes"
        body = json.dumps({"error": {
            "message": f"the request body is {size}; this server takes at most {self.max_bytes:,} "
                       "(dlite-trt serve --max-body-mb): shorten the prompt or raise the limit.",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *([(b"connection", b"close")] if close else [])]})
        await send({"type": "http.response.body", "body": body})
