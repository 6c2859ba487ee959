"""The OpenAI-compatible HTTP server over the async engine (FastAPI).

Routes: /v1/completions, /v1/chat/completions (SSE streaming ending in `[DONE]`), /v1/models, /health (alive),
/ready (a real one-token generation succeeded and the engine loop is alive), /metrics (Prometheus text).
Every route but /health needs the API key when one is set (constant-time compare). Bodies over the limit get
413 before the app sees them, bodies that stall 408; a keyless server answers only loopback Host names and
same-machine origins; a full queue gets 429 with Retry-After; every error is OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.config import RequestSpec, SamplingParams
from verispec.drafters.spec import parse_spec
from verispec.engine.async_engine import AsyncEngine
from verispec.errors import QueueFull, VerispecError
from verispec.model.tokenizer import Tokenizer
from verispec.serve.chat import ChatTemplate
from verispec.serve.guard import PUBLIC_ROUTES, GuardMiddleware, is_loopback  # noqa: F401 - re-exported
from verispec.serve.metrics import render_metrics
from verispec.serve.protocol import (
    APIError,
    ServeLimits,
    chat_messages,
    completion_prompt,
    parse_sampling,
    parse_speculation,
    parse_stream,
    refuse_unsupported,
)
from verispec.serve.schema import route_doc

log = logging.getLogger("verispec.serve")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    limits: ServeLimits = field(default_factory=ServeLimits)
    chat: ChatTemplate = field(default_factory=ChatTemplate)
    # Drafter specs requests may use (the engine's default is always one): a request names one of these, or a
    # registry name (`model`) that matches exactly one. Never a path from the request: clients cannot make the
    # server load files.
    drafters: tuple[str, ...] = ()
    ready: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.plain = self.tokenizer.plain_text_copy()  # user text: special-token strings stay text
        default = self.engine.engine.config.drafter
        self.drafters = tuple(dict.fromkeys(([default] if default else []) + list(self.drafters)))

    def resolve_drafter(self, requested: str | None) -> str | None:
        if requested in (None, "none") or requested in self.drafters:
            return requested
        named = [d for d in self.drafters if parse_spec(d).name == requested]
        if len(named) == 1:
            return named[0]
        enabled = ", ".join(sorted({parse_spec(d).name for d in self.drafters})) or "none"
        raise APIError(400, f"the requested drafter is not enabled on this server (enabled: {enabled}; start the "
                            "server with --drafters to enable more)", param="speculation")


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await _warm_up(state)
        yield
        state.engine.shutdown()

    # redirect_slashes off: /v1/completions/ is a 404, not a 307 that clients would follow with their body.
    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  redirect_slashes=False)
    app.state.verispec = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(err.status_code, str(err.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(500, "internal error", type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready and state.engine.alive:
            return {"status": "ready"}
        return JSONResponse({"status": "not ready"}, status_code=503)

    for path, route in (("/health", health), ("/ready", ready)):  # HEAD for probes (uvicorn drops the body); one
        app.add_api_route(path, route, methods=["HEAD"], include_in_schema=False)  # operation each in the schema

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(state.engine.engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "verispec"}
        ]}

    # openapi_extra documents the bodies (/openapi.json, behind the API key); protocol.py still validates them.
    @app.post("/v1/completions", openapi_extra=route_doc(state, chat=False))
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=route_doc(state, chat=True))
    async def chat_completions(request: Request):
        return await _generate(state, request, chat=True)

    return GuardMiddleware(app, state.api_key, state.max_body_bytes,  # type: ignore[return-value]
                           state.limits.body_timeout_s)


async def _warm_up(state: ServerState) -> None:
    """Readiness means a real generation went through the engine: run one token."""
    prompt = state.tokenizer.encode("Hello") or [0]
    try:
        async for out in state.engine.generate(prompt, SamplingParams(max_tokens=1), RequestSpec(drafter="none")):
            if out.finished:
                state.ready = True
    except Exception:  # stays not ready; /ready reports it
        log.exception("warm-up generation failed")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _budget_error(state: ServerState, prompt_len: int, max_tokens: int, spec: RequestSpec,
                  chat: bool) -> APIError | None:
    """The 400 for a request larger than the whole KV cache budget, naming what the client can change."""
    engine = state.engine.engine
    budget, fixed = engine.config.cache_budget_tokens, prompt_len + engine.draft_slots(spec)
    if min(engine.limit, fixed + max_tokens) <= budget:
        return None  # refused for another reason
    if budget - fixed < 1:
        return APIError(400, f"the prompt's {prompt_len} tokens and {fixed - prompt_len} draft positions do not fit "
                             f"this server's KV cache budget of {budget} positions",
                        param="messages" if chat else "prompt")
    return APIError(400, f"max_tokens {max_tokens} does not fit this server's KV cache budget of {budget} positions "
                         f"with the prompt's {prompt_len} tokens and {fixed - prompt_len} draft positions; at most "
                         f"{budget - fixed} new tokens fit", param="max_tokens")


def _prepare(state: ServerState, body: dict, chat: bool) -> tuple[list[int], SamplingParams, RequestSpec]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "model must be a string", param="model")
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {str(model)[:100]!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found", type="not_found_error")
    engine = state.engine.engine
    vocab = engine.target.config.vocab_size
    if chat:
        messages = chat_messages(body, state.tokenizer.special_tokens())
        prompt_ids = state.tokenizer.encode(state.chat.render(messages))
    else:
        prompt_ids = completion_prompt(body, state.plain.encode, vocab)
    refuse_unsupported(body)
    spec = parse_speculation(body.get("speculation"))
    spec = dataclasses.replace(spec, drafter=state.resolve_drafter(spec.drafter))
    budget = engine.config.cache_budget_tokens  # a reservation is capped at the context: a budget >= it fits all
    fits = budget - len(prompt_ids) - engine.draft_slots(spec) if budget < engine.limit else None
    params = parse_sampling(body, len(prompt_ids), engine.limit, vocab, chat=chat, limits=state.limits, fits=fits)
    return prompt_ids, params, spec


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    body = await _json_body(request)
    prompt_ids, params, spec = _prepare(state, body, chat)
    stream, include_usage = parse_stream(body)
    try:
        # a non-streaming response waits for the end only: its event loop is not woken for every step
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        rid, queue = state.engine.submit(prompt_ids, params, spec, rid, final_only=not stream)
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
    except VerispecError as e:  # e.g. the request needs more KV cache than the engine's budget
        raise _budget_error(state, len(prompt_ids), params.max_tokens, spec, chat) or APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error") from None
    shape = _Shape(rid, state.model_name, chat, int(time.time()))
    if stream:
        return _EngineStream(state, rid, _sse(state, shape, rid, queue, len(prompt_ids), include_usage),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text, result = [], None
    outputs = state.engine.stream(rid, queue)
    pending: asyncio.Task | None = None
    last_check = time.monotonic()
    try:
        while result is None:
            # One lasting task per output: waiting with a timeout must not cancel it (that would abort).
            pending = pending or asyncio.ensure_future(anext(outputs))
            done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
            if time.monotonic() - last_check >= DISCONNECT_POLL_S:  # also while tokens keep coming
                last_check = time.monotonic()
                if await request.is_disconnected():
                    return Response(status_code=499)  # the client is gone; closing `outputs` aborts
            if not done:
                continue
            try:
                out = pending.result()
            except RuntimeError as e:
                raise APIError(500, str(e), type="server_error") from None
            pending = None
            text.append(out.text)
            result = out.result
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, RuntimeError):
                await pending
        await outputs.aclose()
    return JSONResponse(shape.full("".join(text), result.finish_reason, _usage(len(prompt_ids), result), result))


def _usage(prompt_tokens: int, result) -> dict:
    n = len(result.token_ids) if result is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


@dataclass(frozen=True)
class _Shape:
    """OpenAI response and chunk shapes for completions and chat completions."""

    rid: str
    model: str
    chat: bool
    created: int

    def _base(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict, result) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        stats = result.stats
        spec = {"tau": stats.tau, "acceptance_rate": stats.acceptance_rate, "num_drafts": stats.num_drafts,
                "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens}
        return {**self._base(False), "choices": [choice], "usage": usage, "speculation": spec}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self._base(True), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._base(True), "choices": [], "usage": usage}


class _EngineStream(StreamingResponse):
    """An SSE response that aborts its request however the response ends. A client gone before the body's first
    chunk is read cancels the response while `_sse` has not started (or sits at the chat role chunk), so the
    generator's own cleanup never runs and the request would decode to max_tokens for nobody."""

    def __init__(self, state: ServerState, rid: str, content: AsyncIterator[str], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._state, self._rid = state, rid

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._state.engine.abort(self._rid)  # idempotent: a no-op for a finished request


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _sse(
    state: ServerState, shape: _Shape, rid: str, queue: asyncio.Queue, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    # Leaving this generator early (client gone: Starlette cancels it) closes engine.stream, which aborts; _EngineStream
    # aborts too where it never got that far.
    if shape.chat:
        yield _event(shape.chunk(None, role=True))
    try:
        async for out in state.engine.stream(rid, queue):
            if out.result is None:
                if out.text:
                    yield _event(shape.chunk(out.text))
                continue
            if out.text:
                yield _event(shape.chunk(out.text))
            yield _event(shape.chunk(None, out.result.finish_reason))
            if include_usage:
                yield _event(shape.usage_chunk(_usage(prompt_tokens, out.result)))
    except RuntimeError as e:
        yield _event(APIError(500, str(e), type="server_error").body())
        return
    yield "data: [DONE]\n\n"
