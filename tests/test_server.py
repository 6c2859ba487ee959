"""The OpenAI-compatible HTTP server against real uvicorn servers on loopback (reliability.md §5).

One module-scoped server (API key "test-key") serves most tests; small dedicated servers cover backpressure (E5),
the KV-leak check under forced rejection (C2) and the no-key / small-body-limit configuration (H1, D3). Clients are
raw `httpx` (framing, status codes, error bodies) and the official `openai` SDK.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from conftest import tiny_model
from prometheus_client.parser import text_string_to_metric_families

import verispec.serve.app as app_module
import verispec.serve.guard as guard_module
from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.decode import decode
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.errors import ConfigError
from verispec.model import load_model, save_model
from verispec.model.tokenizer import Tokenizer
from verispec.serve.app import PUBLIC_ROUTES, create_app
from verispec.serve.chat import ChatTemplate
from verispec.serve.protocol import ServeLimits
from verispec.serve.server import build_state, is_loopback, serve

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "target"
PROMPT = "def add(a, b):\n    return a + b\n"
CHAT = [{"role": "user", "content": "The quick brown fox"}]
SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"


# ---- servers ---------------------------------------------------------------------------------------------------
class LiveServer:
    """A real uvicorn server on a free loopback port, in a daemon thread."""

    def __init__(self, state) -> None:
        self.state = state
        self.app = create_app(state)
        # proto=IPPROTO_TCP as uvicorn's own bind gets it: asyncio sets TCP_NODELAY only then (else +40 ms/reply)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2,
                                h11_max_incomplete_event_size=64 * 1024)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def engine(self) -> Engine:
        return self.state.engine.engine

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.server.started:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.02)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def client(self, key: str | None = KEY, timeout: float = 30) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=30)


@contextlib.contextmanager
def running(state):
    srv = LiveServer(state).start()
    try:
        yield srv
    finally:
        srv.stop()


class _DropReRaised(logging.Filter):
    """uvicorn logs an app exception again *after* the response went out; the app already logged it (before
    replying). Formatting that second traceback (Python 3.11's traceback calls ast.parse) in the server thread
    while pytest's main thread formats a failure with ast.parse can crash pytest ("AST constructor recursion depth
    mismatch"): drop the duplicate."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Exception in ASGI application")


@pytest.fixture(scope="module", autouse=True)
def _quiet_reraise():
    f = _DropReRaised()
    logging.getLogger("uvicorn.error").addFilter(f)
    yield
    logging.getLogger("uvicorn.error").removeFilter(f)


@pytest.fixture(scope="module", autouse=True)
def _profile_cache(tmp_path_factory):
    """The dspark policy (`"k": "auto"`) measures a step profile once; keep it out of the home directory."""
    old = os.environ.get("VERISPEC_CACHE")
    os.environ["VERISPEC_CACHE"] = str(tmp_path_factory.mktemp("profiles"))
    yield
    if old is None:
        os.environ.pop("VERISPEC_CACHE", None)
    else:
        os.environ["VERISPEC_CACHE"] = old


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer) -> Path:
    """The conftest checkpoint (seed 0, fp32, context 128), in a module-scoped directory named "target"."""
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    save_model(tiny_model(vocab_size=tokenizer.vocab_size), path)
    tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory, tokenizer) -> Path:
    """Different random weights, same tokenizer: a drafter whose proposals are almost always rejected."""
    path = tmp_path_factory.mktemp("draft") / "draft"
    save_model(tiny_model(seed=5, vocab_size=tokenizer.vocab_size), path)
    tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def srv(ckpt):
    config = EngineConfig(max_running=8, max_queued=32, cache_budget_tokens=8192, drafter="ngram", k=4)
    state = build_state(ckpt, config, dtype="fp32", api_key=KEY,
                        drafters=("ngram:2", "model", "vericache(compress=streaming, budget=12, draft=ngram)"))
    with running(state) as s:
        yield s


@pytest.fixture(scope="module")
def open_srv(ckpt):
    """No API key, and a 16 KiB body limit."""
    state = build_state(ckpt, EngineConfig(max_running=2, max_queued=4), dtype="fp32", max_body_bytes=16 << 10)
    with running(state) as s:
        yield s


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype="fp32")


@pytest.fixture(scope="module")
def served_tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


@pytest.fixture
def client(srv):
    with srv.client() as c:
        yield c


# ---- helpers ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def slow_steps(engine: Engine, seconds: float):
    """Make every engine step take at least `seconds` (so a test can act while a request is mid-generation)."""
    orig = engine.step

    def step():
        time.sleep(seconds)
        return orig()

    engine.step = step
    try:
        yield
    finally:
        del engine.step


