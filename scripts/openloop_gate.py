"""What the draft gate costs the dspark policy under open-loop load: plain, the dspark policy as it ships, the
dspark policy with the gate forced to draft on every step, with the gate never drafting (what carrying the drafter
costs on its own), with the gate deciding each step at its own request count alone (`unwindowed`: the gate before
its `peak`, engine/gate.py), with drafting resumed on one kept anchor row (`resume1`: before
Engine.RESUME_ROWS), and with drafted steps averaged by the tokens they committed rather than expected (`realized`:
the gate before its calibrated expectation), each at the same Poisson schedules (issue 22).

    python scripts/openloop_gate.py --rates 6,12 --duration 12 --repeats 3 [--arms plain,dspark,unwindowed]

In process on the async engine, as `verispec bench serve` runs its open loop (its prompts, 64 new tokens, greedy,
ignore_eos), with the bench's cached step profile. Within a repeat the arms take each rate in turn, their order
rotated by one every rate and repeat. Per arm and rate it prints the per-user tokens/s and how many steps the gate
kept plain; at the end, per rate, each arm's per-user speed over plain's (and the gated arm's over the forced,
unwindowed, resume1 and realized arms'), per repeat and as a median, and each arm's share of steps kept plain.
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
from verispec.engine.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.profile import load_or_measure

ROOT = Path(__file__).resolve().parents[1]


def setup(threads: int):
    """The bench's open-loop inputs: its config, the bf16 zoo target with its tokenizer and cached step profile, and
    the open loop's prompts (64-384 tokens)."""
    torch.set_num_threads(threads)
    cfg = bench.ServeBenchConfig(target=ROOT / "zoo/target")
    target = load_model(cfg.target, dtype="bf16")
    tokenizer = Tokenizer.from_dir(cfg.target)
    profile = load_or_measure(target, progress=False)
    return cfg, target, tokenizer, profile, bench._prompts(tokenizer, cfg.max_prompt_tokens, cfg.seed,
                                                           cfg.min_prompt_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="6,12", help="offered request rates (req/s)")
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per rate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default="plain,dspark,forced",
                    help="comma-separated: plain, dspark, forced, undrafted, unwindowed, resume1, realized")
    args = ap.parse_args()
    cfg, target, tokenizer, profile, prompts = setup(args.threads)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    ol = cfg.open_loop()
    rates = [float(r) for r in args.rates.split(",")]
    drafter = f"dspark:{ROOT / 'zoo/dspark'}"
    known = {"plain": ("off", 0, None), "dspark": ("dspark", 8, drafter), "forced": ("dspark", 8, drafter),
             "undrafted": ("dspark", 8, drafter), "unwindowed": ("dspark", 8, drafter),
             "resume1": ("dspark", 8, drafter), "realized": ("dspark", 8, drafter)}
    names = args.arms.split(",")
    if unknown := [n for n in names if n not in known]:
        ap.error(f"unknown arms {unknown}: choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        ap.error("each arm once: the ratios pair each arm's repeats with plain's")
    speed: dict[tuple[str, float], list[float]] = {}
    kept: dict[tuple[str, float], list[float]] = {}  # the share of steps the gate kept plain, per repeat
    for rep in range(args.repeats):
        # Each arm's engine (its gate, its drafters) lives through the repeat; the arms take each rate in turn, their
        # order rotated by one each rate and repeat, on one loop thread at a time (as `verispec bench serve` runs):
        # arms a whole repeat's rates apart read the host's phases, not each other.
        engines = {}
        for name in names:
            policy, k, spec = known[name]
            engine = Engine(target, tokenizer, EngineConfig(policy=policy, k=k, drafter=spec, max_running=32),
                            profile=profile)
            if name in ("forced", "undrafted"):
                engine.gate.draft = lambda requests, clean=True, peak=None, drafts=name == "forced": drafts
            if name == "unwindowed":  # no step is held below a recent peak: the gate before its window
                engine.gate.peak = lambda requests: 0
            if name == "resume1":
                engine.RESUME_ROWS = 1
            if name == "realized":  # drafted steps averaged by the tokens they committed, as before the expectation
                engine.gate.record = lambda *a, expected=None, record=engine.gate.record, **k: record(*a, **k)
            with bench._running(engine) as aeng:
                asyncio.run(bench._closed(aeng, prompts[:2], 2, 2, SamplingParams(max_tokens=8)))  # warm-up
            engines[name] = engine
        for i, rate in enumerate(rates):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                engine = engines[name]
                arrivals = poisson_arrivals(rate, args.duration, random.Random(f"{ol.seed}:{rate}"))
                undrafted, steps = engine.metrics.undrafted_steps, engine.metrics.num_steps
                with bench._running(engine) as aeng:
                    res = assess(rate, asyncio.run(bench._open_loop(aeng, prompts, arrivals, params)), ol)
                speed.setdefault((name, rate), []).append(res.per_user_tokens_per_s)
                kept.setdefault((name, rate), []).append(
                    (engine.metrics.undrafted_steps - undrafted) / max(engine.metrics.num_steps - steps, 1))
                print(f"repeat {rep} {name:20s} {rate:4g} req/s: per user {res.per_user_tokens_per_s:6.1f} tok/s, "
                      f"sustained {res.sustained}, steps kept plain {engine.metrics.undrafted_steps - undrafted} "
                      f"of {engine.metrics.num_steps - steps}", flush=True)
    pairs = [(a, "plain") for a in names if a != "plain" and "plain" in names]
    pairs += [("dspark", b) for b in ("forced", "unwindowed", "resume1", "realized") if {"dspark", b} <= set(names)]
    for rate in rates:
        for name in names:
            if name != "plain":
                print(f"{rate:g} req/s: {name} kept plain {', '.join(f'{x:.0%}' for x in kept[(name, rate)])} of "
                      f"the steps (median {statistics.median(kept[(name, rate)]):.0%})")
        for a, b in pairs:
            ratios = [x / y for x, y in zip(speed[(a, rate)], speed[(b, rate)])]
            print(f"{rate:g} req/s: {a} / {b}: {', '.join(f'{r:.2f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
