"""The ASGI layer around each app: the bearer token, the body size limit, and
the 500 of last resort.  It answers on its own, before FastAPI reads a byte:

    401 unauthorized  a token is configured and the request lacks it (all but /healthz)
    413 too_large     Content-Length over MAX_BODY_BYTES, or the body grows past it
    500 internal      anything the app raised and did not answer (logged with its traceback)

:func:`documents_bearer` only declares the token in the OpenAPI document; the
guard is what enforces it.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Annotated, Any

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..model import MAX_BODY_BYTES

log = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Any]]
Asgi = Callable[[Message, Receive, Send], Awaitable[None]]

_bearer = HTTPBearer(auto_error=False, description="needed on TCP; the unix socket needs none")


async def documents_bearer(
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> None:
    """Declares bearer auth in the OpenAPI document; :class:`Guard` enforces it."""


async def _send_json(send: Send, status: int, body: dict[str, Any],
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": data})


_UNAUTHORIZED = {"error": "unauthorized", "message": "missing or wrong bearer token"}
_TOO_LARGE = {"error": "too_large", "message": f"request body over {MAX_BODY_BYTES} bytes"}
_INTERNAL = {"error": "internal", "message": "internal error; see the qosd log"}


class _BodyTooLarge(Exception):
    pass


def _header(scope: Message, wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return bytes(value)
    return None


def _declared_too_large(scope: Message) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                if int(value) > MAX_BODY_BYTES:
                    return True
            except ValueError:
                pass  # not a number: the body is counted as it arrives
    return False


class Guard:
    """Outermost own layer: bearer token, body size limit, and the 500 of last resort."""

    def __init__(self, app: Asgi, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token is not None else None

    def _authorized(self, scope: Message) -> bool:
        if self.token is None or scope.get("path") == "/healthz":
            return True
        scheme, _, cred = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            cred = b""
        # constant time in the token's content (not its length, which is no secret)
        return hmac.compare_digest(cred.strip(), self.token)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _send_json(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        if _declared_too_large(scope):
            await _send_json(send, 413, _TOO_LARGE)
            return
        seen = 0
        started = False
        answered = False  # we sent the 413 ourselves; the app's answer is dropped

        async def limited_receive() -> Any:
            nonlocal seen, answered
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    # answer now: the app may turn the exception into a 400 of its own
                    if not started and not answered:
                        answered = True
                        await _send_json(send, 413, _TOO_LARGE)
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not answered:
                raise
        except Exception:
            log.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            if started or answered:
                raise
            await _send_json(send, 500, _INTERNAL)
