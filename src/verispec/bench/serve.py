"""`verispec bench serve`: load against the engine, per verification policy and drafter.

Closed loop: C clients, each sending its next request when the last one finished, at C = 1, 2, 4, ... 32; open
loop (optional): Poisson arrivals at given rates. Clients run in-process against the async engine (the server's
own engine, without HTTP in the way). Per arm and load: per-user tokens/s (each request's output tokens over its
latency, averaged), aggregate tokens/s (all output tokens over the wall time), TTFT and TPOT percentiles.
Writes serve_results.json, serve_summary.md and serve_pareto.png (per-user versus aggregate, one line per arm).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verispec.bench.prompts import PROMPT_DIR, TASKS, load_prompts
from verispec.config import DEFAULT_DTYPE, EngineConfig, SamplingParams
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.profile import StepProfile, load_or_measure, plot_profile
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    k: int
    drafter: str | None


@dataclass(frozen=True)
class ServeBenchConfig:
    target: Path
    drafters: tuple[str, ...] = ("ngram",)
    long_k: int = 8
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    requests_per_client: int = 2
    min_requests: int = 6
    max_tokens: int = 64
    poisson_rates: tuple[float, ...] = (4.0,)
    poisson_requests: int = 24
    dtype: str = DEFAULT_DTYPE
    max_prompt_tokens: int = 384
    seed: int = 0

    @classmethod
    def quick(cls, target: Path, **kw) -> ServeBenchConfig:
        base = dict(concurrency=(1, 4, 16), requests_per_client=1, min_requests=4, max_tokens=32, poisson_rates=())
        base.update(kw)
        return cls(target, **base)

    def arms(self) -> list[Arm]:
        arms = [Arm("off", "off", 0, None)]
        for d in self.drafters:
            label = d.split(":")[0]
            arms += [
                Arm(f"fixed-1/{label}", "fixed", 1, d),
                Arm(f"fixed-{self.long_k}/{label}", "fixed", self.long_k, d),
                Arm(f"batch-table/{label}", "batch-table", self.long_k, d),
                Arm(f"dspark/{label}", "dspark", self.long_k, d),
            ]
        return arms


@dataclass
class _Timing:
    submitted: float
    first: float = 0.0
    done: float = 0.0
    tokens: int = 0


@dataclass
class LoadResult:
    arm: str
    policy: str
    k: int
    drafter: str | None
    mode: str  # "closed" | "poisson"
    load: float  # clients, or requests/s
    requests: int
    aggregate_tokens_per_s: float
    per_user_tokens_per_s: float
    ttft_s: dict = field(default_factory=dict)  # p50 / p90 / p99
    tpot_s: dict = field(default_factory=dict)
    tau: float = 1.0
    mean_verified_per_round: float = 0.0


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] for q in (50, 90, 99)}


async def _one(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> _Timing:
    t = _Timing(time.perf_counter())
    async for out in engine.generate(prompt, params):
        if out.token_ids and not t.first:
            t.first = time.perf_counter()
        t.tokens += len(out.token_ids)
    t.done = time.perf_counter()
    return t


async def _closed(engine: AsyncEngine, prompts: list[list[int]], clients: int, total: int,
                  params: SamplingParams) -> tuple[list[_Timing], float]:
    next_idx = 0
    timings: list[_Timing] = []

    async def client() -> None:
        nonlocal next_idx
        while next_idx < total:
            i = next_idx
            next_idx += 1
            timings.append(await _one(engine, prompts[i % len(prompts)], params))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return timings, time.perf_counter() - start


async def _poisson(engine: AsyncEngine, prompts: list[list[int]], rate: float, total: int,
                   params: SamplingParams, rng: random.Random) -> tuple[list[_Timing], float]:
    start = time.perf_counter()
    tasks = []
    for i in range(total):
        tasks.append(asyncio.create_task(_one(engine, prompts[i % len(prompts)], params)))
        await asyncio.sleep(rng.expovariate(rate))
    timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


def _summarize(arm: Arm, mode: str, load: float, timings: list[_Timing], wall: float, engine: Engine,
               before: tuple[int, int, int]) -> LoadResult:
    m = engine.metrics
    drafts, draft_tokens, accepted = (m.num_drafts - before[0], m.num_draft_tokens - before[1],
                                      m.num_accepted_tokens - before[2])
    tokens = sum(t.tokens for t in timings)
    tpots = [(t.done - t.first) / (t.tokens - 1) for t in timings if t.tokens > 1]
    return LoadResult(
        arm=arm.name, policy=arm.policy, k=arm.k, drafter=arm.drafter, mode=mode, load=load,
        requests=len(timings), aggregate_tokens_per_s=tokens / wall,
        per_user_tokens_per_s=statistics.fmean(t.tokens / (t.done - t.submitted) for t in timings),
        ttft_s=_pct([t.first - t.submitted for t in timings]), tpot_s=_pct(tpots),
        tau=1 + accepted / drafts if drafts else 1.0,
        mean_verified_per_round=draft_tokens / drafts if drafts else 0.0,
    )


def _prompts(tokenizer: Tokenizer, max_tokens: int, seed: int) -> list[list[int]]:
    """The shipped task prompts, interleaved across tasks, cut to their last max_tokens tokens."""
    per_task = [[tokenizer.encode(r["prompt"])[-max_tokens:] for r in load_prompts(PROMPT_DIR / f"{t}.jsonl")]
                for t in TASKS]
    mixed = [p for group in zip(*per_task) for p in group]
    random.Random(seed).shuffle(mixed)
    return mixed


def run(cfg: ServeBenchConfig, out: Path, progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(cfg.target, dtype=cfg.dtype)
    target.source_dir = cfg.target
    tokenizer = Tokenizer.from_dir(cfg.target)
    profile: StepProfile = load_or_measure(target, progress=progress)
    prompts = _prompts(tokenizer, cfg.max_prompt_tokens, cfg.seed)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    results: list[LoadResult] = []
    max_c = max(cfg.concurrency)
    for arm in cfg.arms():
        engine = Engine(target, tokenizer, EngineConfig(
            policy=arm.policy, k=arm.k, drafter=arm.drafter, max_running=max_c, max_queued=4 * max_c + 64,
        ), profile=profile)
        aeng = AsyncEngine(engine).start()
        try:
            asyncio.run(_closed(aeng, prompts[:2], 2, 2, SamplingParams(max_tokens=8)))  # warm-up
            loads = [("closed", float(c)) for c in cfg.concurrency] + [("poisson", r) for r in cfg.poisson_rates]
            for mode, load in loads:
                m = engine.metrics
                before = (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)
                if mode == "closed":
                    total = max(cfg.min_requests, int(load) * cfg.requests_per_client)
                    timings, wall = asyncio.run(_closed(aeng, prompts, int(load), total, params))
                else:
                    rng = random.Random(cfg.seed)
                    timings, wall = asyncio.run(_poisson(aeng, prompts, load, cfg.poisson_requests, params, rng))
                res = _summarize(arm, mode, load, timings, wall, engine, before)
                results.append(res)
                if progress:
                    print(f"  {arm.name:22s} {mode:7s} {load:5g}: aggregate {res.aggregate_tokens_per_s:7.1f} tok/s, "
                          f"per user {res.per_user_tokens_per_s:6.1f} tok/s, tau {res.tau:.2f}, "
                          f"ttft p50 {res.ttft_s.get('p50', 0) * 1e3:6.0f} ms", flush=True)
        finally:
            aeng.shutdown()
    report = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                   "threads": torch.get_num_threads()},
        "profile": {"tokens": list(profile.tokens), "seconds": list(profile.seconds),
                    "per_request_s": profile.per_request_s, "key": profile.key},
        "results": [asdict(r) for r in results],
    }
    report["goals"] = goals(report["results"], cfg)
    (out / "serve_results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve_summary.md").write_text(summary_markdown(report))
    plot(report, out / "serve_pareto.png")
    plot_profile(profile, out / "profile.png")
    return report


def _curve(results: list[dict], arm: str) -> list[tuple[float, float]]:
    pts = [(r["aggregate_tokens_per_s"], r["per_user_tokens_per_s"]) for r in results
           if r["arm"] == arm and r["mode"] == "closed"]
    return sorted(pts)


def per_user_at(curve: list[tuple[float, float]], aggregate: float) -> float | None:
    """Per-user speed of an arm at a given aggregate throughput, interpolated along its closed-loop curve."""
    for (a0, u0), (a1, u1) in zip(curve, curve[1:]):
        if a0 <= aggregate <= a1:
            return u0 + (u1 - u0) * (aggregate - a0) / (a1 - a0) if a1 > a0 else max(u0, u1)
    return None


def goals(results: list[dict], cfg: ServeBenchConfig) -> list[dict]:
    out = []
    max_c = float(max(cfg.concurrency))
    for d in cfg.drafters:
        label = d.split(":")[0]
        dspark, fixed1, fixed_long = f"dspark/{label}", f"fixed-1/{label}", f"fixed-{cfg.long_k}/{label}"
        ratios = []
        dcurve = _curve(results, dspark)
        for agg, user in _curve(results, fixed1):
            u = per_user_at(dcurve, agg)
            if u is not None:
                ratios.append({"aggregate_tokens_per_s": agg, "ratio": u / user})
        best = max((r["ratio"] for r in ratios), default=None)
        out.append({"goal": f"dspark >= 1.5x per-user speed of fixed k=1 at matched aggregate ({label})",
                    "matched_points": ratios, "best_ratio": best, "met": best is not None and best >= 1.5})

        def agg_at(arm: str) -> float | None:
            return next((r["aggregate_tokens_per_s"] for r in results
                         if r["arm"] == arm and r["mode"] == "closed" and r["load"] == max_c), None)

        off, ds, fl = agg_at("off"), agg_at(dspark), agg_at(fixed_long)
        if None not in (off, ds, fl):
            out.append({"goal": f"at concurrency {int(max_c)}: dspark keeps off's aggregate, fixed-{cfg.long_k} loses "
                                f"it ({label})",
                        "off": off, "dspark": ds, f"fixed-{cfg.long_k}": fl,
                        "dspark_vs_off": ds / off, "fixed_long_vs_off": fl / off,
                        "met": ds >= 0.97 * off and fl < 0.97 * off})
    return out


def summary_markdown(report: dict) -> str:
    lines = ["# Load benchmark (`verispec bench serve`)", ""]
    c = report["config"]
    lines += [f"Target `{c['target']}`, {c['dtype']}, {c['threads']} threads, {c['max_tokens']} new tokens per "
              f"request (greedy, ignore_eos), prompts from the shipped task sets mixed, closed-loop clients.", ""]
    lines += ["| arm | mode | load | requests | aggregate tok/s | per-user tok/s | τ | verified/round | "
              "TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |", "|" + "---|" * 12]
    for r in report["results"]:
        lines.append(
            f"| {r['arm']} | {r['mode']} | {r['load']:g} | {r['requests']} | {r['aggregate_tokens_per_s']:.1f} | "
            f"{r['per_user_tokens_per_s']:.1f} | {r['tau']:.2f} | {r['mean_verified_per_round']:.2f} | "
            f"{r['ttft_s'].get('p50', 0) * 1e3:.0f} | {r['ttft_s'].get('p99', 0) * 1e3:.0f} | "
            f"{r['tpot_s'].get('p50', 0) * 1e3:.1f} | {r['tpot_s'].get('p99', 0) * 1e3:.1f} |")
    lines += ["", "## Goals", ""]
    for g in report["goals"]:
        detail = {k: v for k, v in g.items() if k not in ("goal", "met", "matched_points")}
        lines.append(f"- {g['goal']}: **{'met' if g['met'] else 'not met'}** "
                     f"({', '.join(f'{k} {v:.3g}' if isinstance(v, float) else f'{k} {v}' for k, v in detail.items())})")
    p = report["profile"]
    lines += ["", "## Step-time profile (SPS)", "", "| tokens per step | ms |", "|---|---|"]
    lines += [f"| {b} | {s * 1e3:.2f} |" for b, s in zip(p["tokens"], p["seconds"])]
    lines.append(f"\nEach request beyond the first adds {p['per_request_s'] * 1e3:.2f} ms per step.")
    lines += ["", "![per-user vs aggregate](serve_pareto.png)", "", "![step-time profile](profile.png)"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    arms = list(dict.fromkeys(r["arm"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for arm in arms:
        pts = [r for r in results if r["arm"] == arm and r["mode"] == "closed"]
        xs = [r["aggregate_tokens_per_s"] for r in pts]
        ys = [r["per_user_tokens_per_s"] for r in pts]
        style = "-" if arm.startswith("dspark") else ("--" if arm == "off" else ":")
        ax.plot(xs, ys, style, marker="o", label=arm)
        for r in pts:
            ax.annotate(f"{r['load']:g}", (r["aggregate_tokens_per_s"], r["per_user_tokens_per_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("aggregate tokens/s")
    ax.set_ylabel("per-user tokens/s")
    ax.set_title("per-user versus aggregate throughput (labels: concurrent clients)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
