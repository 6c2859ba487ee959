"""KV on demand against reserving each request's whole cache at admission, at one KV pool (issue 22).

    python scripts/kv_pool.py --clients 32 --pool 4096 --repeats 3 --out reports/serve/kv_pool.md

In-process closed loop through the async engine (the server's engine thread, without HTTP): C clients, each
sending its next request (the last 600 characters of a code task prompt, ~150 tokens, greedy, plain decoding)
when the last one finishes. Two workloads: `fixed` (128 new tokens, ignore_eos: every request uses its whole
max_tokens) and `stops` (max_tokens 256, stopping at the first blank line: requests use a varying part of what
they may). Two arms at the same pool, interleaved per repeat: `on-demand` (caches grow by kv_block 64, the newest
request preempted when the pool runs short) and `reserve` (kv_block larger than any request: each cache is
prompt + max_tokens + a draft round from admission on, what the engine did before). Medians over repeats of
aggregate tokens/s, requests running per step, preemptions, recomputed tokens and the pool's peak use; every
output is checked against the first repeat's `reserve` arm.
"""

from __future__ import annotations

import argparse
import asyncio
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
WORKLOADS = {"fixed": SamplingParams(max_tokens=128, ignore_eos=True),
             "stops": SamplingParams(max_tokens=256, stop=["\n\n"], ignore_eos=True)}
ARMS = {"on-demand": 64, "reserve": 1 << 30}  # kv_block


async def closed_loop(aeng: AsyncEngine, prompts: list[list[int]], clients: int, per_client: int,
                      params: SamplingParams) -> tuple[float, dict[int, list[int]]]:
    outputs: dict[int, list[int]] = {}

    async def client(c: int) -> None:
        for j in range(per_client):
            i = (c * 7 + j) % len(prompts)
            toks: list[int] = []
            async for out in aeng.generate(prompts[i], params, RequestSpec(drafter="none")):
                toks += out.token_ids
            outputs[c * per_client + j] = toks

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - t0, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--pool", type=int, default=4096, help="KV pool, positions (EngineConfig.cache_budget_tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "reports/serve/kv_pool.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(ROOT / "zoo/target", dtype="bf16")
    tok = Tokenizer.from_dir(ROOT / "zoo/target")
    prompts = [tok.encode(r["prompt"][-600:]) for t in ("code_completion", "code_continuation") for r in load_task(t)]
    engines = {}
    for arm, block in ARMS.items():
        engine = Engine(target, tok, EngineConfig(drafter=None, max_running=args.clients, cache_budget_tokens=args.pool,
                                                  kv_block=block, prefix_cache_bytes=0))
        engines[arm] = (engine, AsyncEngine(engine).start())
    rows: dict[tuple[str, str], list[dict]] = {}
    reference: dict[str, dict[int, list[int]]] = {}
    try:
        for _, aeng in engines.values():
            asyncio.run(closed_loop(aeng, prompts, 2, 1, SamplingParams(max_tokens=8)))  # warm-up
        for rep in range(args.repeats):
            for work, params in WORKLOADS.items():
                for arm in (ARMS if rep % 2 == 0 else reversed(list(ARMS))):
                    engine, aeng = engines[arm]
                    m = engine.metrics
                    before = (m.num_steps, m.num_output_tokens, m.preemptions, m.recomputed_tokens)
                    running = []
                    step = engine.step

                    def counted(step=step, engine=engine, running=running):
                        out = step()
                        running.append(len(engine.running))
                        return out
                    engine.step = counted
                    m.peak_kv_tokens = 0
                    wall, outputs = asyncio.run(closed_loop(aeng, prompts, args.clients, args.per_client, params))
                    engine.step = step
                    ref = reference.setdefault(work, outputs)
                    row = {"tok_s": (m.num_output_tokens - before[1]) / wall, "steps": m.num_steps - before[0],
                           "running": statistics.fmean(running) if running else 0.0,
                           "preemptions": m.preemptions - before[2], "recomputed": m.recomputed_tokens - before[3],
                           "peak": m.peak_kv_tokens / args.pool, "equal": outputs == ref,
                           "out_tokens": statistics.fmean(len(o) for o in outputs.values())}
                    rows.setdefault((work, arm), []).append(row)
                    print(rep, work, arm, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                          flush=True)
    finally:
        for _, aeng in engines.values():
            aeng.shutdown()
    med = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "equal"} | {
        "equal": all(r["equal"] for r in rs)} for key, rs in rows.items()}
    out = ["# KV on demand vs whole-cache reservation (in-process engine, closed loop)", "",
           f"`python scripts/kv_pool.py --clients {args.clients} --per-client {args.per_client} --pool {args.pool} "
           f"--repeats {args.repeats}`: the zoo target in bf16, {args.threads} threads, plain decoding, ~150-token "
           f"code prompts, a pool of {args.pool} positions, medians of {args.repeats} interleaved repeats.", "",
           "| workload | arm | aggregate tok/s | running per step | new tokens per request | preemptions | "
           "recomputed tokens | pool peak | outputs equal |", "|---|---|---|---|---|---|---|---|---|"]
    for (work, arm), r in med.items():
        out.append(f"| {work} | {arm} | {r['tok_s']:.0f} | {r['running']:.1f} | {r['out_tokens']:.0f} | "
                   f"{r['preemptions']:.0f} | {r['recomputed']:.0f} | {r['peak']:.0%} | "
                   f"{'yes' if r['equal'] else 'NO'} |")
    for work in WORKLOADS:
        a, b = med.get((work, "on-demand")), med.get((work, "reserve"))
        if a and b:
            out.append(f"\n{work}: on-demand / reserve aggregate = {a['tok_s'] / b['tok_s']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
