"""Issue 19's server defects, each against a real uvicorn server on loopback (the harness of test_server.py).

Keep-alive after a bad number, per-server limits (max_tokens cap, KV cache budget, body-read deadline), the
Host / Origin / Content-Type guard, HEAD probes and no trailing-slash redirects. Parameter-typing cases live in
test_server.py's VALIDATION table.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import httpx
import pytest
from test_server import (  # noqa: F401 - fixtures are used by name
    AUTH,
    C,
    CH,
    CHAT,
    KEY,
    MODEL,
    _profile_cache,
    _quiet_reraise,
    assert_error,
    ckpt,
    completion_body,
    running,
    srv,
)

from verispec.cli import build_parser
from verispec.config import EngineConfig
from verispec.errors import ConfigError
from verispec.serve.protocol import ServeLimits, parse_sampling
from verispec.serve.server import build_state

BUDGET, LIMIT = 40, 30  # tight_srv: KV positions over all requests, and --max-tokens-limit
DRAFT_SLOTS = 4 + 1  # ngram drafter, k=4: the drafts and the bonus token


@pytest.fixture(scope="module")
def tight_srv(ckpt):  # noqa: F811
    """No API key, a 40-position KV budget, max_tokens_limit 30 and a 0.5 s body deadline."""
    config = EngineConfig(max_running=2, max_queued=4, cache_budget_tokens=BUDGET, drafter="ngram", k=4)
    limits = ServeLimits(max_tokens_limit=LIMIT, body_timeout_s=0.5)
    with running(build_state(ckpt, config, dtype="fp32", limits=limits)) as s:
        yield s


def _post(conn: http.client.HTTPConnection, body: dict) -> tuple[int, dict]:
    conn.request("POST", C, body=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


# ---- (1) a number too large for a float -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"])
def test_huge_integer_float_field_is_400_and_keeps_connection(srv, name):  # noqa: F811
    """Issue 19 (1): `1` followed by 400 zeros in a float field is a 400 naming it (not an OverflowError 500), and
    the keep-alive connection survives: the next request goes over the same socket."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        status, body = _post(conn, completion_body(**{name: 10**400}))
        assert status == 400 and body["error"]["param"] == name, body
        assert "0" * 30 not in body["error"]["message"]  # the number is not echoed
        sock = conn.sock
        assert sock is not None  # http.client drops the socket when the server said Connection: close
        status, body = _post(conn, completion_body(max_tokens=2))
        assert status == 200 and conn.sock is sock
    finally:
        conn.close()


