"""What the draft gate costs the dspark policy under open-loop load: plain, the dspark policy as it ships, and the
dspark policy with the gate forced to draft on every step, each at the same Poisson schedules (issue 22).

    python scripts/openloop_gate.py --rates 6,12 --duration 12 --repeats 3

In process on the async engine, as `verispec bench serve` runs its open loop (its prompts, 64 new tokens, greedy,
ignore_eos), with the bench's cached step profile. Arms run one after another within a repeat. Per arm and rate it
prints the per-user tokens/s and how many steps the gate kept plain; at the end, per rate, the gated arm's per-user
speed over the forced arm's, per repeat and as a median.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path

import torch

from verispec.bench import serve as bench
from verispec.bench.openloop import assess, poisson_arrivals
from verispec.config import EngineConfig, SamplingParams
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.profile import load_or_measure

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="6,12", help="offered request rates (req/s)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per rate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = bench.ServeBenchConfig(target=ROOT / "zoo/target")
    target = load_model(cfg.target, dtype="bf16")
    tokenizer = Tokenizer.from_dir(cfg.target)
    profile = load_or_measure(target, progress=False)
    prompts = bench._prompts(tokenizer, cfg.max_prompt_tokens, cfg.seed, cfg.min_prompt_tokens)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    ol = cfg.open_loop()
    rates = [float(r) for r in args.rates.split(",")]
    drafter = f"dspark:{ROOT / 'zoo/dspark'}"
    arms = {"plain": ("off", 0, None), "dspark": ("dspark", 8, drafter), "dspark, gate forced": ("dspark", 8, drafter)}
    speed: dict[tuple[str, float], list[float]] = {}
    for rep in range(args.repeats):
        for name, (policy, k, spec) in arms.items():
            engine = Engine(target, tokenizer, EngineConfig(policy=policy, k=k, drafter=spec, max_running=32),
                            profile=profile)
            if name.endswith("forced"):
                engine.gate.draft = lambda requests, clean=True: True
            aeng = AsyncEngine(engine).start()
            try:
                asyncio.run(bench._closed(aeng, prompts[:2], 2, 2, SamplingParams(max_tokens=8)))  # warm-up
                for rate in rates:
                    arrivals = poisson_arrivals(rate, args.duration, random.Random(f"{ol.seed}:{rate}"))
                    undrafted, steps = engine.metrics.undrafted_steps, engine.metrics.num_steps
                    res = assess(rate, asyncio.run(bench._open_loop(aeng, prompts, arrivals, params)), ol)
                    speed.setdefault((name, rate), []).append(res.per_user_tokens_per_s)
                    print(f"repeat {rep} {name:20s} {rate:4g} req/s: per user {res.per_user_tokens_per_s:6.1f} tok/s, "
                          f"sustained {res.sustained}, steps kept plain {engine.metrics.undrafted_steps - undrafted} "
                          f"of {engine.metrics.num_steps - steps}", flush=True)
            finally:
                aeng.shutdown()
    for rate in rates:
        ratios = [g / f for g, f in zip(speed[("dspark", rate)], speed[("dspark, gate forced", rate)])]
        print(f"{rate:g} req/s: dspark / dspark with the gate forced to draft: "
              f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
