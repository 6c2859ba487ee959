"""The dspark policy's acceptance estimate for drafters without a confidence head, ablated in process (interleaved
arms, order reversed every other repeat, medians over repeats; every output checked against plain greedy):
- `one`: one estimate for all of the drafter's drafts (Draft.kind dropped), this generation's alone;
- `kinds`: an estimate per Draft.kind (prompt lookup's suffix-match length), this generation's alone;
- `carried`: per kind, and carried from one generation to the next (what `LLM` and the engine do).
    python scripts/estimator_ab.py --target w4a8-head --task code_completion --prompts 8:40 --repeats 5
    python scripts/estimator_ab.py --engine --running 1 --prompts 8:40 --repeats 7
--engine runs `one` and `carried` as two engines (kept across repeats, so both learn across requests as a served
engine does) with `--running` requests at a time, and prints the engine's learnt acceptance per kind.
Prompts: the last 64 tokens of a task's prompts (the report's short bucket is code_completion 0:8; 8:40 are not it).
"""
from __future__ import annotations

import argparse
import statistics
import time

import quant_report as qr  # scripts/ is on sys.path when this script runs

from verispec.api import LLM, SamplingParams
from verispec.config import EngineConfig
from verispec.drafters import Draft, Drafter, build_drafter
from verispec.engine import Engine


def without_kinds(drafter: Drafter) -> Drafter:
    """The drafter, its drafts' kinds dropped (one estimate for all of them)."""
    propose = drafter.propose
    drafter.propose = lambda requests: [Draft(d.tokens, d.probs, d.confidence, d.parents) for d in propose(requests)]
    return drafter


def library(plain: LLM, spec: str, prompts: list[list[int]], params: SamplingParams, repeats: int) -> None:
    arms = {"plain": plain}
    for name in ("one", "kinds", "carried"):
        llm = arms[name] = LLM(plain.target, drafter=spec, k=8, policy="dspark")
        if name != "carried":
            llm.estimator = None  # decode's own, per generation
        if name == "one":
            without_kinds(llm.drafter)
    for name, llm in arms.items():  # warm-up, not timed
        llm.generate(prompts[0], params, plain=name == "plain")
    seconds: dict[str, list[float]] = {a: [] for a in arms}
    tau: dict[str, list[float]] = {a: [] for a in arms if a != "plain"}
    for rep in range(repeats):
        spent = dict.fromkeys(arms, 0.0)
        for p in prompts:
            outs = {}
            for name in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                t0 = time.perf_counter()
                r = arms[name].generate(p, params, plain=name == "plain")[0]
                spent[name] += time.perf_counter() - t0
                outs[name] = r.token_ids
                if name != "plain":
                    tau[name].append(r.stats.tau)
            assert all(o == outs["plain"] for o in outs.values()), "an arm's output differs from plain greedy"
        for name in arms:
            seconds[name].append(spent[name])
        print(rep, {a: round(len(prompts) * params.max_tokens / spent[a]) for a in arms}, flush=True)
    med = {a: statistics.median(s) for a, s in seconds.items()}
    print("tok/s end to end (median):", {a: round(len(prompts) * params.max_tokens / m) for a, m in med.items()})
    print("over `one`:", {a: round(med["one"] / med[a], 3) for a in ("kinds", "carried")},
          "tau:", {a: round(statistics.mean(t), 2) for a, t in tau.items()})


def engine(plain: LLM, spec: str, prompts: list[list[int]], params: SamplingParams, repeats: int,
           running: int) -> None:
    ref = [plain.generate(p, params, plain=True)[0].token_ids for p in prompts]
    engines = {}
    for name in ("one", "carried"):
        drafter = build_drafter(spec, target=plain.target, dtype=plain.target.dtype, device=plain.target.device)
        engines[name] = Engine(plain.target, None, EngineConfig(k=8, drafter="d", policy="dspark", max_running=running,
                                                                prefix_cache_bytes=0),
                               drafters={"d": without_kinds(drafter) if name == "one" else drafter})
    seconds: dict[str, list[float]] = {a: [] for a in engines}
    for rep in range(repeats):  # the first repeat warms both up and is not counted
        for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
            eng = engines[name]
            t0 = time.perf_counter()
            ids = [eng.add_request(p, params) for p in prompts]
            out = eng.run_until_done()
            seconds[name].append(time.perf_counter() - t0)
            assert [out[i].token_ids for i in ids] == ref, f"{name}: output differs from plain greedy"
        print(rep, {a: round(len(prompts) * params.max_tokens / s[-1]) for a, s in seconds.items()}, flush=True)
    med = {a: statistics.median(s[1:]) for a, s in seconds.items()}
    print(f"{running} at a time, tok/s (median of repeats 2..):",
          {a: round(len(prompts) * params.max_tokens / m) for a, m in med.items()},
          "carried over one:", round(med["one"] / med["carried"], 3))
    est = engines["carried"].estimator
    for (drafter, kind), (reached, accepted) in sorted(est._global.items(), key=lambda kv: str(kv[0])):
        rates = [round(a / r, 2) if r else None for r, a in zip(reached[:4], accepted[:4])]
        print(f"  kind {kind}: {int(reached[0])} proposals, P(position j accepted | j - 1 was) j = 1..4: {rates}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="w4a8-head", choices=sorted(qr.COPIES))
    ap.add_argument("--drafter", default="ngram", help="a drafter without confidences, e.g. ngram, lookup:model:DIR")
    ap.add_argument("--task", default="code_completion")
    ap.add_argument("--prompts", default="8:40", help="FIRST:LAST of the task's prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--running", type=int, default=1)
    args = ap.parse_args()
    tdir = qr.copy_dir(args.target)
    plain = LLM(tdir)
    lo, hi = (int(x) for x in args.prompts.split(":"))
    prompts = [plain.tokenizer.encode(r["prompt"])[-64:] for r in qr.load_task(args.task)[lo:hi]]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    if args.engine:
        engine(plain, args.drafter, prompts, params, args.repeats, args.running)
    else:
        library(plain, args.drafter, prompts, params, args.repeats)


if __name__ == "__main__":
    main()