# ---- (3) default-valued parameters still pass -------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {"logit_bias": {}}, {"logit_bias": None}, {"stream_options": None}, {"logprobs": 0}, {"logprobs": None},
    {"top_logprobs": 0}, {"echo": False}, {"suffix": ""}, {"suffix": None},
], ids=json.dumps)
def test_default_valued_parameters_accepted_completions(srv, extra):  # noqa: F811
    """Issue 19 (3): strict typing still accepts each parameter's default value of the right type."""
    with srv.client() as c:
        r = c.post(C, json=completion_body(max_tokens=2, **extra))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra", [
    {"logprobs": False}, {"top_logprobs": 0}, {"response_format": {"type": "text"}},
    {"tools": [], "tool_choice": "auto"}, {"tool_choice": "none"},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
    {"modalities": ["text"]}, {"stream_options": {"include_usage": False}},
], ids=json.dumps)
def test_default_valued_parameters_accepted_chat(srv, extra):  # noqa: F811
    """Issue 19 (3): tools are accepted only with tool_choice "none" (the model never sees or calls them)."""
    with srv.client() as c:
        r = c.post(CH, json={"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text


# ---- (4) max_tokens: a server cap and bounded defaults ----------------------------------------------------------
def test_max_tokens_limit(tight_srv):
    """Issue 19 (4): an explicit max_tokens over --max-tokens-limit is a 400 naming the parameter the client
    used; at the limit it runs; a chat request without max_tokens gets at most the limit (here less: what the KV
    budget leaves it)."""
    with tight_srv.client(None) as c:
        err = assert_error(c.post(C, json=completion_body(prompt=[5] * 4, max_tokens=LIMIT + 1)), 400,
                           param="max_tokens")
        assert str(LIMIT) in err["message"]
        r = c.post(CH, json={"messages": CHAT, "max_completion_tokens": LIMIT + 1})
        assert_error(r, 400, param="max_completion_tokens")
        r = c.post(C, json=completion_body(prompt=[5] * 4, max_tokens=LIMIT, ignore_eos=True, speculation="off"))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LIMIT
        r = c.post(CH, json={"messages": CHAT, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == min(LIMIT, BUDGET - usage["prompt_tokens"] - DRAFT_SLOTS)
    args = build_parser().parse_args(["serve"])  # the CLI's defaults are the config's
    assert args.max_tokens_limit == ServeLimits.max_tokens_limit
    assert args.body_timeout == ServeLimits.body_timeout_s


def test_max_tokens_defaults_are_bounded():
    """Issue 19 (4): the omitted-max_tokens defaults, below the server: completions min(16, limit), chat the limit,
    each capped by the room in the context and by what the KV budget leaves (never below 1)."""
    def default(chat: bool, limit: int, prompt_len: int = 10, fits: int | None = None) -> int:
        limits = ServeLimits(max_tokens_limit=limit)
        return parse_sampling({}, prompt_len, 128, 320, chat=chat, limits=limits, fits=fits).max_tokens

    assert default(False, 2048) == ServeLimits.completion_max_tokens == 16
    assert default(False, 7) == 7 and default(True, 7) == 7
    assert default(True, 2048) == 118 and default(True, 2048, prompt_len=127) == 1
    assert default(True, 2048, fits=50) == 50 and default(False, 2048, fits=-3) == 1
    with pytest.raises(ConfigError):
        ServeLimits(body_timeout_s=0)


# ---- (6) the KV cache budget refusal names max_tokens -----------------------------------------------------------
def test_cache_budget_error_names_max_tokens(tight_srv):
    """Issue 19 (6): a request needing more KV than the whole budget is a 400 with param max_tokens saying how
    many fit (and that many run); a prompt that cannot fit at all names the prompt."""
    fits = BUDGET - 10 - DRAFT_SLOTS
    with tight_srv.client(None) as c:
        err = assert_error(c.post(C, json=completion_body(prompt=[5] * 10, max_tokens=fits + 1)), 400,
                           param="max_tokens")
        assert f"at most {fits} new tokens fit" in err["message"]
        r = c.post(C, json=completion_body(prompt=[5] * 10, max_tokens=fits, ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == fits
        r = c.post(C, json=completion_body(prompt=[5] * 10, max_tokens=fits + 1, speculation="off"))
        assert r.status_code == 200, r.text  # without drafts one slot, not five, sits beside the tokens
        assert_error(c.post(C, json=completion_body(prompt=[5] * (BUDGET - 4), max_tokens=1)), 400, param="prompt")


# ---- (6) a stalled upload ---------------------------------------------------------------------------------------
def test_stalled_body_gets_408(tight_srv):
    """Issue 19 (6): a body that stops arriving is answered 408 after the configured deadline (0.5 s here) and the
    connection is closed; the server keeps serving."""
    with socket.create_connection(("127.0.0.1", tight_srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        data = b""
        while not data.endswith(b"}") or b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - t0
        assert s.recv(4096) == b""  # closed after the 408
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert 0.4 < elapsed < 5
    with tight_srv.client(None) as c:
        assert c.post(C, json=completion_body(max_tokens=2)).status_code == 200


# ---- (5) Host, Origin and Content-Type ---------------------------------------------------------------------------
LOOPBACK_HOSTS = ["localhost", "LocalHost:8000", "127.0.0.1", "127.5.6.7:80", "[::1]", "[::1]:8000"]
FOREIGN_HOSTS = ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example", "[::2]",
                 "::1", "[::1]x", "localhost:http", "0.0.0.0", "192.168.1.10:8000"]


def test_keyless_server_answers_only_loopback_hosts(tight_srv, srv):  # noqa: F811
    """Issue 19 (5): DNS rebinding: a keyless server refuses a Host that is not a loopback name (421, before any
    route runs, public routes included); a server with an API key accepts any Host."""
    with tight_srv.client(None) as c:
        for host in LOOPBACK_HOSTS:
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in FOREIGN_HOSTS:
            for method, path in (("GET", "/health"), ("POST", C)):
                r = c.request(method, path, json=completion_body(max_tokens=1), headers={"Host": host})
                assert_error(r, 421, code="invalid_host")
    with srv.client() as c:
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 200
        assert c.post(C, json=completion_body(max_tokens=1), headers={"Host": "evil.example:8000"}).status_code == 200


def test_keyless_server_refuses_cross_origin(tight_srv, srv):  # noqa: F811
    """Issue 19 (5): a keyless server refuses a browser request from a page that is not on this machine's loopback
    (403); same-machine pages and clients without Origin pass; with an API key the key decides."""
    with tight_srv.client(None) as c:
        for origin in ("http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"):
            r = c.post(C, json=completion_body(max_tokens=1), headers={"Origin": origin})
            assert r.status_code == 200, origin
        for origin in ("https://evil.example", "null", "http://localhost.evil.example", "file://", "http://[::1"):
            r = c.post(C, json=completion_body(max_tokens=1), headers={"Origin": origin})
            assert_error(r, 403, code="cross_origin", type_="permission_error")
    with srv.client() as c:
        assert c.post(C, json=completion_body(max_tokens=1), headers={"Origin": "https://evil.example"}).status_code \
            == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx", "json"])
def test_json_routes_refuse_other_content_types(srv, content_type):  # noqa: F811
    """Issue 19 (5): JSON routes answer 415 to a body that is not declared JSON (what a cross-site form or
    text/plain fetch sends without a preflight; `curl -d` without -H sends a form type too)."""
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for path, body in ((C, completion_body(max_tokens=1)), (CH, {"messages": CHAT, "max_tokens": 1})):
            r = c.post(path, content=json.dumps(body).encode(), headers=headers)
            err = assert_error(r, 415, code="unsupported_media_type")
            assert "application/json" in err["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_routes_accept_json_content_types(srv, content_type):  # noqa: F811
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(C, content=json.dumps(completion_body(max_tokens=1)).encode(),
                   headers={**AUTH, "Content-Type": content_type})
    assert r.status_code == 200, r.text


# ---- (6) HEAD probes, trailing slashes ---------------------------------------------------------------------------
def test_head_health_and_ready(srv):  # noqa: F811
    """Issue 19 (6): HEAD /health is 200 with no body (public); HEAD /ready is 200 with the key, 401 without."""
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.head("/health")
        assert r.status_code == 200 and r.content == b""
        assert c.head("/ready", headers=AUTH).status_code == 200
        assert c.head("/ready").status_code == 401


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"),
                                         ("GET", "/v1/models/"), ("GET", "/health/")])
def test_trailing_slash_is_404_not_redirect(srv, method, path):  # noqa: F811
    """Issue 19 (6): a trailing slash is an OpenAI-shaped 404, never a 307 redirect a client would follow."""
    with httpx.Client(base_url=srv.url, timeout=10, follow_redirects=False) as c:
        r = c.request(method, path, json=completion_body(max_tokens=1) if method == "POST" else None,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert "location" not in r.headers
    assert_error(r, 404, type_="not_found_error")
