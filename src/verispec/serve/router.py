"""The one OpenAI-compatible endpoint in front of N engine replicas (`verispec serve --replicas N`).

The router answers /health (alive), /ready (at least one replica ready; per-replica state in the body) and
/metrics (its own counters, then every ready replica's metrics with a `replica` label) itself, and relays every
other route to the least-loaded ready replica, byte for byte, streaming (SSE) included. The same guard as the
single server runs first (`serve.app.GuardMiddleware`: the API key on every route but /health with a constant-time
compare, Host and Origin checks on a keyless server, body cap and deadline). A replica that dies under a request
ends it with a clear error: a 502 `replica_failed` before the response started, an SSE error event after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from verispec.serve.guard import GuardMiddleware
from verispec.serve.protocol import APIError, ServeLimits
from verispec.serve.replicas import Lease, ReplicaSet

log = logging.getLogger("verispec.serve.router")
DISCONNECT_POLL_S = 0.25  # how often a request waiting for its replica's answer checks that its client is there
# Request headers a replica needs; the client's Authorization is replaced by the router's internal key.
FORWARD_REQUEST = ("content-type", "accept")
# Response headers passed back (hop-by-hop and length headers are the router's own business).
FORWARD_RESPONSE = ("content-type", "retry-after", "cache-control", "www-authenticate")
REPLICA_HEADER = "x-verispec-replica"


def create_router_app(replicas: ReplicaSet, api_key: str | None = None, max_body_bytes: int = 4 << 20,
                      limits: ServeLimits = ServeLimits()):
    """The router's ASGI app. Its lifespan starts the replicas and stops them; they need not be ready yet."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await replicas.start()
        try:
            yield
        finally:
            await replicas.close()
            await client.aclose()

    app = FastAPI(title="verispec (replicas)", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        body = {"status": "ready" if any(r.ready for r in replicas.replicas) else "not ready",
                "replicas": [{"index": r.index, "ready": r.ready, "in_flight": r.in_flight, "routed": r.routed,
                              "restarts": r.restarts, "pid": r.pid} for r in replicas.replicas]}
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    for path, route in (("/health", health), ("/ready", ready)):
        app.add_api_route(path, route, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics():
        async def one(r) -> tuple[int, str]:
            with contextlib.suppress(httpx.HTTPError):
                resp = await client.get(f"{replicas.url(r)}/metrics", headers=replicas.auth, timeout=5.0)
                if resp.status_code == 200:
                    return r.index, resp.text
            return r.index, ""

        texts = dict(await asyncio.gather(*(one(r) for r in replicas.replicas if r.ready)))
        return PlainTextResponse(router_metrics(replicas) + merge_metrics(texts),
                                 media_type="text/plain; version=0.0.4")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def relay(request: Request, path: str):
        return await _relay(replicas, client, request)

    return GuardMiddleware(app, api_key, max_body_bytes, limits.body_timeout_s)


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    err = APIError(status, message, type="server_error", code=code, headers=headers)
    return JSONResponse(err.body(), status_code=status, headers=err.headers)


async def _relay(replicas: ReplicaSet, client: httpx.AsyncClient, request: Request) -> Response:
    lease = replicas.acquire()
    if lease is None:
        return _error(503, "no engine replica is ready yet (starting or restarting); retry shortly",
                      "no_replica_ready", {"Retry-After": "1"})
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            replicas.release(lease)

    try:
        headers = {k: v for k, v in request.headers.items() if k in FORWARD_REQUEST} | replicas.auth
        upstream = client.build_request(request.method, replicas.url(lease.replica) + request.url.path,
                                        params=request.query_params, headers=headers, content=await request.body())
        # Wait for the replica's response head while watching the client: a plain handler is not cancelled
        # when its client leaves, and the replica would decode for nobody.
        sending = asyncio.ensure_future(client.send(upstream, stream=True))
        while True:
            done, _ = await asyncio.wait({sending}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                sending.cancel()  # closes the connection: the replica sees the disconnect and aborts
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await sending
                release()
                return Response(status_code=499)
        try:
            resp = sending.result()
        except httpx.HTTPError as e:
            release()
            return _failed(lease, e)
    except BaseException:
        release()
        raise
    out_headers = {k: v for k, v in resp.headers.items() if k in FORWARD_RESPONSE}
    out_headers[REPLICA_HEADER] = str(lease.replica.index)
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    return _Relayed(_body(resp, lease, sse, release), release, status_code=resp.status_code, headers=out_headers)


def _failed(lease: Lease, err: Exception) -> JSONResponse:
    log.warning("replica %d failed under a request: %r", lease.replica.index, err)
    return _error(502, f"engine replica {lease.replica.index} stopped while serving this request ({type(err).__name__}"
                       "); it is being restarted: retry the request", "replica_failed")


async def _body(resp: httpx.Response, lease: Lease, sse: bool,
                release: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        log.warning("replica %d failed mid-response: %r", lease.replica.index, e)
        if sse:  # the head is sent: the error goes in the stream, as the server's own mid-stream errors do
            err = APIError(502, f"engine replica {lease.replica.index} stopped while streaming this response; it "
                                "is being restarted: retry the request", type="server_error", code="replica_failed")
            yield f"\n\ndata: {json.dumps(err.body())}\n\n".encode()
    finally:
        await resp.aclose()
        release()


class _Relayed(StreamingResponse):
    """A relayed response that gives its lease back however it ends (a client gone before the first chunk
    cancels the response before the body generator ever runs)."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # closes the upstream response now
            self._release()


# ---- metrics ---------------------------------------------------------------------------------------------------
def router_metrics(replicas: ReplicaSet) -> str:
    fams = (
        ("replica_ready", "gauge", "1 when the replica answers /ready.", lambda r: int(r.ready)),
        ("replica_in_flight", "gauge", "Requests the router has in flight on the replica.", lambda r: r.in_flight),
        ("replica_routed_total", "counter", "Requests routed to the replica.", lambda r: r.routed),
        ("replica_restarts_total", "counter", "Times the replica's process was started again.", lambda r: r.restarts),
    )
    lines = []
    for name, kind, help_, value in fams:
        base = name.removesuffix("_total")
        lines += [f"# HELP verispec:{base} {help_}", f"# TYPE verispec:{base} {kind}"]
        lines += [f'verispec:{name}{{replica="{r.index}"}} {value(r)}' for r in replicas.replicas]
    return "\n".join(lines) + "\n"


def merge_metrics(texts: dict[int, str]) -> str:
    """Replicas' Prometheus texts as one: each family's HELP/TYPE once, then its samples from every replica with
    a `replica="i"` label added (a family's samples must be contiguous in the text format)."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for index, text in sorted(texts.items()):
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if len(heads.setdefault(family, [])) < 2:
                    heads[family].append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#"):
                name, brace, rest = line.partition("{")
                if brace:
                    labelled = f'{name}{{replica="{index}",{rest}' if not rest.startswith("}") else \
                        f'{name}{{replica="{index}"{rest}'
                else:
                    name, _, value = line.partition(" ")
                    labelled = f'{name}{{replica="{index}"}} {value}'
                samples.setdefault(family or name, []).append(labelled)
    out = []
    for family, lines in samples.items():
        out += heads.get(family, []) + lines
    return "\n".join(out) + ("\n" if out else "")