def wait_idle(engine: Engine, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished() and engine.reserved_tokens == 0 and not engine.running:
            return True
        time.sleep(0.02)
    return False


def scrape(c: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = c.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((f"verispec:{name}", tuple(sorted(labels.items()))), 0.0)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> dict:
    """An OpenAI-shaped error body of at most 4 KiB."""
    assert r.status_code == status, r.text[:500]
    assert len(r.content) <= 4096
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


def completion_body(**kw) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    body.update(kw)
    return body


def expected_completion(model, ckpt, prompt: str, n: int) -> str:
    """What plain greedy decoding gives for a completion prompt (encoded as the server encodes user text)."""
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.plain_text_copy().encode(prompt)
    res = decode(model, ids, SamplingParams(max_tokens=n, ignore_eos=True), tokenizer=tok)
    assert len(res.token_ids) == n
    return res.text


def expected_chat(model, ckpt, messages: list[dict], n: int) -> str:
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode(ChatTemplate.from_dir(ckpt).render(messages))
    res = decode(model, ids, SamplingParams(max_tokens=n, ignore_eos=True), tokenizer=tok)
    return res.text


def sse_events(r: httpx.Response) -> list[str]:
    """The raw `data:` payloads of an SSE response, checking the framing on the way (F1)."""
    raw = b"".join(r.iter_bytes()).decode("utf-8")
    assert raw.endswith("\n\n")
    payloads = []
    for event in raw[:-2].split("\n\n"):
        lines = event.split("\n")
        assert len(lines) == 1, f"multi-line event {event!r}"
        assert lines[0].startswith("data: "), f"not a data line: {lines[0]!r}"
        payloads.append(lines[0][len("data: "):])
    return payloads


# ---- 1. generation through the openai SDK (B3, B6, A1) ---------------------------------------------------------
N = 16


def test_completion_greedy_equals_decode_stream_and_nonstream(srv, model, ckpt):
    """A1/B6: the server's greedy completion equals `decode`; streamed deltas concatenate to the same text, one
    finish_reason, usage chunk counts the tokens."""
    expected = expected_completion(model, ckpt, PROMPT, N)
    oa = srv.openai()
    res = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                extra_body={"ignore_eos": True})
    assert res.choices[0].text == expected
    assert res.choices[0].finish_reason == "length"
    prompt_len = len(Tokenizer.from_dir(ckpt).plain_text_copy().encode(PROMPT))
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (prompt_len, N)
    assert res.usage.total_tokens == prompt_len + N

    stream = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text.append(ch.text)
            if ch.finish_reason is not None:
                reasons.append(ch.finish_reason)
    assert "".join(text) == expected
    assert reasons == ["length"]
    assert usage is not None and usage.completion_tokens == N and usage.prompt_tokens == prompt_len


def test_chat_greedy_equals_decode_stream_and_nonstream(srv, model, ckpt):
    """A1/B6 for chat: default template, greedy text == decode; stream == non-stream; one finish_reason."""
    expected = expected_chat(model, ckpt, CHAT, N)
    oa = srv.openai()
    res = oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected
    assert res.choices[0].finish_reason == "length"
    assert res.usage.completion_tokens == N

    stream = oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, reasons, roles, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            if ch.delta.content:
                text.append(ch.delta.content)
            if ch.finish_reason is not None:
                reasons.append(ch.finish_reason)
    assert roles == ["assistant"]
    assert "".join(text) == expected
    assert reasons == ["length"]
    assert usage is not None and usage.completion_tokens == N


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_max_tokens_exact(srv, n):
    """B3: with ignore_eos, completion_tokens == max_tokens and finish_reason "length" (k=4 blocks, any offset)."""
    oa = srv.openai()
    res = oa.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=n, temperature=0,
                                extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == n
    assert res.choices[0].finish_reason == "length"


@pytest.mark.parametrize("speculation", [
    {"method": "ngram", "k": 4}, "off", {"k": "auto"}, {"method": "ngram:2", "k": 1}, {"method": "model", "k": 2},
    {"k": 0}, {"method": "vericache", "k": 8},
])
def test_per_request_speculation_is_lossless(srv, model, ckpt, speculation):
    """A1 through the API: per-request speculation settings all give the plain greedy text."""
    expected = expected_completion(model, ckpt, PROMPT, N)
    res = srv.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
        extra_body={"ignore_eos": True, "speculation": speculation},
    )
    assert res.choices[0].text == expected
    assert res.usage.completion_tokens == N


def test_greedy_is_batch_invariant(srv, model, ckpt):
    """A1/A8: concurrent greedy requests (different prompts, mixed speculation) each equal their own decode."""
    prompts = ["def add(a, b):", "class Point:", "The lazy dog", "naïve café"]
    expected = {p: expected_completion(model, ckpt, p, N) for p in prompts}
    results: dict[str, str] = {}

    def run(i: int, p: str) -> None:
        spec = ["off", {"method": "ngram", "k": 4}][i % 2]
        with srv.client() as c:
            r = c.post("/v1/completions", json=completion_body(prompt=p, max_tokens=N, ignore_eos=True,
                                                               speculation=spec))
            results[p] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == expected


def test_token_id_prompt_equals_decode(client, model, ckpt):
    """A1: a prompt given as token ids is used as is: the greedy completion equals `decode` on those ids."""
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode("class Point:\n    def")
    res = decode(model, ids, SamplingParams(max_tokens=N, ignore_eos=True), tokenizer=tok)
    for prompt in (ids, [ids]):
        r = client.post(C, json=completion_body(prompt=prompt, max_tokens=N, ignore_eos=True)).json()
        assert r["choices"][0]["text"] == res.text
        assert r["usage"]["prompt_tokens"] == len(ids)


def test_seeded_sampling_is_reproducible(client):
    """A6: temperature > 0 with a seed gives the same text every time for the same speculation setting, streamed
    or not (spec and plain sampling draw differently, so they are only equal in distribution)."""
    base = completion_body(max_tokens=N, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)
    for spec in ("off", {"method": "ngram", "k": 4}):
        body = {**base, "speculation": spec}
        texts = {client.post(C, json=body).json()["choices"][0]["text"] for _ in range(2)}
        with client.stream("POST", C, json={**body, "stream": True}) as r:
            texts.add("".join(json.loads(p)["choices"][0]["text"] for p in sse_events(r)[:-1]))
        assert len(texts) == 1, texts
    other = client.post(C, json={**base, "seed": 4321, "speculation": "off"}).json()["choices"][0]["text"]
    assert other != client.post(C, json={**base, "speculation": "off"}).json()["choices"][0]["text"]


@pytest.mark.parametrize("prompt", ["日本語のテキスト 🙂", "naïve café", "🙂🙂", "café – ün"])
def test_utf8_stream_equals_final(client, model, ckpt, prompt):
    """F3: non-ASCII prompts (byte-level tokens that split characters): streamed == non-streamed == `decode`'s
    text, including a trailing incomplete character."""
    expected = expected_completion(model, ckpt, prompt, 32)
    body = completion_body(prompt=prompt, max_tokens=32, ignore_eos=True)
    assert client.post(C, json=body).json()["choices"][0]["text"] == expected
    with client.stream("POST", C, json={**body, "stream": True}) as r:
        assert "".join(json.loads(p)["choices"][0]["text"] for p in sse_events(r)[:-1]) == expected


# ---- 2. SSE framing (F1) --------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_sse_framing(client, chat):
    """F1: only `data: ` lines and blank separators, each JSON but the final [DONE]; text/event-stream; the
    include_usage chunk (choices == []) comes right before [DONE]; exactly one finish_reason."""
    if chat:
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": CHAT}
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": PROMPT}
    body.update(max_tokens=10, temperature=0, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0].strip() == "text/event-stream"
        payloads = sse_events(r)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 10
    assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])
    reasons = [ch["finish_reason"] for c in chunks[:-1] for ch in c["choices"] if ch["finish_reason"] is not None]
    assert reasons == ["length"]
    assert len({c["id"] for c in chunks}) == 1
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert all(c["object"] == obj and c["model"] == MODEL for c in chunks)


def test_sse_without_usage(client):
    """F1: without include_usage no chunk carries usage, and the stream still ends in [DONE]."""
    with client.stream("POST", "/v1/completions", json=completion_body(stream=True)) as r:
        payloads = sse_events(r)
    assert payloads[-1] == "[DONE]"
    assert all(json.loads(p).get("usage") is None and json.loads(p)["choices"] for p in payloads[:-1])


