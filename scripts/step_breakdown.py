"""Where an engine step's time goes at 1, 8, 32 and 64 concurrent requests (issue 22), plain and dspark.

    python scripts/step_breakdown.py --clients 1,8,32,64 --out reports/serve-compare/breakdown.md

In-process closed loop through the async engine (the server's engine thread, without HTTP): C clients, each
sending its next request (the last 600 characters of a code task prompt, 48 new tokens, greedy) when the last
one finishes. The engine's own phases are timed by wrapping them: drafting, the dspark cut, the target's packed
forward, verification, committing (stop checks, drafter accept, outputs); "other" is the rest of a step
(admission, batching, the drafters' observe), and "between steps" the loop thread's time outside `step`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from verispec.bench.prompts import load_task
from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("_draft", "_schedule", "forward", "_verify", "_commit")


def timed_engine(engine: Engine, totals: dict[str, float]) -> None:
    def wrap(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                totals[key] += time.perf_counter() - t0
        setattr(obj, name, run)

    for name in ("_draft", "_schedule", "_verify", "_commit", "step"):
        wrap(engine, name, name)
    wrap(engine.target, "forward_packed", "forward")


ARMS = ("plain", "dspark", "dspark-undrafted", "dspark-forced", "dspark-no-backoff", "dspark-capped", "fixed-8",
        "plain-no-prefix-cache")


def arm_engine(target, arm: str) -> Engine:
    """A fresh engine for one arm: plain, or the dspark policy with the zoo's DSpark drafter and its draft gate
    as it ships, never drafting (what carrying the drafter costs on its own), always drafting (what drafting
    itself delivers at each load), without the gate's probe backoff, or with its drafts capped as a draft model's
    are; or fixed k = 8 with the same drafter."""
    if arm.startswith("plain"):
        return Engine(target, None, EngineConfig(drafter=None, max_running=64,
                                                 **({"prefix_cache_bytes": 0} if arm == "plain-no-prefix-cache"
                                                    else {})))
    engine = Engine(target, None, EngineConfig(drafter=f"dspark:{ROOT / 'zoo/dspark'}",
                                               policy="fixed" if arm == "fixed-8" else "dspark", k=8, max_running=64))
    if arm == "dspark-capped":  # its drafts capped at two past what the last round verified, as for a draft model
        drafter = engine.drafter(engine.config.drafter)
        drafter.capabilities = dataclasses.replace(drafter.capabilities, one_pass=False)
    if arm == "dspark-undrafted":
        engine.gate.draft = lambda requests, clean=True, peak=None: False
    if arm == "dspark-no-backoff":  # probes spaced by probe_cost alone, as before the gate's backoff
        engine.gate.max_backoff = 1
    if arm == "dspark-forced":
        engine.gate.draft = lambda requests, clean=True, peak=None: True
    return engine


async def closed_loop(aeng: AsyncEngine, prompts: list[list[int]], clients: int, per_client: int,
                      vary: bool = False) -> float:
    """Seconds for `clients` closed-loop clients to send `per_client` requests each: 48 new tokens, or with `vary`
    40-56 (so that clients do not finish together), greedy, ignore_eos."""

    async def client(c: int) -> None:
        for j in range(per_client):
            params = SamplingParams(max_tokens=40 + (c * 7 + j * 5) % 17 if vary else 48, temperature=0.0,
                                    ignore_eos=True)
            async for _ in aeng.generate(prompts[(c * 7 + j) % len(prompts)], params, RequestSpec()):
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="plain,dspark",
                    help="plain, dspark, dspark-undrafted (the gate never drafts), dspark-forced (it always drafts), "
                         "dspark-no-backoff (the gate's probes without backoff), plain-no-prefix-cache")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/serve-compare/breakdown.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(ROOT / "zoo/target", dtype="bf16")
    tok = Tokenizer.from_dir(ROOT / "zoo/target")
    prompts = [tok.encode(r["prompt"][-600:]) for t in ("code_completion", "code_continuation") for r in load_task(t)]
    rows = []
    for arm in (a for a in ARMS if a in args.arms.split(",")):
        engine = arm_engine(target, arm)
        totals = {k: 0.0 for k in (*PHASES, "step")}
        timed_engine(engine, totals)
        aeng = AsyncEngine(engine).start()
        try:
            asyncio.run(closed_loop(aeng, prompts, 1, 2))  # warm-up (and the gate's first measurements)
            for c in [int(x) for x in args.clients.split(",")]:
                for k in totals:
                    totals[k] = 0.0
                steps0, tokens0 = engine.metrics.num_steps, engine.metrics.num_output_tokens
                undrafted0 = engine.metrics.undrafted_steps
                wall = asyncio.run(closed_loop(aeng, prompts, c, max(2, args.requests // c)))
                steps = engine.metrics.num_steps - steps0
                tokens = engine.metrics.num_output_tokens - tokens0
                ms = {k: 1e3 * v / max(steps, 1) for k, v in totals.items()}
                other = ms["step"] - sum(ms[p] for p in PHASES)
                between = 1e3 * wall / max(steps, 1) - ms["step"]
                undrafted = (engine.metrics.undrafted_steps - undrafted0) / max(steps, 1)
                rows.append((arm, c, tokens / wall, steps, ms, other, between, undrafted))
                print(arm, c, f"{tokens / wall:.0f} tok/s", {k: round(v, 2) for k, v in ms.items()}, flush=True)
        finally:
            aeng.shutdown()
    out = ["# Engine step breakdown (ms per step, in-process async engine, closed loop)", "",
           f"`python scripts/step_breakdown.py --clients {args.clients} --requests {args.requests}`: the zoo target in "
           f"bf16, {args.threads} threads, 48 new tokens, ~150-token code prompts.", "",
           "| arm | clients | tok/s | steps | drafting | dspark cut | target forward | verify | commit | other in step "
           "| between steps | undrafted steps |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, c, rate, steps, ms, other, between, undrafted in rows:
        out.append(f"| {arm} | {c} | {rate:.0f} | {steps} | {ms['_draft']:.2f} | {ms['_schedule']:.2f} | "
                   f"{ms['forward']:.2f} | {ms['_verify']:.2f} | {ms['_commit']:.2f} | {other:.2f} | {between:.2f} | "
                   f"{undrafted:.0%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
