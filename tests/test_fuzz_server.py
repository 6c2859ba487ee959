"""Schemathesis over the server's own /openapi.json (issue 19), in process over ASGI on a tiny random model.

For both POST routes, schema-valid (positive) and schema-violating (negative) bodies, seeded: no 5xx and no hang
(each call has a deadline), every 400 OpenAI-shaped with `error.param` naming a field of the body, every response
conforming to the documented schema, every schema-invalid body refused; a good request still succeeds afterwards
and the engine is left empty. VERISPEC_FUZZ_EXAMPLES scales the run (scripts/fuzz.sh runs a longer one).
"""

from __future__ import annotations

import os
import re
import time

import jsonschema_rs
import pytest
import schemathesis
from conftest import make_tokenizer, tiny_model
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from verispec.config import EngineConfig
from verispec.model import save_model
from verispec.serve.app import create_app
from verispec.serve.server import build_state

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
EXAMPLES = int(os.environ.get("VERISPEC_FUZZ_EXAMPLES", "50"))  # per route and mode: a few seconds
CALL_TIMEOUT_S = 30  # a request slower than this is a hang
# Statuses the guard answers before a body is read (key, size, content type, Host): no field is at fault.
NO_PARAM_CODES = {"invalid_json", "invalid_api_key", "body_too_large", "unsupported_media_type", "body_timeout"}
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "negative_data_rejection")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(state, ASGI app) on a tiny fp32 checkpoint: ngram by default, ngram:2 and self-drafting on request."""
    tokenizer = make_tokenizer()
    path = tmp_path_factory.mktemp("fuzz") / "target"
    save_model(tiny_model(vocab_size=tokenizer.vocab_size), path)
    tokenizer.save(path)
    config = EngineConfig(max_running=4, max_queued=16, cache_budget_tokens=4096, drafter="ngram", k=4)
    state = build_state(path, config, dtype="fp32", api_key=KEY, drafters=("ngram:2", "model"))
    yield state, without_lifespan(create_app(state))
    state.engine.shutdown()


def without_lifespan(app):
    """The app, declining ASGI lifespan: schemathesis ends lifespans after each test, and the app's shutdown stops
    the engine this module shares (the fixture owns its lifetime; the warm-up only sets /ready)."""

    async def asgi(scope, receive, send):
        if scope["type"] == "lifespan":
            raise RuntimeError("no lifespan")  # before any message: how an app says it has none
        await app(scope, receive, send)

    return asgi


@pytest.fixture(scope="module")
def api(served):
    return schemathesis.openapi.from_asgi("/openapi.json", served[1], headers=AUTH)


@pytest.fixture
def client(served) -> TestClient:
    return TestClient(served[1], base_url="http://127.0.0.1")


def body_schema(doc: dict, path: str) -> dict:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def check_refusal(response, body, fields: set[str]) -> None:
    """No 5xx; a 4xx is OpenAI-shaped, and a 400 names the field at fault (its top-level name is a body field)."""
    assert response.status_code < 500, f"{response.status_code} for {body!r}: {response.text[:300]}"
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    if response.status_code == 400 and error["code"] not in NO_PARAM_CODES:
        param = error["param"]
        assert isinstance(param, str) and re.split(r"[.\[]", param)[0] in fields, (
            f"400 without a body field in param ({param!r}) for {body!r}: {error['message']}")


def good_request_succeeds(served, api) -> None:
    """After a fuzz batch: a plain request still gets a completion, and the engine holds nothing."""
    case = api[ROUTES["completions"]]["POST"].Case(body={"prompt": "def add(a, b):", "max_tokens": 4,
                                                         "temperature": 0})
    response = case.call(headers=AUTH, timeout=CALL_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    engine = served[0].engine.engine
    deadline = time.monotonic() + 5  # aborted requests are dropped on the engine's next step
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished() and not engine.running and not engine.waiting


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_fuzz_route(served, api, route, mode):
    """A seeded schemathesis batch against one route: see the module docstring for what each case must hold."""
    operation = api[ROUTES[route]]["POST"]
    fields = set(operation.definition.raw["requestBody"]["content"]["application/json"]["schema"]["properties"])
    checks = [getattr(schemathesis.checks, name) for name in CHECKS]

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def fuzz(case):
        response = case.call(headers=AUTH, timeout=CALL_TIMEOUT_S)
        check_refusal(response, case.body, fields)
        case.validate_response(response, checks=checks, headers=AUTH)

    fuzz()
    good_request_succeeds(served, api)


def test_openapi_is_served_behind_the_key(client):
    assert client.get("/openapi.json").status_code == 401
    response = client.get("/openapi.json", headers=AUTH)
    assert response.status_code == 200
    assert client.get("/health").status_code == 200  # still the one public route


def test_openapi_describes_both_bodies(client, served):
    """Both request bodies are in the schema with the fields protocol.py reads, and example bodies the server
    accepts validate against them (the documentation matches the behaviour for these)."""
    doc = client.get("/openapi.json", headers=AUTH).json()
    sampling = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                "ignore_eos", "n", "best_of", "presence_penalty", "frequency_penalty", "min_p", "logprobs",
                "logit_bias", "speculation"}
    good = {
        "completions": [{"prompt": "def add(a, b):", "max_tokens": 3},
                        {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "seed": 1},
                        {"prompt": ["x = 1"], "max_tokens": 2, "stop": ["\n"], "echo": False,
                         "speculation": {"method": "ngram:2", "k": 3}},
                        {"prompt": [[1, 2]], "max_tokens": 2, "speculation": "off", "model": served[0].model_name}],
        "chat": [{"messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 3},
                 {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                               {"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
                  "speculation": {"method": "model", "k": "auto"}, "response_format": {"type": "text"}}],
    }
    for route, path in ROUTES.items():
        schema = body_schema(doc, path)
        required = "messages" if route == "chat" else "prompt"
        assert schema["required"] == [required] and sampling <= set(schema["properties"])
        validator = jsonschema_rs.validator_for(schema)
        for body in good[route]:
            assert validator.is_valid(body), body
            response = client.post(path, json=body, headers=AUTH)
            assert response.status_code == 200, (body, response.text)
        assert not validator.is_valid({required: None})
        assert "4XX" in doc["paths"][path]["post"]["responses"]
