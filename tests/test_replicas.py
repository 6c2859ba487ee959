"""`verispec serve --replicas N`: the router in front of N worker processes (serve.routing, serve.replicas,
serve.router), against real workers started with the command the CLI builds.

Pure parts first (least-loaded choice, leases across restarts, the metrics merge), then one module-scoped router
with 2 workers on loopback: requests spread over both, greedy output equals `decode` (non-streaming and SSE), the
API key guards every route, and a worker killed mid-request is restarted while its requests end with a clear
error instead of hanging.
"""

from __future__ import annotations

import asyncio
import importlib.util
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from conftest import tiny_model
from prometheus_client.parser import text_string_to_metric_families

import verispec.cli as cli
from verispec.config import SamplingParams
from verispec.decode import decode
from verispec.model import load_model, save_model
from verispec.model.tokenizer import Tokenizer
from verispec.serve.replicas import Replica, ReplicaConfig, ReplicaSet
from verispec.serve.router import REPLICA_HEADER, create_router_app, merge_metrics
from verispec.serve.routing import least_loaded

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "class Point:\n", "naïve café"]
N = 16
LONG = 1800  # tokens of a request still decoding when its worker is stopped (~0.2 ms each, plain, on the tiny model)
SRC = Path(__file__).resolve().parents[1] / "src"


# ---- pure parts ------------------------------------------------------------------------------------------------
def test_least_loaded_picks_fewest_in_flight_skipping_unready():
    assert least_loaded([2, None, 1, 1], start=3) == 3
    assert least_loaded([2, None, 1, 1], start=0) == 2
    assert least_loaded([0, 0], start=1) == 1
    assert least_loaded([None, None]) is None
    assert least_loaded([]) is None
    assert least_loaded([5, 0, 3]) == 1


def _set(n: int) -> ReplicaSet:
    rs = ReplicaSet(["true"], ReplicaConfig(replicas=n))
    for r in rs.replicas:
        r.ready = True
    return rs