# ---- 3. stop strings (B2) -------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True])
def test_stop_string_mid_output(client, chat):
    """B2/B6: a stop string taken from the middle of the greedy output truncates the text right before its first
    occurrence, finish_reason "stop", streamed == non-streamed."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": MODEL, "messages": CHAT} if chat else {"model": MODEL, "prompt": PROMPT}
    base.update(max_tokens=24, temperature=0, ignore_eos=True)

    def content(r: dict) -> str:
        ch = r["choices"][0]
        return ch["message"]["content"] if chat else ch["text"]

    full = content(client.post(path, json=base).json())
    assert len(full) >= 8, full
    mid = len(full) // 2
    stop = full[mid : mid + 3]
    expected = full[: full.index(stop)]
    r = client.post(path, json={**base, "stop": [stop]}).json()
    assert content(r) == expected
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 24

    with client.stream("POST", path, json={**base, "stop": stop, "stream": True}) as s:
        chunks = [json.loads(p) for p in sse_events(s)[:-1]]
    if chat:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == expected
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert reasons == ["stop"]


# ---- 4. validation (D1-D3) ------------------------------------------------------------------------------------
C, CH = "/v1/completions", "/v1/chat/completions"
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # >> 128 tokens
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
VALIDATION = [
    # (id, path, body (dict or raw bytes), status, param, code)
    ("max_tokens=0", C, completion_body(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens=-1", C, completion_body(max_tokens=-1), 400, "max_tokens", None),
    ("max_tokens=2^31", C, completion_body(max_tokens=2**31), 400, "max_tokens", "context_length_exceeded"),
    ("max_tokens=2^63", C, completion_body(max_tokens=2**63), 400, "max_tokens", None),
    ("max_tokens=1.5", C, completion_body(max_tokens=1.5), 400, "max_tokens", None),
    ("max_tokens='10'", C, completion_body(max_tokens="10"), 400, "max_tokens", None),
    ("max_tokens=true", C, completion_body(max_tokens=True), 400, "max_tokens", None),
    ("max_tokens=prompt+room+1", C, completion_body(max_tokens=128), 400, "max_tokens", "context_length_exceeded"),
    ("temperature=-0.1", C, completion_body(temperature=-0.1), 400, "temperature", None),
    ("temperature=1e9", C, completion_body(temperature=1e9), 400, "temperature", None),
    ("temperature=3.0", C, completion_body(temperature=3.0), 400, "temperature", None),
    ("temperature=NaN", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature", None),
    ("temperature=Infinity", C, b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature", None),
    ("temperature='1'", C, completion_body(temperature="1"), 400, "temperature", None),
    ("top_p=0", C, completion_body(top_p=0), 400, "top_p", None),
    ("top_p=-0.1", C, completion_body(top_p=-0.1), 400, "top_p", None),
    ("top_p=1.01", C, completion_body(top_p=1.01), 400, "top_p", None),
    ("top_p=NaN", C, b'{"prompt": "hi", "top_p": NaN}', 400, "top_p", None),
    ("top_k=-2", C, completion_body(top_k=-2), 400, "top_k", None),
    ("top_k=2^40", C, completion_body(top_k=2**40), 400, "top_k", None),
    ("min_p=1.5", C, completion_body(min_p=1.5), 400, "min_p", None),
    ("presence_penalty=5", C, completion_body(presence_penalty=5), 400, "presence_penalty", None),
    ("n=2", C, completion_body(n=2), 400, "n", None),
    ("n=10^6", C, completion_body(n=10**6), 400, "n", None),
    ("best_of=3", C, completion_body(best_of=3), 400, "best_of", None),
    ("logprobs=5", C, completion_body(logprobs=5), 400, "logprobs", None),
    ("stop x17", C, completion_body(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("stop 300 chars", C, completion_body(stop=["x" * 300]), 400, "stop", None),
    ("stop empty string", C, completion_body(stop=[""]), 400, "stop", None),
    ("stop=5", C, completion_body(stop=5), 400, "stop", None),
    ("seed=2^64", C, completion_body(seed=2**64), 400, "seed", None),
    ("stream='yes'", C, completion_body(stream="yes"), 400, "stream", None),
    ("ignore_eos=1", C, completion_body(ignore_eos=1), 400, "ignore_eos", None),
    ("prompt ''", C, completion_body(prompt=""), 400, "prompt", None),
    ("prompt []", C, completion_body(prompt=[]), 400, "prompt", None),
    ("prompt missing", C, {"model": MODEL, "max_tokens": 4}, 400, "prompt", None),
    ("prompt=5", C, completion_body(prompt=5), 400, "prompt", None),
    ("prompt two strings", C, completion_body(prompt=["a", "b"]), 400, "prompt", None),
    ("prompt id out of vocab", C, completion_body(prompt=[1, 10**6]), 400, "prompt", None),
    ("prompt id negative", C, completion_body(prompt=[-1]), 400, "prompt", None),
    ("prompt too long", C, completion_body(prompt=LONG_TEXT), 400, "prompt", "context_length_exceeded"),
    ("prompt ids too long", C, completion_body(prompt=[5] * 200), 400, "prompt", "context_length_exceeded"),
    ("prompt ids == context", C, completion_body(prompt=[5] * 128), 400, "prompt", "context_length_exceeded"),
    ("lone surrogate", C, b'{"prompt": "\\ud800"}', 400, "prompt", None),
    ("invalid utf-8", C, b'{"prompt": "\xff\xfe"}', 400, None, None),
    ("invalid JSON", C, b'{"prompt": ', 400, None, None),
    ("JSON array body", C, b'["prompt"]', 400, None, None),
    ("JSON string body", C, b'"hello"', 400, None, None),
    ("empty body", C, b"", 400, None, None),
    ("nested 10000", C, b"[" * 10000 + b"]" * 10000, 400, None, None),
    ("nested 10000 in prompt", C, b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", 400, None, None),
    ("messages []", CH, {"model": MODEL, "messages": []}, 400, "messages", None),
    ("messages missing", CH, {"model": MODEL}, 400, "messages", None),
    ("messages not a list", CH, {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("content ''", CH, {"messages": [{"role": "user", "content": ""}]}, 400, "messages[0].content", None),
    ("content missing", CH, {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("content parts []", CH, {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content", None),
    ("content image part", CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", None),
    ("role robot", CH, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
    ("message not object", CH, {"messages": ["hi"]}, 400, "messages[0]", None),
    ("1025 messages", CH, {"messages": [{"role": "user", "content": "a"}] * 1025}, 400, "messages", None),
    ("chat lone surrogate", CH, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages[0].content", None),
    ("chat too long", CH, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, "messages",
     "context_length_exceeded"),
    ("unknown model", C, completion_body(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown model chat", CH, {"model": "nope", "messages": CHAT}, 404, "model", "model_not_found"),
    ("unknown drafter", C, completion_body(speculation={"method": "nosuch"}), 400, "speculation", None),
    ("bad ngram size", C, completion_body(speculation={"method": "ngram:0"}), 400, "speculation", None),
    ("speculation k=-1", C, completion_body(speculation={"k": -1}), 400, "speculation.k", None),
    ("speculation k=1000", C, completion_body(speculation={"k": 1000}), 400, "speculation.k", None),
    ("speculation policy", C, completion_body(speculation={"policy": "yolo"}), 400, "speculation.policy", None),
    ("speculation=5", C, completion_body(speculation=5), 400, "speculation", None),
    ("speculation verify=5", C, completion_body(speculation={"verify": 5}), 400, "speculation.verify", None),
    # issue 19 (1): integers too large for a float (JSON allows any number of digits) are a 400, not a 500
    *[(f"{name}=1e400 int", C, completion_body(**{name: sign * 10**400}), 400, name, None)
      for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p") for sign in (1, -1)],
    *[(f"{name}=1e400 int", C, completion_body(**{name: 10**400}), 400, name, None)
      for name in ("seed", "top_k", "max_tokens", "n", "best_of", "logprobs", "top_logprobs")],
    ("max_completion_tokens=1e400 int", CH, {"messages": CHAT, "max_completion_tokens": 10**400}, 400,
     "max_completion_tokens", None),
    ("speculation k=1e400 int", C, completion_body(speculation={"k": 10**400}), 400, "speculation.k", None),
    ("prompt id 1e400 int", C, completion_body(prompt=[10**400]), 400, "prompt", None),
    ("temperature=1e400 float", C, b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature", None),
    # issue 19 (3): falsy values of the wrong type are refused like any other
    ("logit_bias=0", C, completion_body(logit_bias=0), 400, "logit_bias", None),
    ("logit_bias=[]", C, completion_body(logit_bias=[]), 400, "logit_bias", None),
    ("logit_bias set", C, completion_body(logit_bias={"5": 10}), 400, "logit_bias", None),
    ("stream_options=0", C, completion_body(stream_options=0), 400, "stream_options", None),
    ("stream_options=''", C, completion_body(stream=True, stream_options=""), 400, "stream_options", None),
    ("include_usage=0", C, completion_body(stream_options={"include_usage": 0}), 400,
     "stream_options.include_usage", None),
    ("stream=0", C, completion_body(stream=0), 400, "stream", None),
    ("ignore_eos=0", C, completion_body(ignore_eos=0), 400, "ignore_eos", None),
    ("logprobs=false (completions)", C, completion_body(logprobs=False), 400, "logprobs", None),
    ("logprobs=0.0", C, completion_body(logprobs=0.0), 400, "logprobs", None),
    ("logprobs=0 (chat)", CH, {"messages": CHAT, "logprobs": 0}, 400, "logprobs", None),
    ("logprobs=true (chat)", CH, {"messages": CHAT, "logprobs": True}, 400, "logprobs", None),
    ("top_logprobs=2", CH, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("top_logprobs=false", CH, {"messages": CHAT, "top_logprobs": False}, 400, "top_logprobs", None),
    ("model=0", C, completion_body(model=0), 400, "model", None),
    # issue 19 (3): OpenAI parameters that change what a request means are refused, not ignored
    ("echo=true", C, completion_body(echo=True), 400, "echo", None),
    ("echo=0", C, completion_body(echo=0), 400, "echo", None),
    ("suffix", C, completion_body(suffix="}"), 400, "suffix", None),
    ("suffix=0", C, completion_body(suffix=0), 400, "suffix", None),
    ("response_format json_object", CH, {"messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", None),
    ("response_format json_schema", CH, {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400,
     "response_format", None),
    ("response_format='text'", CH, {"messages": CHAT, "response_format": "text"}, 400, "response_format", None),
    ("tool_choice required", CH, {"messages": CHAT, "tools": [TOOL], "tool_choice": "required"}, 400,
     "tool_choice", None),
    ("tool_choice named", CH, {"messages": CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, 400, "tool_choice", None),
    ("tool_choice required, no tools", CH, {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", None),
    ("tools, tool_choice auto", CH, {"messages": CHAT, "tools": [TOOL], "tool_choice": "auto"}, 400, "tools", None),
    ("tools, no tool_choice", CH, {"messages": CHAT, "tools": [TOOL]}, 400, "tools", None),
    ("tools=0", CH, {"messages": CHAT, "tools": 0}, 400, "tools", None),
    ("tool_choice=0", CH, {"messages": CHAT, "tool_choice": 0}, 400, "tool_choice", None),
    ("functions + function_call named", CH, {"messages": CHAT, "functions": [TOOL["function"]],
                                             "function_call": {"name": "get_time"}}, 400, "function_call", None),
    ("modalities audio", CH, {"messages": CHAT, "modalities": ["text", "audio"]}, 400, "modalities", None),
    ("audio", CH, {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio", None),
]


KNOWN_VALIDATION_BUGS: dict[str, str] = {}


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c[0], marks=[pytest.mark.xfail(strict=True, reason=KNOWN_VALIDATION_BUGS[c[0]])]
                 if c[0] in KNOWN_VALIDATION_BUGS else [])
    for c in VALIDATION
])
def test_validation(client, case):
    """D1-D3: each invalid request gets a 4xx with an OpenAI-shaped body (<= 4 KiB) naming the parameter, and
    the body never echoes the request."""
    _, path, body, status, param, code = case
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    err = assert_error(r, status, param=param, code=code)
    if status == 404:
        assert err["type"] == "not_found_error"
    else:
        assert err["type"] == "invalid_request_error"
    assert LONG_TEXT[:60] not in err["message"] and "x" * 100 not in err["message"]


def test_validation_is_fast_and_server_up_after(srv, client, model, ckpt):
    """D1/D3: rejecting n=10^6 / a 10000-deep body takes well under a second; afterwards the server answers a
    valid request with the right output ("server up")."""
    for body in (completion_body(n=10**6, best_of=10**6), b"[" * 10000 + b"]" * 10000):
        t0 = time.perf_counter()
        if isinstance(body, bytes):
            r = client.post(C, content=body, headers={"Content-Type": "application/json"})
        else:
            r = client.post(C, json=body)
        assert r.status_code == 400 and time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()
    r = client.post(C, json=completion_body(max_tokens=N, ignore_eos=True))
    assert r.status_code == 200 and time.perf_counter() - t0 < 5
    assert r.json()["choices"][0]["text"] == expected_completion(model, ckpt, PROMPT, N)
    assert wait_idle(srv.engine)
    srv.engine.check_invariants()


def test_max_tokens_omitted_default(client):
    """D2 / issue 19 (4): without max_tokens a completion gets OpenAI's 16 and a chat request the room left in the
    context up to the server's max_tokens_limit (2048 here, more than the 128 context); both capped by the room
    (>= 1), never a 400/negative."""
    r = client.post(C, json={"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True,
                             "speculation": "off"})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == ServeLimits.completion_max_tokens == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post(CH, json={"model": MODEL, "messages": CHAT, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 128 - r.json()["usage"]["prompt_tokens"]
    r = client.post(C, json={"model": MODEL, "prompt": [5] * 127, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_drafter_from_request_path_is_client_error(client, tmp_path):
    """D1/H5: a request naming a drafter checkpoint path that does not exist gets a 4xx, not a 500."""
    r = client.post(C, json=completion_body(speculation={"method": f"model:{tmp_path / 'no-such-dir'}"}))
    assert 400 <= r.status_code < 500, r.text
    assert_error(r, r.status_code)


def test_body_too_large_default_limit(client):
    """D3: a 5 MiB body against the default 4 MiB cap -> 413 (declared Content-Length, refused before reading)."""
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    try:
        r = client.post(C, content=big, headers={"Content-Type": "application/json"})
    except httpx.TransportError:  # the server may answer 413 and close before the whole body is sent
        r = None
    if r is not None:
        assert_error(r, 413, code="body_too_large")
    ok = client.post(C, json=completion_body(max_tokens=2))  # either way the server is still up
    assert ok.status_code == 200, ok.text


def test_body_too_large_small_limit(open_srv):
    """D3: over the configured cap (16 KiB) -> 413, both with a declared length and chunked (no length)."""
    body = json.dumps({"prompt": "a" * (20 << 10)}).encode()
    with open_srv.client(None) as c:
        assert_error(c.post(C, content=body, headers={"Content-Type": "application/json"}), 413,
                     code="body_too_large")

        def chunks():
            for i in range(0, len(body), 4096):
                yield body[i : i + 4096]

        assert_error(c.post(C, content=chunks(), headers={"Content-Type": "application/json"}), 413,
                     code="body_too_large")
        ok = c.post(C, json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200


# ---- 5. special-token injection (D4) --------------------------------------------------------------------------
def test_special_token_in_completion_prompt_is_text(client, ckpt, tokenizer):
    """D4: "<eos>" inside a completion prompt is encoded as plain text (never the EOS id) and the request works."""
    eos_id = tokenizer.eos_token_ids[0]
    prompt = "hello <eos> world"
    plain = Tokenizer.from_dir(ckpt).plain_text_copy().encode(prompt)
    assert eos_id not in plain and eos_id in Tokenizer.from_dir(ckpt).encode(prompt)  # the test can tell them apart
    r = client.post(C, json=completion_body(prompt=prompt, max_tokens=4, ignore_eos=True))
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(plain)
    r = client.post(C, json=completion_body(prompt="<eos>", max_tokens=4))
    assert r.status_code == 200


def test_special_token_in_chat_message_rejected(client):
    """D4: a chat message containing the EOS token string is refused with 400 (it could end the turn early)."""
    for content in ("hi <eos> there", [{"type": "text", "text": "<eo"}, {"type": "text", "text": "s>"}]):
        r = client.post(CH, json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
        assert_error(r, 400, param="messages[0].content")


# ---- 6. backpressure (E5) -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_srv(ckpt):
    state = build_state(ckpt, EngineConfig(max_running=1, max_queued=1), dtype="fp32", api_key=KEY)
    with running(state) as s:
        yield s


def long_body(stream: bool, max_tokens: int = 60) -> dict:
    return {"model": MODEL, "prompt": "The quick", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "speculation": "off"}


def test_backpressure_429(small_srv):
    """E5: max_running=1, max_queued=1: with one request running and one queued, the next gets 429 with
    Retry-After and an OpenAI-shaped body, fast; once load drops a new request succeeds."""
    eng = small_srv.engine
    rejected_before = eng.metrics.rejected
    a, b, c = small_srv.client(), small_srv.client(), small_srv.client()
    with slow_steps(eng, 0.01), a, b, c, a.stream("POST", C, json=long_body(True)) as ra:
        assert ra.status_code == 200
        lines_a = ra.iter_lines()
        next(lines_a)  # A is running
        with b.stream("POST", C, json=long_body(True)) as rb:
            assert rb.status_code == 200  # B is queued
            for stream in (False, True):
                t0 = time.perf_counter()
                rc = c.post(C, json=long_body(stream))
                assert time.perf_counter() - t0 < 0.5
                err = assert_error(rc, 429, type_="rate_limit_error")
                assert err["code"] == "queue_full"
                assert int(rc.headers["retry-after"]) >= 1
                assert_error(c.post(CH, json={"model": MODEL, "messages": CHAT}), 429)
            assert sum(1 for p in sse_events(rb)[:-1] if json.loads(p)["choices"][0]["text"]) >= 1
        assert list(lines_a)[-2:] == ["data: [DONE]", ""]
    assert eng.metrics.rejected - rejected_before == 4
    assert wait_idle(eng)
    with small_srv.client() as c:
        r = c.post(C, json=long_body(False, 8))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_backpressure_burst(small_srv):
    """E5: a burst of concurrent streaming requests: some get 429 (fast), every accepted one completes with the
    exact token count, and the engine returns to idle."""
    eng = small_srv.engine
    results: list[tuple[int, float, int | None]] = []
    barrier = threading.Barrier(6)

    def run() -> None:
        with small_srv.client() as c:
            barrier.wait()
            t0 = time.perf_counter()
            body = {**long_body(True, 20), "stream_options": {"include_usage": True}}
            with c.stream("POST", C, json=body) as r:
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    r.read()
                    assert_error(r, 429)
                    assert "retry-after" in r.headers
                    results.append((r.status_code, dt, None))
                    return
                chunks = [json.loads(p) for p in sse_events(r)[:-1]]
                results.append((200, dt, chunks[-1]["usage"]["completion_tokens"]))

    with slow_steps(eng, 0.01):
        threads = [threading.Thread(target=run) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(results) == 6
    rejected = [r for r in results if r[0] == 429]
    assert rejected and all(dt < 0.5 for _, dt, _ in rejected)
    assert all(n == 20 for s, _, n in results if s == 200)
    assert wait_idle(eng)
    with small_srv.client() as c:
        assert c.post(C, json=long_body(False, 4)).status_code == 200


def test_queued_non_stream_request_completes(small_srv):
    """E2/E5: a non-streaming request that waits in the queue (no output for > 0.5 s) still completes with
    all its tokens instead of being aborted."""
    eng = small_srv.engine
    out: dict = {}

    def run_b() -> None:
        with small_srv.client() as b:
            out["r"] = b.post(C, json=long_body(False, 8))

    a = small_srv.client()
    with slow_steps(eng, 0.015), a, a.stream("POST", C, json=long_body(True, 60)) as ra:  # ~1 s ahead of B
        lines_a = ra.iter_lines()
        next(lines_a)
        tb = threading.Thread(target=run_b)
        tb.start()
        assert list(lines_a)[-2:] == ["data: [DONE]", ""]
        tb.join(30)
    r = out["r"]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert wait_idle(eng)


def test_queued_stream_disconnect_never_starts(small_srv):
    """E2: a streaming request that disconnects while still queued is removed from the queue and never
    admitted (its prompt tokens are never counted), and the running request is unaffected."""
    eng = small_srv.engine
    assert wait_idle(eng)
    m0 = (eng.metrics.prompt_tokens, eng.metrics.finished.get("abort", 0), eng.metrics.finished.get("length", 0))
    with slow_steps(eng, 0.01), small_srv.client() as a, a.stream("POST", C, json=long_body(True, 60)) as ra:
        lines_a = ra.iter_lines()
        next(lines_a)
        prompt_after_a = eng.metrics.prompt_tokens
        with small_srv.client() as b, b.stream("POST", C, json=long_body(True, 60)) as rb:
            assert rb.status_code == 200
            deadline = time.monotonic() + 2
            while eng.num_waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert eng.num_waiting == 1
        deadline = time.monotonic() + 2
        while eng.num_waiting and time.monotonic() < deadline:
            time.sleep(0.005)
        assert eng.num_waiting == 0 and len(eng.running) == 1  # B left the queue while A still runs
        texts = [json.loads(x[6:])["choices"][0]["text"] for x in lines_a if x.startswith("data: {")]
    assert wait_idle(eng)
    assert eng.metrics.prompt_tokens == prompt_after_a
    assert eng.metrics.finished.get("abort", 0) - m0[1] == 1
    assert eng.metrics.finished.get("length", 0) - m0[2] == 1
    assert texts and eng.metrics.prompt_tokens > m0[0]


def test_request_cannot_load_arbitrary_checkpoint(srv, client, draft_ckpt):
    """H5/D1: a request cannot name a filesystem path for the server to load as a drafter model."""
    spec = f"model:{draft_ckpt}"
    r = client.post(C, json=completion_body(speculation={"method": spec}))
    assert spec not in srv.engine._drafters
    assert_error(r, 400, param="speculation")


# ---- 7. disconnects and cancellation (E1-E3) ------------------------------------------------------------------
def test_stream_disconnect_aborts(srv):
    """E1: streaming clients that disconnect after a few chunks are aborted: the engine is idle within a few
    seconds, reserved KV back to 0, running/waiting gauges 0, and the requests end as "abort"."""
    eng = srv.engine
    assert wait_idle(eng)
    aborted_before = eng.metrics.finished.get("abort", 0)
    gen_before = eng.metrics.generation_tokens
    with slow_steps(eng, 0.02):
        clients = [srv.client() for _ in range(4)]
        ctxs = [c.stream("POST", C, json=long_body(True, 100)) for c in clients]
        responses = [ctx.__enter__() for ctx in ctxs]
        for r in responses:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            while got < 3:
                if next(lines).startswith("data: "):
                    got += 1
        for ctx, c in zip(ctxs, clients, strict=False):
            ctx.__exit__(None, None, None)
            c.close()
        t0 = time.perf_counter()
        assert wait_idle(eng, 5.0), (len(eng.running), eng.num_waiting, eng.reserved_tokens)
        elapsed = time.perf_counter() - t0
    assert elapsed < 1.5  # 100 tokens at 20 ms per step would take 2 s: they were cut short
    assert eng.reserved_tokens == 0 and not eng.running
    assert eng.metrics.finished.get("abort", 0) - aborted_before == 4
    assert eng.metrics.generation_tokens - gen_before < 4 * 100
    with srv.client() as c:
        m = scrape(c)
    assert metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0
    assert metric(m, "kv_cache_usage_perc") == 0


def test_stream_response_aborts_however_it_ends():
    """A chat stream yields its role chunk before it enters the engine's stream; a client gone while that chunk is
    being sent (send raises) left the generator suspended there, its cleanup never ran, and the request decoded
    to max_tokens for nobody. The SSE response itself aborts its request however it ends."""
    from starlette.requests import ClientDisconnect

    aborted: list[str] = []
    state = type("State", (), {"engine": type("Eng", (), {"abort": lambda self, rid: aborted.append(rid)})()})()

    async def body():
        yield "data: {}\n\n"  # the role chunk
        aborted.append("reached the engine's stream")  # never: the client is gone

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("connection reset")

    async def receive():
        return {"type": "http.disconnect"}

    response = app_module._EngineStream(state, "chatcmpl-1", body(), media_type="text/event-stream")
    with pytest.raises(ClientDisconnect):
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert aborted == ["chatcmpl-1"]


def test_non_stream_client_timeout_aborts(srv):
    """E2: a non-streaming client that gives up (read timeout) while tokens are still being generated has its
    request aborted, not run to the end."""
    eng = srv.engine
    assert wait_idle(eng)
    aborted_before = eng.metrics.finished.get("abort", 0)
    length_before = eng.metrics.finished.get("length", 0)
    with slow_steps(eng, 0.025), srv.client(timeout=0.4) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post(C, json=long_body(False, 100))  # ~2.5 s of generation
        assert wait_idle(eng, 6.0)
    assert eng.metrics.finished.get("length", 0) == length_before
    assert eng.metrics.finished.get("abort", 0) - aborted_before == 1


def _python_engine(ckpt) -> AsyncEngine:
    target = load_model(ckpt, dtype="fp32")
    return AsyncEngine(Engine(target, Tokenizer.from_dir(ckpt), EngineConfig(drafter="ngram"))).start()


def test_async_generate_aclose_aborts(ckpt):
    """E3: closing the AsyncEngine.generate generator early (aclose), or cancelling the task consuming it,
    aborts the request: engine idle, no reserved KV, finish "abort"; a double abort is harmless."""
    aeng = _python_engine(ckpt)
    eng = aeng.engine
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    try:
        with slow_steps(eng, 0.02):

            async def main() -> None:
                gen = aeng.generate([5, 6, 7], params, RequestSpec(drafter="none"), request_id="r1")
                for _ in range(3):
                    out = await anext(gen)
                    assert not out.finished
                await gen.aclose()
                for _ in range(100):
                    if not eng.has_unfinished():
                        break
                    await asyncio.sleep(0.02)
                assert not eng.has_unfinished() and eng.reserved_tokens == 0
                assert eng.metrics.finished == {"abort": 1}

                async def consume() -> None:
                    async for _ in aeng.generate([5, 6, 7], params, request_id="r2"):
                        pass

                task = asyncio.create_task(consume())
                await asyncio.sleep(0.2)
                assert eng.running
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                aeng.abort("r2")  # idempotent: a second abort of a finished request is harmless
                aeng.abort("never-existed")
                for _ in range(100):
                    if not eng.has_unfinished():
                        break
                    await asyncio.sleep(0.02)
                assert not eng.has_unfinished() and eng.reserved_tokens == 0
                assert eng.metrics.finished == {"abort": 2}

            asyncio.run(main())
        assert aeng.alive
        eng.check_invariants()
    finally:
        aeng.shutdown()


def test_shutdown_answers_waiting_and_refuses_new_requests(ckpt):
    """A request waiting on an engine that shuts down gets an error instead of waiting forever, and one submitted
    after the shutdown is refused at once (the app turns that into a 503)."""
    aeng = _python_engine(ckpt)

    async def main():
        rid, queue = aeng.submit([1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True), RequestSpec())
        outputs = aeng.stream(rid, queue)
        await anext(outputs)  # running
        aeng.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in outputs:
                pass
        with pytest.raises(RuntimeError, match="shut down"):
            aeng.submit([1, 2, 3], SamplingParams(max_tokens=2), RequestSpec())

    asyncio.run(asyncio.wait_for(main(), 30))


# ---- C2: forced rejection, small KV pool ----------------------------------------------------------------------
def test_forced_rejection_no_kv_leak(ckpt, draft_ckpt, model):
    """C2/A3: a random drafter (~0 acceptance) and a KV budget that fits two requests: concurrent requests all
    succeed with the plain greedy output, and at idle no KV stays reserved."""
    n, prompt = 24, "class Point:"
    expected = expected_completion(model, ckpt, prompt, n)
    per_request = len(Tokenizer.from_dir(ckpt).plain_text_copy().encode(prompt)) + n + 4 + 1
    config = EngineConfig(max_running=4, max_queued=64, cache_budget_tokens=2 * per_request + 3,
                          drafter=f"model:{draft_ckpt}", k=4)
    state = build_state(ckpt, config, dtype="fp32", api_key=KEY)
    with running(state) as s:
        texts: list[str] = []
        peak = [0]

        def run() -> None:
            with s.client() as c:
                for _ in range(3):
                    r = c.post(C, json=completion_body(prompt=prompt, max_tokens=n, ignore_eos=True))
                    assert r.status_code == 200, r.text
                    texts.append(r.json()["choices"][0]["text"])
                    peak[0] = max(peak[0], len(s.engine.running))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert texts == [expected] * 12
        assert 1 <= peak[0] <= 2  # the KV budget admits two at a time
        assert wait_idle(s.engine)
        s.engine.check_invariants()
        m = s.engine.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens < m.num_draft_tokens / 2
        with s.client() as c:
            assert metric(scrape(c), "kv_cache_usage_perc") == 0


def test_preempted_streams_finish_with_the_plain_text(ckpt, draft_ckpt, model):
    """KV on demand through the server: a pool too small for four growing requests preempts some mid-stream; every
    streamed and non-streamed text is still plain greedy decoding's, /metrics counts the preemptions, and at idle
    the pool is empty."""
    n, prompt = 40, "class Point:"
    expected = expected_completion(model, ckpt, prompt, n)
    prompt_len = len(Tokenizer.from_dir(ckpt).plain_text_copy().encode(prompt))
    config = EngineConfig(max_running=4, max_queued=64, cache_budget_tokens=3 * (prompt_len + n) // 2, kv_block=4,
                          drafter=f"model:{draft_ckpt}", k=2)
    state = build_state(ckpt, config, dtype="fp32", api_key=KEY)
    with running(state) as s:
        texts: list[str] = []

        def run(stream: bool) -> None:
            with s.client() as c:
                for _ in range(2):
                    body = completion_body(prompt=prompt, max_tokens=n, ignore_eos=True)
                    if stream:
                        with c.stream("POST", C, json={**body, "stream": True}) as r:
                            assert r.status_code == 200
                            texts.append("".join(json.loads(p)["choices"][0]["text"] for p in sse_events(r)[:-1]))
                    else:
                        r = c.post(C, json=body)
                        assert r.status_code == 200, r.text
                        texts.append(r.json()["choices"][0]["text"])

        threads = [threading.Thread(target=run, args=(i % 2 == 0,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert texts == [expected] * 8
        assert wait_idle(s.engine)
        s.engine.check_invariants()
        with s.client() as c:
            samples = scrape(c)
        assert metric(samples, "num_preemptions_total") == s.engine.metrics.preemptions > 0
        assert metric(samples, "kv_cache_usage_perc") == 0


# ---- 8. health, readiness, metrics (G1, G3) -------------------------------------------------------------------
def test_health_and_ready(srv):
    """G1: /health is public; /ready needs the key and says ready once the warm-up generation went through."""
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{srv.url}/ready").status_code == 401
    with srv.client() as c:
        r = c.get("/ready")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        models = c.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert srv.state.ready and srv.state.engine.alive


def test_ready_503_when_engine_loop_dead(ckpt):
    """G1: /ready reports 503 when the engine loop has died (while /health stays 200 for the process)."""
    state = build_state(ckpt, EngineConfig(), dtype="fp32")
    with running(state) as s:
        state.engine.error = RuntimeError("injected")
        with s.client(None) as c:
            assert c.get("/ready").status_code == 503
            assert c.get("/health").status_code == 200
            assert c.post(C, json=completion_body(max_tokens=2)).status_code == 503
        state.engine.error = None


def test_metrics_parse_and_count(srv, client):
    """G3: /metrics parses with prometheus_client; counters are monotonic across a request; generation/prompt
    token counters grow by exactly that request's usage; gauges return to 0 at idle."""
    assert wait_idle(srv.engine)
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                 "generation_tokens", "request_success", "spec_decode_num_drafts"):
        assert f"verispec:{name}" in families
    assert families["verispec:generation_tokens"].type == "counter"
    assert families["verispec:num_requests_running"].type == "gauge"

    before = scrape(client)
    res = client.post(C, json=completion_body(max_tokens=13, ignore_eos=True)).json()
    assert wait_idle(srv.engine)
    after = scrape(client)
    counters = {k for k in before if k[0].endswith("_total")}
    assert counters
    for k in counters:
        assert after.get(k, 0) >= before[k], k
    usage = res["usage"]
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") == 13
    assert usage["completion_tokens"] == 13
    assert metric(after, "prompt_tokens_total") - metric(before, "prompt_tokens_total") == usage["prompt_tokens"]
    assert (metric(after, "request_success_total", finished_reason="length")
            - metric(before, "request_success_total", finished_reason="length")) == 1
    assert metric(after, "num_requests_running") == 0 and metric(after, "num_requests_waiting") == 0
    accepted = metric(after, "spec_decode_num_accepted_tokens_total")
    assert accepted <= metric(after, "spec_decode_num_draft_tokens_total")
    per_pos = sum(v for (n, _), v in after.items() if n == "verispec:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted


# ---- 9. security (H1-H4, D6) ----------------------------------------------------------------------------------
def _routes(srv) -> list[tuple[str, str]]:
    from starlette.routing import Route

    out = []
    for route in srv.app.app.router.routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    out.append((method, route.path))
    return out


def test_auth_on_every_route(srv):
    """H2: every registered route but /health answers 401 authentication_error without a key, with a wrong key,
    and with a near-miss of the right one; with the key none of them is a 401."""
    routes = _routes(srv)
    paths = {p for _, p in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/ready", "/health"} <= paths
    assert PUBLIC_ROUTES == {"/health"}
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                   {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": KEY}, {"Authorization": "Bearer"},
                   {"Authorization": f"Basic {KEY}"}, {"X-Api-Key": KEY}]
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for method, path in routes:
            body = completion_body(max_tokens=1) if method == "POST" else None
            for headers in bad_headers:
                r = c.request(method, path, json=body, headers=headers)
                if path in PUBLIC_ROUTES:
                    assert r.status_code == 200
                    continue
                assert_error(r, 401, type_="authentication_error")
                assert "www-authenticate" in r.headers
            ok = c.request(method, path, json=body, headers=AUTH)
            assert ok.status_code != 401
        # unknown paths need the key too (no route enumeration without it); with it they are OpenAI-shaped 404s
        assert_error(c.get("/v1/nope"), 401, type_="authentication_error")
        assert_error(c.post("/admin/abort"), 401)
        assert_error(c.get("/v1/nope", headers=AUTH), 404)
        assert_error(c.get("/v1/completions", headers=AUTH), 405)


def test_unauthenticated_large_body_is_401(srv):
    """H2/D3: the key is checked before the body is read."""
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post(C, content=b"{" + b" " * (64 << 10) + b"}", headers={"Content-Type": "application/json"})
    assert_error(r, 401, type_="authentication_error")


def test_no_key_server_is_open(open_srv):
    """H1: without an API key (loopback only) the routes answer without authentication."""
    with open_srv.client(None) as c:
        assert c.get("/ready").status_code == 200
        assert c.get("/v1/models").status_code == 200
        assert c.post(C, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_key_compare_is_constant_time(srv, monkeypatch):
    """H3: the key check goes through hmac.compare_digest (for both a right and a wrong key)."""
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", spy)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models", headers=AUTH).status_code == 200
    assert (b"nope", KEY.encode()) in calls and (KEY.encode(), KEY.encode()) in calls
    trees = [ast.parse((SRC / "serve" / name).read_text()) for name in ("guard.py", "app.py", "router.py")]
    compares = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in n.ops)
                and any(isinstance(x, ast.Attribute) and x.attr == "key" for x in [n.left, *n.comparators])]
    assert not compares, "the API key is compared with == somewhere"


