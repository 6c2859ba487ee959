"""Memory soak of `verispec serve` (issue 19): rounds of concurrent streams, half the rounds with clients leaving
mid-stream, and the server's RSS after each round once the engine is idle; prints a markdown table.

    .venv/bin/python scripts/soak.py --target zoo/target --dtype bf16 --rounds 16 --concurrency 64
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/soak.py ...        # the child server inherits the environment

`--engine` drives the engine without HTTP (AsyncEngine in this process) and also prints, per round, the live
Python objects by type that grew and the number of live tensors: the engine's part of the growth, apart from
the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from verispec.bench.soak import (
    PROMPTS, TABLE_HEADER, RoundResult, engine_idle_over_http, rss_mb, run_round, table_row, wait_until,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def soak_server(args: argparse.Namespace) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "verispec", "serve", "--target", str(args.target), "--dtype", args.dtype,
           "--port", str(port), "--drafter", args.drafter]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                return httpx.get(f"{url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=300, what="the server to be ready")
        print(f"server pid {proc.pid}, RSS when ready {rss_mb(proc.pid):.1f} MiB")
        _rounds(args, lambda disconnect: asyncio.run(run_round(url, args.concurrency, max_tokens=args.max_tokens,
                                                               disconnect=disconnect)),
                lambda: wait_until(lambda: engine_idle_over_http(url), what="the engine to go idle"),
                lambda: rss_mb(proc.pid), None)
    finally:
        proc.terminate()
        proc.wait(30)


def soak_engine(args: argparse.Namespace) -> None:
    import torch

    from verispec.api import set_threads
    from verispec.config import EngineConfig, SamplingParams
    from verispec.engine.async_engine import AsyncEngine, release_free_memory
    from verispec.engine.engine import Engine
    from verispec.model.checkpoint import load_model
    from verispec.model.tokenizer import Tokenizer

    set_threads(args.threads)
    target = load_model(args.target, dtype=args.dtype)
    tok = Tokenizer.from_dir(args.target)
    config = EngineConfig(drafter=None if args.drafter == "none" else args.drafter)
    engine = AsyncEngine(Engine(target, tok, config), trim_when_idle=not args.no_trim)
    engine.start()
    prompts = [tok.encode(p) for p in PROMPTS]

    async def one(i: int, leave: bool, out: RoundResult) -> None:
        greedy = i % 2 == 0
        params = SamplingParams(max_tokens=1024 if leave else args.max_tokens, temperature=0.0 if greedy else 0.8,
                                seed=None if greedy else i)
        n = 0
        async for o in engine.generate(prompts[i % len(prompts)], params):
            n += 1
            if leave and n >= 2:
                out.left += 1
                return  # leaving the generator aborts the request
        out.completed += 1

    async def round_(disconnect: bool) -> RoundResult:
        out = RoundResult()
        await asyncio.gather(*(one(i, disconnect and i % 4 == 3, out) for i in range(args.concurrency)))
        return out

    before: collections.Counter = collections.Counter()

    def diagnose() -> str:
        nonlocal before
        gc.collect()
        objs = gc.get_objects()
        counts = collections.Counter(type(o).__name__ for o in objs)
        tensors = sum(1 for o in objs if isinstance(o, torch.Tensor))
        grown = [(k, counts[k] - before[k]) for k in counts if counts[k] - before[k] > 0]
        grown = sorted(grown, key=lambda kv: -kv[1])[:5]
        before = counts
        return f"objects {len(objs)}, tensors {tensors}, grew: {grown}"

    def idle() -> bool:
        try:
            engine.check_idle()
        except AssertionError:
            return False
        return True

    try:
        _rounds(args, lambda disconnect: asyncio.run(round_(disconnect)),
                lambda: (wait_until(idle, what="the engine to go idle"), engine.check_idle()), rss_mb, diagnose)
        before_trim = rss_mb()
        release_free_memory()
        print(f"after the last round: RSS {before_trim:.1f} MiB, after one malloc_trim(0) {rss_mb():.1f} MiB")
    finally:
        engine.shutdown()


def _rounds(args, run, wait_idle, rss, diagnose) -> None:
    print(TABLE_HEADER)
    first = prev = None
    t0 = time.perf_counter()
    for r in range(1, args.rounds + 1):
        disconnect = r % 2 == 0  # odd rounds: every client reads to the end; even rounds: a quarter leave
        res = run(disconnect)
        wait_idle()
        now = rss()
        first = now if first is None else first
        print(table_row(r, disconnect, res, now, first, now if prev is None else prev), flush=True)
        if diagnose is not None:
            print(f"  {diagnose()}", flush=True)
        prev = now
    print(f"{args.rounds} rounds x {args.concurrency} streams in {time.perf_counter() - t0:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=Path("zoo/target"))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--drafter", default="ngram", help="the server's default drafter spec (none: plain)")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of the clients that stay to the end")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--engine", action="store_true", help="drive the engine in-process, without HTTP")
    p.add_argument("--no-trim", action="store_true", help="--engine: no malloc_trim when the engine goes idle")
    args = p.parse_args()
    (soak_engine if args.engine else soak_server)(args)


if __name__ == "__main__":
    main()
