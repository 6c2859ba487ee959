"""In-process A/B of engine arms under a closed loop (issue 22): step_breakdown.py's arms (plain, dspark,
dspark-undrafted, dspark-forced, plain-no-prefix-cache) alternating, their order reversed every other repeat, each
arm's engine and draft gate kept across repeats.

    python scripts/engine_ab.py --clients 4,8 --repeats 4 --arms plain,dspark,dspark-undrafted

The server's closed loop without HTTP: C clients, each sending its next request when the last one finishes (the last
600 characters of a code task prompt, greedy, ignore_eos). Every request has the same length by default, as in
scripts/serve_compare.py, so a plain arm's clients stay in lockstep (their prompts prefilled together); `--vary`
spreads lengths over 40-56 tokens. Prints tokens/s per run and, per load, each arm over the first per repeat. One
AsyncEngine lives at a time (two engine threads in one process each keep an OpenMP pool: see verispec/threads.py).
Then, per arm and load, the steps by kind (prefilling or not, drafted or not) over all repeats: how many, their mean
milliseconds and their share of the arm's step time (where a dspark arm's time goes beside plain's).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from step_breakdown import ARMS, arm_engine, closed_loop  # scripts/ is on sys.path when this script runs

from verispec.bench.prompts import load_task
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


class StepKinds:
    """Counts and times an engine's steps by kind, per load: (clients, prefilling, drafted), drafted None where the
    step asked no gate (plain arms). `load` is None between measured runs (warm-up steps are not counted)."""

    def __init__(self, engine: Engine) -> None:
        self.count: Counter = Counter()
        self.seconds: defaultdict = defaultdict(float)
        self.load: int | None = None
        run_step, draft = engine._run_step, engine.gate.draft
        decision: list[bool] = []

        def gate(requests: int, clean: bool = True, peak: int | None = None) -> bool:
            decision.append(draft(requests, clean, peak))
            return decision[-1]

        def step(outputs):
            decision.clear()
            prefilling = any(len(r.pending) > 1 for r in engine.running)
            t0 = time.perf_counter()
            run_step(outputs)
            if self.load is not None:
                kind = (self.load, prefilling, decision[-1] if decision else None)
                self.count[kind] += 1
                self.seconds[kind] += time.perf_counter() - t0

        engine.gate.draft, engine._run_step = gate, step

    def lines(self, load: int) -> list[str]:
        total = sum(sec for kind, sec in self.seconds.items() if kind[0] == load) or 1.0
        out = []
        for (at, prefilling, drafted), n in sorted(self.count.items(), key=lambda kv: str(kv[0])):
            if at != load:
                continue
            what = ("prefilling" if prefilling else "decoding only") + {None: "", True: ", drafted",
                                                                         False: ", kept plain"}[drafted]
            sec = self.seconds[(at, prefilling, drafted)]
            out.append(f"{what}: {n} steps, {1e3 * sec / n:.2f} ms each, {sec / total:.0%} of the time")
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="4,8")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--arms", default="plain,dspark,dspark-undrafted", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--requests", type=int, default=64, help="requests per run (at least 2 per client)")
    ap.add_argument("--vary", action="store_true", help="request lengths 40-56 tokens instead of 48")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    arms = args.arms.split(",")
    if bad := [a for a in arms if a not in ARMS]:
        ap.error(f"--arms: unknown {', '.join(bad)}; choose from {', '.join(ARMS)}")
    clients = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(args.threads)
    target = load_model(ROOT / "zoo/target", dtype="bf16")
    tok = Tokenizer.from_dir(ROOT / "zoo/target")
    prompts = [tok.encode(r["prompt"][-600:]) for t in ("code_completion", "code_continuation") for r in load_task(t)]
    engines = {a: arm_engine(target, a) for a in arms}
    for eng in engines.values():  # warm-up: first shapes, the gate's first measurements
        aeng = AsyncEngine(eng).start()
        try:
            asyncio.run(closed_loop(aeng, prompts, 1, 2, args.vary))
        finally:
            aeng.shutdown()
    rates: dict[tuple[str, int], list[float]] = {(a, c): [] for a in arms for c in clients}
    kinds = {a: StepKinds(engines[a]) for a in arms}
    for rep in range(args.repeats):
        for c in clients:
            for a in arms if rep % 2 == 0 else arms[::-1]:
                eng = engines[a]
                m = eng.metrics
                tokens0, plain0, steps0 = m.num_output_tokens, m.undrafted_steps, m.num_steps
                aeng = AsyncEngine(eng).start()
                kinds[a].load = c
                try:
                    wall = asyncio.run(closed_loop(aeng, prompts, c, max(2, args.requests // c), args.vary))
                finally:
                    kinds[a].load = None
                    aeng.shutdown()
                rates[(a, c)].append((eng.metrics.num_output_tokens - tokens0) / wall)
                print(f"repeat {rep} clients {c} {a}: {rates[(a, c)][-1]:.0f} tok/s, steps kept plain "
                      f"{eng.metrics.undrafted_steps - plain0} of {eng.metrics.num_steps - steps0}", flush=True)
    for c in clients:
        for a in arms[1:]:
            ratios = [x / y for x, y in zip(rates[(a, c)], rates[(arms[0], c)])]
            print(f"{c} clients, {a} / {arms[0]} per repeat: {', '.join(f'{r:.2f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")
    for c in clients:
        for a in arms:
            print(f"{c} clients, {a}, steps over all repeats:")
            for line in kinds[a].lines(c):
                print(f"    {line}")


if __name__ == "__main__":
    main()
