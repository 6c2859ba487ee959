"""Engine arms on a deterministic schedule (issue 22): the synchronous engine, one request joining every N steps
(the bench's open-loop prompts, 64 new tokens, greedy, ignore_eos), so that arms which take the same steps (plain
and the dspark policy whose gate never drafts) run identical steps and their wall times differ only by what each
arm carries. No wall-clock arrivals, no event loop: a few percent shows here that an open loop's queueing hides.

    python scripts/engine_replay.py --every 3 --requests 60 --repeats 12 --arms plain,undrafted

Arms (step_breakdown.py's engines): plain (no drafter); undrafted (the dspark policy with the zoo's DSpark drafter,
its gate never drafting); undrafted-nohidden (the same, the forward asked for no hidden states, so the drafter
observes none); dspark (the gate as it ships); forced (it always drafts). Arm order rotates every repeat; each
arm's time over plain's, per repeat and as a median. With the default schedule about 20 requests decode at once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from step_breakdown import arm_engine as breakdown_engine  # scripts/ is on sys.path when this script runs

from verispec.bench import serve as bench
from verispec.config import RequestSpec, SamplingParams
from verispec.engine.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
# this script's arms -> step_breakdown.py's engines (undrafted-nohidden: that engine, its forward without hidden rows)
ENGINES = {"plain": "plain", "undrafted": "dspark-undrafted", "undrafted-nohidden": "dspark-undrafted",
           "dspark": "dspark", "forced": "dspark-forced"}
ARMS = tuple(ENGINES)


def arm_engine(target, arm: str) -> Engine:
    engine = breakdown_engine(target, ENGINES[arm])
    if arm == "undrafted-nohidden":
        engine.target = _NoHidden(engine.target, engine.target.forward_packed)
    return engine


class _NoHidden:
    """The target with forward_packed asked for no hidden layers; everything else passed through."""

    def __init__(self, target, forward) -> None:
        self._target, self._forward = target, forward

    def forward_packed(self, tokens, batch, logit_rows, hidden_layers=()):
        return self._forward(tokens, batch, logit_rows, ())

    def __getattr__(self, name):
        return getattr(self._target, name)


def replay(engine: Engine, prompts: list[list[int]], every: int, requests: int) -> tuple[float, int]:
    """Seconds and steps to serve `requests` requests, one added before every `every`-th step."""
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    added = steps = 0
    t0 = time.perf_counter()
    while added < requests or engine.has_unfinished():
        if added < requests and steps % every == 0:
            engine.add_request(prompts[added % len(prompts)], params, RequestSpec(), request_id=str(added))
            added += 1
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=3, help="steps between arrivals")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--arms", default="plain,undrafted", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    names = args.arms.split(",")
    if unknown := [n for n in names if n not in ARMS]:
        ap.error(f"unknown arms {unknown}: choose from {', '.join(ARMS)}")
    if len(set(names)) != len(names):
        ap.error("each arm once: the ratios pair each arm's repeats with plain's")
    if "plain" not in names:
        ap.error("the arms must include plain (the reference)")
    torch.set_num_threads(args.threads)
    target = load_model(ROOT / "zoo/target", dtype="bf16")
    tokenizer = Tokenizer.from_dir(ROOT / "zoo/target")
    cfg = bench.ServeBenchConfig(target=ROOT / "zoo/target")
    prompts = bench._prompts(tokenizer, cfg.max_prompt_tokens, cfg.seed, cfg.min_prompt_tokens)
    for name in names:  # warm-up: every arm's first shapes and the drafter's first forwards
        replay(arm_engine(target, name), prompts, args.every, 4)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            wall, steps = replay(arm_engine(target, name), prompts, args.every, args.requests)
            times[name].append(wall)
            print(f"repeat {rep} {name:20s} {wall:6.3f} s, {steps} steps", flush=True)
    for name in names:
        if name != "plain":
            ratios = [a / p for a, p in zip(times[name], times["plain"])]
            print(f"{name} / plain time: {', '.join(f'{r:.3f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
