"""Memory under churn (issue 19): rounds of concurrent streaming requests against a server on loopback, some
clients leaving mid-stream, and the server's RSS once the engine is idle again after each round.

Used by `scripts/soak.py` (the long run, the server in a child process) and `tests/test_soak.py` (a short one,
the server in-process). The mix per round: completions and chat, greedy and seeded sampling (a per-request
torch.Generator), short requests that finish and requests without `max_tokens` (the largest KV reservation)
whose clients disconnect after a few chunks (`leave_max_tokens`, a large KV reservation).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "import os\nimport sys\n\ndef main():\n    args = sys.argv[1:]\n",
)


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size (VmRSS) of a process in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


@dataclass
class RoundResult:
    completed: int = 0  # streams read to [DONE]
    left: int = 0  # clients that disconnected mid-stream
    errors: int = 0  # anything else (non-200, a stream without [DONE])
    first_error: str = ""

    def error(self, what: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or what[:300]


def _body(i: int, max_tokens: int, leave_max_tokens: int | None, drafters: tuple[str | None, ...]) -> tuple[str, dict]:
    """Request i of a round: (route, body); a leaving client asks for `leave_max_tokens` (large, so a large cache).
    Request i names drafter `drafters[i % len(drafters)]` (None: the server's default)."""
    prompt = PROMPTS[i % len(PROMPTS)]
    chat = i % 3 == 1
    body: dict = {"stream": True}
    drafter = drafters[i % len(drafters)] if drafters else None
    if drafter is not None:
        body["speculation"] = {"method": drafter}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens if leave_max_tokens is None else leave_max_tokens
    if i % 2:  # seeded sampling: a torch.Generator per request
        body.update(temperature=0.8, seed=i)
    else:
        body["temperature"] = 0
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def _stream(client: httpx.AsyncClient, route: str, body: dict, leave_after: int | None, out: RoundResult) -> None:
    chunks = 0
    try:
        async with client.stream("POST", route, json=body) as resp:
            if resp.status_code != 200:
                out.error(f"{resp.status_code}: {(await resp.aread()).decode(errors='replace')}")
                return
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    out.completed += 1
                    return
                if line.startswith("data: "):
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        out.left += 1  # closing the unread response drops the connection: a disconnect
                        return
                    if '"error"' in line and "error" in json.loads(line[6:]):
                        out.error(line)
                        return
        out.error("the stream ended without [DONE]")
    except httpx.HTTPError as e:
        out.error(repr(e))


async def run_round(
    base_url: str, concurrency: int, *, max_tokens: int = 32, disconnect: bool = True, leave_max_tokens: int = 1024,
    drafters: tuple[str | None, ...] = (), headers: dict | None = None, timeout: float = 600.0,
) -> RoundResult:
    """One round: `concurrency` concurrent streams; with `disconnect`, every fourth client leaves after 2 chunks."""
    out = RoundResult()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as client:
        jobs = []
        for i in range(concurrency):
            leave = disconnect and i % 4 == 3
            route, body = _body(i, max_tokens, leave_max_tokens if leave else None, drafters)
            jobs.append(_stream(client, route, body, 2 if leave else None, out))
        await asyncio.gather(*jobs)
    return out


def wait_until(condition, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll `condition()` (no fixed sleeps: a short back-off) until it holds; raise TimeoutError after `timeout`."""
    deadline, pause = time.monotonic() + timeout, 0.001
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def engine_idle_over_http(base_url: str, headers: dict | None = None) -> bool:
    """The server's /metrics says no request is running or waiting and no KV cache is reserved."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return all(values.get(f"verispec:{n}", 1.0) == 0.0
               for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))


def table_row(index: int, disconnect: bool, res: RoundResult, rss: float, first: float, prev: float) -> str:
    return (f"| {index:>5} | {'yes' if disconnect else 'no':>10} | {res.completed:>9} | {res.left:>4} | "
            f"{res.errors:>6} | {rss:>8.1f} | {rss - prev:>+7.1f} | {rss - first:>+9.1f} |")


TABLE_HEADER = ("| round | disconnect | completed | left | errors | RSS MiB | Δ round | Δ round 1 |\n"
                "|------:|-----------:|----------:|-----:|-------:|--------:|--------:|----------:|")