def test_acquire_spreads_ties_round_robin_and_counts_load():
    rs = _set(3)
    picks = [rs.acquire().replica.index for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert [r.in_flight for r in rs.replicas] == [2, 2, 2]
    rs.replicas[1].ready = False
    assert {rs.acquire().replica.index for _ in range(2)} == {0, 2}


def test_lease_from_a_dead_generation_does_not_touch_the_new_process():
    rs = _set(2)
    lease = rs.acquire()
    r: Replica = lease.replica
    rs._died(r, -9, now=0.0)  # the process died: its in-flight count goes with it
    assert (r.in_flight, r.generation, r.restarts, r.ready) == (0, 1, 1, False)
    r.ready = True
    fresh = rs.acquire()
    assert fresh.replica is r or rs.replicas[1 - r.index].in_flight == 1
    before = r.in_flight
    rs.release(lease)  # late release of the old request
    assert r.in_flight == before


def test_restart_backoff_doubles_on_failed_starts_and_resets_once_ready():
    rs = ReplicaSet(["true"], ReplicaConfig(replicas=1, restart_backoff_s=0.5, max_restart_backoff_s=3))
    r = rs.replicas[0]
    delays = []
    for _ in range(5):  # never became ready
        rs._died(r, 1, now=100.0)
        delays.append(r.restart_at - 100.0)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    r.failed_starts, r.ready = 0, True  # what a passing /ready does
    rs._died(r, -9, now=100.0)
    assert r.restart_at - 100.0 == 0.5


def test_merge_metrics_labels_each_replica_and_keeps_families_contiguous():
    text = ('# HELP verispec:x_total X.\n# TYPE verispec:x_total counter\nverispec:x_total 3\n'
            '# HELP verispec:y Y.\n# TYPE verispec:y gauge\nverispec:y{position="0"} 0.5\n')
    merged = merge_metrics({0: text, 1: text.replace(" 3\n", " 4\n")})
    samples = [s for f in text_string_to_metric_families(merged) for s in f.samples]
    assert {s.labels["replica"]: s.value for s in samples if s.name == "verispec:x_total"} == {"0": 3, "1": 4}
    assert {(s.labels["replica"], s.labels["position"]) for s in samples if s.name == "verispec:y"} == {
        ("0", "0"), ("1", "0")}
    assert merge_metrics({}) == ""


def test_replica_config_is_validated():
    from verispec.errors import ConfigError

    for bad in (dict(replicas=0), dict(health_failures=0), dict(poll_s=0)):
        with pytest.raises(ConfigError):
            ReplicaConfig(**bad)


# ---- the CLI's worker command ----------------------------------------------------------------------------------
def _cli_worker_command(monkeypatch, ckpt: Path) -> tuple[list[str], ReplicaConfig, dict]:
    import verispec.serve.launch as launch

    seen = {}

    def fake(command, config, host, port, **kw):
        seen.update(command=command, config=config, host=host, port=port, **kw)

    monkeypatch.setattr(launch, "serve_replicas", fake)
    argv = ["serve", "--replicas", "2", "--target", str(ckpt), "--dtype", "fp32", "--threads", "1",
            "--api-key", KEY, "--k", "4", "--max-running", "8", "--port", "0"]
    assert cli.main(argv) == 0
    return seen["command"], seen["config"], seen


def test_cli_builds_a_loopback_worker_command_without_the_key(monkeypatch, ckpt):
    command, config, seen = _cli_worker_command(monkeypatch, ckpt)
    assert config.replicas == 2 and seen["api_key"] == KEY
    assert KEY not in command  # the workers get their own key, in their environment
    args = cli.build_parser().parse_args(command[3:] + ["--port", "1"])  # after `python -m verispec`
    assert (args.host, args.target, args.dtype, args.threads, args.k, args.replicas) == (
        "127.0.0.1", ckpt, "fp32", 1, 4, 0)
    assert args.api_key is None


def test_cli_refuses_ray_without_replicas_and_negative_replicas(capsys):
    assert cli.main(["serve", "--ray"]) == 2
    assert cli.main(["serve", "--replicas", "-1"]) == 2
    assert "--replicas" in capsys.readouterr().err


# ---- a live router with 2 workers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer) -> Path:
    """A tiny fp32 checkpoint with a long context, so a request can still be decoding when its worker dies."""
    path = tmp_path_factory.mktemp("ckpt") / "target"
    save_model(tiny_model(vocab_size=tokenizer.vocab_size, max_position_embeddings=2048), path)
    tokenizer.save(path)
    return path


def expected(ckpt: Path, prompt: str, n: int) -> str:
    tok = Tokenizer.from_dir(ckpt)
    res = decode(load_model(ckpt, dtype="fp32"), tok.plain_text_copy().encode(prompt),
                 SamplingParams(max_tokens=n, ignore_eos=True), tokenizer=tok)
    return res.text


class Router:
    """The router app on a free loopback port, in a daemon thread (its lifespan starts and stops the workers)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = create_router_app(replicas, KEY)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http="h11",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> Router:
        self.thread.start()
        self.wait_ready(lambda rs: all(r["ready"] for r in rs))
        return self

    def wait_ready(self, cond, timeout: float = 120.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/ready", headers=AUTH, timeout=5)
                if r.status_code in (200, 503) and cond(r.json()["replicas"]):
                    return r.json()["replicas"]
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("replicas not in the expected state")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def router(ckpt):
    mp = pytest.MonkeyPatch()
    try:
        command, _, _ = _cli_worker_command(mp, ckpt)
    finally:
        mp.undo()
    # The user cache is shared (an empty one would make every worker compile the native kernels first).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    rs = ReplicaSet(command, ReplicaConfig(replicas=2, health_period_s=0.5, health_timeout_s=2.0, health_failures=3),
                    env=env)
    srv = Router(rs).start()
    yield srv
    srv.stop()
    assert all(r.process is None or r.process.poll() is not None for r in rs.replicas), "workers left running"


def complete(url: str, prompt: str, n: int = N, stream: bool = False, timeout: float = 60) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    if n == LONG:
        body["speculation"] = "off"  # plain decoding: the slowest, so the request is still running when stopped
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=timeout)


def sse_text(raw: str) -> tuple[str, list[dict], bool]:
    events = [e[len("data: "):] for e in raw.strip().split("\n\n") if e.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(o["choices"][0]["text"] for o in objs if o.get("choices")), objs, done


def test_requests_spread_over_both_replicas_and_equal_decode(router, ckpt):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: complete(router.url, p), PROMPTS * 2))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert {r.headers[REPLICA_HEADER] for r in responses} == {"0", "1"}
    for prompt, r in zip(PROMPTS * 2, responses):
        assert r.json()["choices"][0]["text"] == expected(ckpt, prompt, N)
    # sequential requests on an idle fleet spread too (ties go round-robin)
    assert {complete(router.url, PROMPTS[0]).headers[REPLICA_HEADER] for _ in range(4)} == {"0", "1"}


def test_streaming_is_relayed_and_equals_the_non_streaming_output(router, ckpt):
    r = complete(router.url, PROMPTS[0], stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    text, objs, done = sse_text(r.text)
    assert done and text == expected(ckpt, PROMPTS[0], N)
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


def test_api_key_guards_every_route_but_health(router, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    paths = [("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("GET", "/openapi.json"), ("GET", "/no/such/route")]
    for method, path in paths:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, router.url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
    assert calls, "the key is compared with hmac.compare_digest"
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{router.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"] == "target"


def _metric(router, name: str) -> float:
    """The sum over replicas of one metric."""
    text = httpx.get(f"{router.url}/metrics", headers=AUTH, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _running(router) -> float:
    return _metric(router, "verispec:num_requests_running")


def test_a_client_leaving_mid_stream_aborts_the_request_on_its_replica(router):
    """The router closes its upstream stream when its client goes, and the replica aborts the request (no
    request decodes to max_tokens for nobody)."""
    body = {"prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
            "speculation": "off"}
    before = _metric(router, "verispec:generation_tokens_total")
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        next(r.iter_raw())  # the stream has started; leave
    deadline = time.monotonic() + 10
    while _running(router) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(router) == 0
    assert _metric(router, "verispec:generation_tokens_total") - before < LONG  # stopped early, not finished
    assert all(r["in_flight"] == 0 for r in router.wait_ready(lambda rs: True))


def test_metrics_label_every_replica(router):
    complete(router.url, PROMPTS[0])
    text = httpx.get(f"{router.url}/metrics", headers=AUTH, timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def replicas(name: str) -> set[str]:
        return {s.labels["replica"] for s in samples if s.name == name}

    assert replicas("verispec:replica_ready") == replicas("verispec:generation_tokens_total") == {"0", "1"}


def test_a_killed_replica_fails_its_requests_clearly_and_is_restarted(router, ckpt):
    """A worker frozen (SIGSTOP) under a live SSE stream and a non-streaming request, then killed: the stream ends
    with an error event, the request gets 502 replica_failed, a request on the other worker completes, and the
    worker comes back with a new process."""
    before = router.wait_ready(lambda rs: all(r["ready"] for r in rs))
    chunks: list[str] = []
    frozen = threading.Event()
    victim: list[int] = []

    def stream() -> None:
        body = {"prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
                "speculation": "off"}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            victim.append(int(r.headers[REPLICA_HEADER]))
            for chunk in r.iter_text():
                if not frozen.is_set():  # freeze it mid-stream, from this thread: no wake-up latency
                    os.kill(router.replicas.replicas[victim[0]].pid, signal.SIGSTOP)
                    frozen.set()
                chunks.append(chunk)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        fut_stream = pool.submit(stream)
        assert frozen.wait(30)
        i = victim[0]
        # least-loaded puts the first of these on the other worker, the second (a tie) beside the stream
        futs = [pool.submit(complete, router.url, p, LONG) for p in PROMPTS[2:4]]
        router.wait_ready(lambda rs: rs[i]["in_flight"] == 2, timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the supervisor may have killed the frozen worker first
            os.kill(before[i]["pid"], signal.SIGKILL)
        fut_stream.result(timeout=60)
        responses = [f.result(timeout=120) for f in futs]
    assert time.monotonic() - t0 < 120
    _, objs, done = sse_text("".join(chunks))
    assert not done and objs[-1]["error"]["code"] == "replica_failed", objs[-1]
    assert 0 < sum(len(o["choices"]) for o in objs[:-1]) < LONG  # it was cut mid-stream
    by_status = sorted(responses, key=lambda r: r.status_code)
    assert [r.status_code for r in by_status] == [200, 502]
    assert by_status[0].headers[REPLICA_HEADER] == str(1 - i)
    assert by_status[0].json()["usage"]["completion_tokens"] == LONG
    assert by_status[1].json()["error"]["code"] == "replica_failed"
    after = router.wait_ready(lambda rs: rs[i]["restarts"] == before[i]["restarts"] + 1 and all(r["ready"] for r in rs))
    assert after[i]["pid"] != before[i]["pid"] and after[i]["in_flight"] == 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda p: complete(router.url, p), PROMPTS))
    assert {r.headers[REPLICA_HEADER] for r in again} == {"0", "1"}
    assert [r.json()["choices"][0]["text"] for r in again] == [expected(ckpt, p, N) for p in PROMPTS]


def test_a_wedged_replica_is_killed_and_restarted(router):
    """A worker that stops answering /ready (frozen: a wedged engine looks the same) is killed after 3 failed
    polls and started again; the router keeps serving from the other one meanwhile."""
    before = router.wait_ready(lambda rs: all(r["ready"] for r in rs))
    os.kill(before[0]["pid"], signal.SIGSTOP)
    during = complete(router.url, PROMPTS[0])  # whichever worker it lands on, the request must not hang
    assert during.status_code in (200, 502)
    after = router.wait_ready(lambda rs: rs[0]["restarts"] == before[0]["restarts"] + 1 and rs[0]["ready"])
    assert after[0]["pid"] != before[0]["pid"] and after[1]["pid"] == before[1]["pid"]


def test_no_ready_replica_is_a_503_with_retry_after():
    rs = ReplicaSet(["true"], ReplicaConfig(replicas=1))  # never started: nothing ready
    app = create_router_app(rs, KEY)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.post("/v1/completions", json={"prompt": "x"}, headers=AUTH)

    r = asyncio.run(go())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_replica_ready"


# ---- the Ray Serve application (the `ray` extra) ---------------------------------------------------------------
HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = [pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra (pip install 'verispec[ray]'): Ray Serve"),
             pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # Ray's own pydantic v1-style fields


@pytest.fixture(scope="module")
def ray_url(ckpt):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from verispec.config import EngineConfig
    from verispec.serve.ray_app import RayServeConfig, start

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = RayServeConfig(target=str(ckpt), engine=EngineConfig(max_running=8, drafter="ngram", k=4), replicas=2,
                             dtype="fp32", api_key=KEY, threads=1, num_cpus=1, health_check_period_s=1.0)
        start(cfg, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_actor(unique_id: str):
    import ray

    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(unique_id))
    return ray.get_actor(name, namespace="serve")


@needs_ray[0]
@needs_ray[1]
def test_ray_replicas_spread_stream_guard_and_equal_decode(ray_url, ckpt):
    seen: set[str] = set()
    # Ray's router picks by sampled queue lengths: one burst of 8 can land on one replica (seen once in a full
    # suite run on 2 busy cores), three bursts in a row cannot plausibly unless routing never spreads
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda p: complete(ray_url, p), PROMPTS * 2))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        assert [r.json()["choices"][0]["text"] for r in responses] == [expected(ckpt, p, N) for p in PROMPTS * 2]
        seen |= {r.headers[REPLICA_HEADER] for r in responses}
        if len(seen) == 2:
            break
    assert len(seen) == 2
    r = complete(ray_url, PROMPTS[0], stream=True)
    text, _, done = sse_text(r.text)
    assert r.headers["content-type"].startswith("text/event-stream") and done and text == expected(ckpt, PROMPTS[0], N)
    for path in ("/v1/models", "/ready", "/metrics"):
        assert httpx.get(ray_url + path, timeout=10).status_code == 401
    assert httpx.get(ray_url + "/health", timeout=10).status_code == 200


@needs_ray[0]
@needs_ray[1]
def test_ray_killed_replica_fails_its_stream_clearly_and_is_replaced(ray_url, ckpt):
    import ray

    chunks: list[str] = []
    frozen = threading.Event()
    served_by: list[str] = []

    def stream() -> None:
        body = {"prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
                "speculation": "off"}
        with httpx.stream("POST", f"{ray_url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            served_by.append(r.headers[REPLICA_HEADER])
            for chunk in r.iter_text():
                if not frozen.is_set():
                    ray.kill(_replica_actor(served_by[0]))
                    frozen.set()
                chunks.append(chunk)

    t0 = time.monotonic()
    try:
        stream()
    except httpx.HTTPError as e:  # Ray's proxy may cut the stream instead of ending it with an error event
        chunks.append(f"data: {json.dumps({'error': {'code': type(e).__name__}})}\n\n")
    assert time.monotonic() - t0 < 60
    _, objs, done = sse_text("".join(chunks))
    assert not done and "error" in objs[-1], objs[-1]
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    while time.monotonic() < deadline and (len(seen) < 2 or served_by[0] in seen):
        seen = {complete(ray_url, p).headers.get(REPLICA_HEADER, "") for p in PROMPTS * 2}
        time.sleep(0.5)
    assert served_by[0] not in seen and len(seen) == 2, (served_by, seen)