def test_public_bind_without_key_refused(open_srv, monkeypatch):
    """H1: serve() refuses a non-loopback host without an API key before starting uvicorn; the default host is
    loopback."""
    import inspect

    started = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: started.append(kw))
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ConfigError):
            serve(open_srv.state, host=host)
    assert not started
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert is_loopback(host)
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    serve(open_srv.state)  # loopback without a key is allowed (uvicorn.run is stubbed)
    assert started and started[0]["host"] == "127.0.0.1"


def test_no_unsafe_deserialization_lint():
    """H4: no pickle/dill/marshal imports, torch.load, eval/exec, yaml.load or a non-sandboxed jinja2.Environment
    anywhere in src/verispec."""
    banned_modules = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
    banned_calls = {"eval", "exec", "compile", "__import__"}
    problems = []
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                problems += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in banned_modules]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned_modules:
                problems.append(f"{where} from {node.module} import")
            elif isinstance(node, ast.ImportFrom) and node.module == "jinja2":
                problems += [f"{where} from jinja2 import {a.name}" for a in node.names if a.name == "Environment"]
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in banned_calls:
                    problems.append(f"{where} {f.id}()")
                elif isinstance(f, ast.Attribute):
                    owner = f.value.id if isinstance(f.value, ast.Name) else None
                    if (owner, f.attr) in {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"),
                                           ("jinja2", "Environment"), ("np", "load"), ("numpy", "load")}:
                        kws = {k.arg: k.value for k in node.keywords}
                        if owner == "torch" and isinstance(kws.get("weights_only"), ast.Constant) and \
                                kws["weights_only"].value is True:
                            continue
                        if owner in ("np", "numpy") and not (isinstance(kws.get("allow_pickle"), ast.Constant)
                                                             and kws["allow_pickle"].value is True):
                            continue
                        problems.append(f"{where} {owner}.{f.attr}()")
    assert not problems, problems


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ messages[0].__class__ }}{{ self.__init__.__globals__ }}",
])
def test_chat_template_sandbox_blocks_internals(template):
    """D6: a checkpoint chat template reaching for Python internals fails closed: rendering raises SecurityError."""
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])


