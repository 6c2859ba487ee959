"""What the draft gate's peak (a step held plain below a recent load where drafting does not pay) does through the
HTTP server: closed loops of C clients against servers that differ only in their gate (issue 22).

    python scripts/gate_peak_ab.py --clients 4 --repeats 20 [--vary] [--arms plain,dspark,unwindowed,undrafted]

Arms, each a server process on 127.0.0.1 kept up through the run: `plain` (`--drafter none`), `dspark` (the DSpark
drafter and policy, `--k 8`, the gate as it ships), `unwindowed` (the same with the gate judging each step at its own
request count alone, as before engine/gate.py's `peak`), `undrafted` (the same with the gate never drafting: what
carrying the drafter costs alone). C clients each send their next `/v1/completions` request (48 new tokens, greedy,
ignore_eos; scripts/serve_compare.py's prompts and loop) when the last one returns, 64 requests a run; arms in
turn, their order rotated by one every repeat. Prints each repeat's aggregate tokens/s, then per C each arm's median,
its ratios to plain, per repeat and as a median, and the share of its steps the gate kept plain (from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys

from serve_compare import DSPARK, closed_loop, engine_counters, prompts, wait_ready

ARMS = ("plain", "dspark", "unwindowed", "undrafted")


def serve(arm: str, argv: list[str]) -> None:
    """Run the server for `arm` in this process, its gate changed as the arm says."""
    from verispec.cli import main
    from verispec.engine import gate

    if arm == "unwindowed":
        gate.DraftGate.peak = lambda self, requests: 0  # no step held below a recent peak
    elif arm == "undrafted":
        gate.DraftGate.draft = lambda self, requests, clean=True, peak=None: False
    sys.exit(main(argv))


def start(arm: str, port: int) -> subprocess.Popen:
    args = ["serve", "--port", str(port), "--threads", "2", "--max-running", "64"]
    args += ["--drafter", "none"] if arm == "plain" else ["--drafter", f"dspark:{DSPARK}", "--policy", "dspark",
                                                          "--k", "8"]
    return subprocess.Popen([sys.executable, __file__, "--serve", arm, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="4", help="comma-separated closed-loop client counts")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vary", action="store_true", help="request lengths 40-56 tokens (serve_compare --vary)")
    ap.add_argument("--arms", default="plain,dspark,unwindowed", help=f"comma-separated, from {', '.join(ARMS)}")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if any(a not in ARMS for a in arms) or "plain" not in arms or len(set(arms)) != len(arms):
        ap.error(f"--arms {args.arms!r}: each once, from {', '.join(ARMS)}, plain among them")
    clients = [int(c) for c in args.clients.split(",")]
    texts = prompts()
    ports = {arm: 8850 + i for i, arm in enumerate(arms)}
    procs = {arm: start(arm, port) for arm, port in ports.items()}
    try:
        for arm, port in ports.items():
            wait_ready(procs[arm], port, arm)
            asyncio.run(closed_loop(port, "target", texts, 2, 2, 48))  # warm-up
        agg: dict[tuple[str, int], list[float]] = {}
        plain_steps: dict[tuple[str, int], list[float]] = {}  # the steps the gate kept plain, of all steps
        for rep in range(args.repeats):
            for c in clients:
                for arm in arms[rep % len(arms):] + arms[: rep % len(arms)]:
                    before = engine_counters(ports[arm])
                    r = asyncio.run(closed_loop(ports[arm], "target", texts, c, max(64 // c, 1), 48, args.vary))
                    after = engine_counters(ports[arm])
                    agg.setdefault((arm, c), []).append(r["aggregate"])
                    steps = after["engine_steps"] - before["engine_steps"]
                    kept = after["engine_undrafted_steps"] - before["engine_undrafted_steps"]
                    plain_steps.setdefault((arm, c), []).append(kept / max(steps, 1))
                print(f"repeat {rep} clients {c}: " + ", ".join(f"{a} {agg[(a, c)][-1]:.0f}" for a in arms),
                      flush=True)
        for c in clients:
            print(f"{c} clients, aggregate tok/s medians: "
                  + ", ".join(f"{a} {statistics.median(agg[(a, c)]):.0f}" for a in arms))
            for arm in arms:
                if arm != "plain":
                    ratios = [x / y for x, y in zip(agg[(arm, c)], agg[("plain", c)])]
                    print(f"  {arm} / plain: median {statistics.median(ratios):.3f}; per repeat "
                          + " ".join(f"{r:.2f}" for r in ratios)
                          + f"; steps kept plain {100 * statistics.median(plain_steps[(arm, c)]):.1f}% (median)")
    finally:
        for p in procs.values():
            p.terminate()


if __name__ == "__main__":
    main()
