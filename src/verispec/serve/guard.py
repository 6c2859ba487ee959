"""The checks every request passes before any route code runs, shared by the single server (`serve.app`) and the
replica router (`serve.router`): Host and Origin on a keyless server (loopback only: no DNS rebinding, no
cross-site pages), the API key on every route but the public ones (constant-time compare), a JSON content type on
the JSON routes, a body-size cap and a body-read deadline.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
from urllib.parse import urlsplit

from verispec.serve.protocol import APIError

PUBLIC_ROUTES = frozenset({"/health"})
JSON_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_authority(host: str) -> bool:
    """A Host header (`name`, `1.2.3.4`, `[v6]`, each with an optional `:port`) naming this machine's loopback."""
    if host.startswith("["):
        name, _, port = host[1:].partition("]")
        if port and not port.startswith(":"):
            return False
        port = port[1:]
    else:
        name, _, port = host.partition(":")  # an unbracketed IPv6 leaves a non-numeric port: refused
    return (not port or port.isdigit()) and is_loopback(name)


def _loopback_origin(origin: str) -> bool:
    """An Origin header of a page served from this machine's loopback ("null", file pages included, is not)."""
    try:
        url = urlsplit(origin)
        url.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        return False
    return url.scheme in ("http", "https") and url.hostname is not None and is_loopback(url.hostname)


def _is_json(content_type: str) -> bool:
    mime = content_type.partition(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


async def _send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """Before any route code runs: Host and Origin on a keyless server, the API key on every route but the public
    ones, a JSON content type on the JSON routes, a body-size cap and a body-read deadline."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is None:  # loopback only, no key: refuse DNS rebinding and cross-site pages
            err = self._foreign(headers)
            if err is not None:
                return await _send_json(send, err.status, err.body())
        if self.key is not None and scope["path"] not in PUBLIC_ROUTES:
            auth = headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                err = APIError(401, "invalid or missing API key", type="authentication_error",
                               code="invalid_api_key")
                return await _send_json(send, 401, err.body(), {"WWW-Authenticate": "Bearer"})
        # A JSON body only: a form or text/plain post is what a browser sends cross-site without a preflight.
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if scope["method"] == "POST" and scope["path"] in JSON_ROUTES and not _is_json(content_type):
            err = APIError(415, "the request body must be JSON (Content-Type: application/json)",
                           code="unsupported_media_type")
            return await _send_json(send, 415, err.body(), {"Connection": "close"})
        too_big = APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="body_too_large")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_body_bytes:
            return await _send_json(send, 413, too_big.body(), {"Connection": "close"})
        # Read the body here, counting, so a chunked upload cannot exceed the cap either; then replay it.
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                err = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               code="body_timeout")
                return await _send_json(send, 408, err.body(), {"Connection": "close"})
            if message["type"] != "http.request":
                return  # disconnected before the body arrived
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _send_json(send, 413, too_big.body(), {"Connection": "close"})
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls see the disconnect

        return await self.app(scope, replay, send)

    @staticmethod
    def _foreign(headers: dict[bytes, bytes]) -> APIError | None:
        host = headers.get(b"host")  # absent only in HTTP/1.0, which no browser sends
        if host is not None and not _loopback_authority(host.decode("latin-1")):
            return APIError(421, "this server has no API key and answers only loopback Host names (localhost, "
                                 "127.0.0.1, [::1])", code="invalid_host")
        origin = headers.get(b"origin")
        if origin is not None and not _loopback_origin(origin.decode("latin-1")):
            return APIError(403, "cross-origin requests are refused by a server without an API key",
                            type="permission_error", code="cross_origin")
        return None