def test_chat_template_failure_is_closed_over_http(tmp_path, tokenizer):
    """D6: served from a checkpoint whose template touches internals, a chat request gets a generic OpenAI-shaped
    500 (no template internals in the body) and the server keeps answering completions."""
    path = tmp_path / "evil"
    save_model(tiny_model(vocab_size=tokenizer.vocab_size), path)
    tokenizer.save(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages.__class__.__mro__ }}"}))
    state = build_state(path, EngineConfig(drafter=None), dtype="fp32")

    async def main() -> None:
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        # a loopback Host: the server has no key, so it refuses other names (DNS rebinding)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            r = await c.post(CH, json={"messages": CHAT, "max_tokens": 2})
            err = assert_error(r, 500, type_="server_error")
            assert "__" not in err["message"] and "class" not in err["message"]
            r = await c.post(C, json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2

    try:
        asyncio.run(main())
    finally:
        state.engine.shutdown()


def test_chat_template_sandbox_blocks_mutation(ckpt, tmp_path):
    """D6: a template (read from tokenizer_config.json) that calls .append on the messages is refused."""
    from jinja2.exceptions import SecurityError

    d = tmp_path / "m"
    d.mkdir()
    template = "{% set _ = messages.append({'role': 'system', 'content': 'x'}) %}{{ messages | length }}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tpl = ChatTemplate.from_dir(d)
    assert tpl.source == template
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(SecurityError):
        tpl.render(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]
    ok = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    assert ok.render(msgs) == "<user>hi<assistant>"
