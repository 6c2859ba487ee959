"""How often the draft gate's first verdict at a load reads "drafting does not pay" from a few steps, with drafted
steps counted by the tokens they committed against the tokens expected (engine/gate.py, issue 22).

    python scripts/gate_verdict_noise.py --rate 2 --duration 20 --samples 3,5,10

Two in-process open loops on the same Poisson schedule (the bench's prompts, 64 new tokens, greedy, ignore_eos): one
engine whose gate always drafts and one whose gate never does, each step's committed tokens, expected tokens and
seconds recorded. Then, per load bucket, bootstrap draws of n drafted and n plain steps: the share of draws in which
drafting's rate falls below the gate's margin times plain's, read from committed tokens and from expected tokens
scaled by a calibration from 3n other drafted steps drawn from every load (as the gate pools it).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path

from openloop_gate import setup  # scripts/ is on sys.path when this script runs

from verispec.bench import serve as bench
from verispec.bench.openloop import poisson_arrivals
from verispec.config import EngineConfig, SamplingParams
from verispec.engine.engine import Engine
from verispec.engine.gate import DraftGate

ROOT = Path(__file__).resolve().parents[1]


def steps(target, tokenizer, profile, prompts, arrivals, drafts: bool) -> list[tuple[int, int, float, float]]:
    """(requests, committed tokens, expected tokens or 0, seconds) of every counted clean step."""
    engine = Engine(target, tokenizer, EngineConfig(policy="dspark", k=8, drafter=f"dspark:{ROOT / 'zoo/dspark'}"),
                    profile=profile)
    engine.gate.draft = lambda requests, clean=True, peak=None: drafts
    rows = []

    def record(requests, drafted, tokens, seconds, counted=True, expected=None):
        if counted and drafted == drafts:
            rows.append((requests, tokens, expected or 0.0, seconds))

    engine.gate.record = record
    with bench._running(engine) as aeng:
        asyncio.run(bench._closed(aeng, prompts[:2], 2, 2, SamplingParams(max_tokens=8)))  # warm-up
        rows.clear()
        asyncio.run(bench._open_loop(aeng, prompts, arrivals, SamplingParams(max_tokens=64, ignore_eos=True)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2.0, help="offered requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    ap.add_argument("--samples", default="3,5,10", help="steps of each choice per bootstrap draw")
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg, target, tokenizer, profile, prompts = setup(args.threads)
    arrivals = poisson_arrivals(args.rate, args.duration, random.Random(f"{cfg.seed}:{args.rate}"))
    drafted = steps(target, tokenizer, profile, prompts, arrivals, True)
    plain = steps(target, tokenizer, profile, prompts, arrivals, False)
    margin, rng = DraftGate.margin, random.Random(0)
    for bucket in sorted({DraftGate.bucket(r[0]) for r in drafted}):
        d = [r for r in drafted if DraftGate.bucket(r[0]) == bucket]
        p = [r for r in plain if DraftGate.bucket(r[0]) == bucket]
        if len(d) < 10 or len(p) < 10:
            continue
        committed, expected = [r[1] for r in d], [r[2] for r in d]
        print(f"bucket {bucket} ({2 ** (bucket - 1)}-{2 ** bucket - 1} requests): {len(d)} drafted steps, "
              f"{sum(committed) / sum(r[3] for r in d):.0f} tok/s, committed {statistics.fmean(committed):.2f} "
              f"+- {statistics.pstdev(committed):.2f} tokens, expected {statistics.fmean(expected):.2f} "
              f"+- {statistics.pstdev(expected):.2f}, committed / expected {sum(committed) / sum(expected):.3f}; "
              f"{len(p)} plain steps, {sum(r[1] for r in p) / sum(r[3] for r in p):.0f} tok/s")
        for n in (int(x) for x in args.samples.split(",")):
            low_committed = low_expected = 0
            for _ in range(args.draws):
                ds, ps, cal = ([rng.choice(xs) for _ in range(m)] for xs, m in ((d, n), (p, n), (drafted, 3 * n)))
                plain_rate = sum(x[1] for x in ps) / sum(x[3] for x in ps)
                seconds = sum(x[3] for x in ds)
                low_committed += sum(x[1] for x in ds) / seconds < margin * plain_rate
                scale = sum(x[1] for x in cal) / sum(x[2] for x in cal)
                low_expected += scale * sum(x[2] for x in ds) / seconds < margin * plain_rate
            print(f"  {n} steps of each: drafting read below {margin:g}x plain in {low_committed / args.draws:.1%} of "
                  f"draws by committed tokens, {low_expected / args.draws:.1%} by calibrated expected tokens")


if __name__ == "__main__":
    main()
