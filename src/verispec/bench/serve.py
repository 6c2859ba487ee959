"""`verispec bench serve`: load against the engine, per verification policy and drafter.

Closed loop: C clients, each sending its next request when the last one finished, at C = 1, 2, 4, ... 32 (the
per-user versus aggregate Pareto plot). Open loop (`bench.openloop`): Poisson arrivals at fixed offered rates, the
same schedule for every arm, prompts of mixed lengths from the task sets; per rate, whether the arm sustains it,
and the highest rate it sustains with and without a TPOT SLO. Arms are compared "at matched throughput" only at
rates both sustain. Optionally (`capacity_rate`) every arm is also offered a rate above its capacity: overloaded, it
completes requests at the rate it could sustain, its capacity (serve_report.capacities). Clients run in-process
against the async engine (the server's own engine, without HTTP in the way). Per arm and load: per-user tokens/s
(each request's output tokens over its latency, averaged), aggregate tokens/s, TTFT and TPOT percentiles. Loads
run one at a time, every arm in turn (their order rotated per load and pass), so that the arms compared at a load
run close together. Writes serve_results.json, serve_summary.md, serve_pareto.png (closed loop) and
serve_openloop.png (per-user speed against offered rate).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verispec.bench.openloop import (OpenLoopConfig, RealClock, Timing, assess, combine_repeats, poisson_arrivals,
                                     run_open_loop)
from verispec.bench.prompts import PROMPT_DIR, TASKS, load_prompts
from verispec.bench.serve_report import capacities, goals, plot, plot_open_loop, summary_markdown, sustained_rates
from verispec.config import DEFAULT_DTYPE, EngineConfig, SamplingParams
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.errors import ConfigError, VerispecError
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
    # Open loop: offered rates (req/s; plain decoding of 64 tokens saturated near 2.2 req/s on 2 Zen 3 cores), the
    # arrival window per rate, and the TPOT SLO of the "highest sustained rate under the SLO".
    poisson_rates: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
    poisson_duration_s: float = OpenLoopConfig.duration_s
    tpot_slo_s: float = OpenLoopConfig.tpot_slo_s
    # Passes of the open loop, the arms' order rotated by one each pass; per arm and rate the median per-user speed
    # and a majority's verdict (openloop.combine_repeats). The closed loop runs in the first pass only.
    poisson_repeats: int = 1
    # The arms to run, by name (`off`, `fixed-1/LABEL`, `fixed-K/LABEL`, `batch-table/LABEL`, `dspark/LABEL`; LABEL a
    # drafter spec's kind); empty: all of them. Fewer arms put the ones compared closer together in time.
    only_arms: tuple[str, ...] = ()
    dtype: str = DEFAULT_DTYPE
    max_prompt_tokens: int = 384
    min_prompt_tokens: int = 64  # open-loop prompts are cut to lengths drawn uniformly from [min, max]
    # Higher rates than one an arm did not sustain are skipped for it: they cannot raise its highest sustained rate
    # (`openloop.max_sustained`) and each would end with a long backlog to drain.
    skip_above_unsustained: bool = True
    # An offered rate above every arm's capacity (req/s; None: not run), run by every arm in every pass after its
    # rates: overloaded, an arm completes requests at its capacity, the rate it could sustain. It reads the highest
    # load finer than a grid of rates: on 6, 8, 10, 12 req/s all three arms of open-loop run 26 sustained 8 and none
    # 10, while at 10 their queues grew at 0.2-0.6 (dspark), 0.3-1.1 (plain) and -0.8-1.9 requests/s (fixed-8).
    capacity_rate: float | None = None
    kv_pool: int = EngineConfig.cache_budget_tokens  # the engine's KV pool (positions)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.poisson_repeats < 1:
            raise ConfigError(f"poisson_repeats (--poisson-repeats) must be at least 1, got {self.poisson_repeats}")
        if self.capacity_rate is not None and not self.capacity_rate > 0:
            raise ConfigError(f"capacity_rate (--capacity-rate) must be a positive rate, got {self.capacity_rate}")
        if self.capacity_rate is not None and not self.poisson_rates:
            raise ConfigError("the capacity rate (--capacity-rate) is read beside the open loop's rates: give "
                              "--poisson rates too")
        known = [a.name for a in self._all_arms()]
        if unknown := [a for a in self.only_arms if a not in known]:
            raise ConfigError(f"unknown serve-bench arms {', '.join(unknown)} (--arms): choose from {', '.join(known)}")

    @classmethod
    def quick(cls, target: Path, **kw) -> ServeBenchConfig:
        base = dict(concurrency=(1, 4, 16), requests_per_client=1, min_requests=4, max_tokens=32,
                    poisson_rates=(1.0, 2.0), poisson_duration_s=6.0)
        base.update(kw)
        return cls(target, **base)

    def open_loop(self) -> OpenLoopConfig:
        return OpenLoopConfig(rates=self.poisson_rates, duration_s=self.poisson_duration_s, tpot_slo_s=self.tpot_slo_s,
                              seed=self.seed)

    def engine_config(self, arm: Arm) -> EngineConfig:
        """One arm's engine: room for the most clients of the closed loop, and never fewer running requests than
        the engine's default, so that the open loop's arrivals are not serialised by a short --concurrency list
        (with `--concurrency 1` the engine once ran one request at a time and plain "saturated" at 4 req/s)."""
        running = max((*self.concurrency, EngineConfig.max_running))
        return EngineConfig(policy=arm.policy, k=arm.k, drafter=arm.drafter, max_running=running,
                            max_queued=4 * running + 64, cache_budget_tokens=self.kv_pool)

    def arms(self) -> list[Arm]:
        return [a for a in self._all_arms() if not self.only_arms or a.name in self.only_arms]

    def _all_arms(self) -> list[Arm]:
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
    mode: str  # "closed"
    load: float  # clients
    requests: int
    aggregate_tokens_per_s: float
    per_user_tokens_per_s: float
    ttft_s: dict = field(default_factory=dict)  # p50 / p90 / p99
    tpot_s: dict = field(default_factory=dict)
    tau: float = 1.0
    mean_verified_per_round: float = 0.0
    pool: dict = field(default_factory=dict)  # the engine's KV pool over this load (_pool_use)


def _pool_start(engine: Engine) -> tuple[int, int, int, int, int]:
    """Start measuring the KV pool over one load (the engine idle between loads): resets the engine's KV peak (read
    back by _pool_use), empties the prefix cache and returns the preemption, prefix-cache and step counters so far.
    Every load takes its prompts from the start of the same list, so blocks left by the warm-up or the load before
    would hit, and unevenly: a 64 MiB cache holds ~18 of these prompts, and at 4 req/s after 2 req/s plain hit 52%
    of its prompt tokens where the MTP arms, whose blocks also carry hidden rows, hit none (Zen 4, open-loop run 14)."""
    engine.metrics.peak_kv_tokens = engine.reserved_tokens
    prefix = engine.prefix
    if prefix is not None:
        prefix.clear()
    m = engine.metrics
    return (m.preemptions, prefix.queried_tokens if prefix else 0, prefix.hit_tokens if prefix else 0, m.num_steps,
            m.undrafted_steps)


def _pool_use(engine: Engine, before: tuple[int, int, int, int, int]) -> dict:
    """Preemptions, prefix-cache hit rate (prompt tokens), the KV pool's peak use, and steps and those the draft gate
    kept plain (a dspark arm's steps that drafted nothing because drafting did not pay) since `before`."""
    prefix = engine.prefix
    queried = (prefix.queried_tokens if prefix else 0) - before[1]
    hits = (prefix.hit_tokens if prefix else 0) - before[2]
    return {"preemptions": engine.metrics.preemptions - before[0],
            "prefix_hit_rate": hits / queried if queried else 0.0,
            "kv_peak_use": engine.metrics.peak_kv_tokens / engine.config.cache_budget_tokens,
            "steps": engine.metrics.num_steps - before[3],
            "undrafted_steps": engine.metrics.undrafted_steps - before[4]}


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


async def _open_loop(engine: AsyncEngine, prompts: list[list[int]], arrivals: list[float],
                     params: SamplingParams) -> list[Timing]:
    clock = RealClock()

    async def send(i: int, t: Timing) -> None:
        try:
            async for out in engine.generate(prompts[i % len(prompts)], params):
                if out.token_ids and not t.first:
                    t.first = clock.now()
                t.tokens += len(out.token_ids)
        except (VerispecError, RuntimeError):  # a full queue (QueueFull) or a dead engine: not sustained
            t.ok = False
        t.done = clock.now()

    return await run_open_loop(send, arrivals, clock)


def _summarize(arm: Arm, mode: str, load: float, timings: list[_Timing], wall: float, engine: Engine,
               before: tuple[int, int, int], pool: dict) -> LoadResult:
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
        mean_verified_per_round=draft_tokens / drafts if drafts else 0.0, pool=pool,
    )


def _prompts(tokenizer: Tokenizer, max_tokens: int, seed: int, min_tokens: int | None = None) -> list[list[int]]:
    """The shipped task prompts, interleaved across tasks, each cut to its last max_tokens tokens (or, with
    min_tokens, to its last n tokens, n drawn uniformly from [min_tokens, max_tokens]: mixed lengths)."""
    rng = random.Random(seed)
    per_task = [[tokenizer.encode(r["prompt"]) for r in load_prompts(PROMPT_DIR / f"{t}.jsonl")] for t in TASKS]
    mixed = [p for group in zip(*per_task) for p in group]
    rng.shuffle(mixed)
    if min_tokens is None:
        return [p[-max_tokens:] for p in mixed]
    return [p[-rng.randint(min_tokens, max_tokens):] for p in mixed]


@contextmanager
def _running(engine: Engine) -> Iterator[AsyncEngine]:
    """The engine on a loop thread of its own for one load (the thread, with its OpenMP pool, ends with it)."""
    aeng = AsyncEngine(engine).start()
    try:
        yield aeng
    finally:
        aeng.shutdown()


def _closed_load(cfg: ServeBenchConfig, arm: Arm, engine: Engine, aeng: AsyncEngine, prompts: list[list[int]],
                 clients: int, params: SamplingParams, progress: bool) -> LoadResult:
    """One arm's closed loop at `clients` clients."""
    m = engine.metrics
    before = (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)
    pool_before = _pool_start(engine)
    total = max(cfg.min_requests, clients * cfg.requests_per_client)
    timings, wall = asyncio.run(_closed(aeng, prompts, clients, total, params))
    res = _summarize(arm, "closed", float(clients), timings, wall, engine, before, _pool_use(engine, pool_before))
    if progress:
        print(f"  {arm.name:22s} closed {clients:5d}: aggregate {res.aggregate_tokens_per_s:7.1f} tok/s, per user "
              f"{res.per_user_tokens_per_s:6.1f} tok/s, tau {res.tau:.2f}, ttft p50 "
              f"{res.ttft_s.get('p50', 0) * 1e3:6.0f} ms", flush=True)
    return res


def _open_load(arm: Arm, engine: Engine, aeng: AsyncEngine, prompts: list[list[int]], rate: float,
               arrivals: list[float], params: SamplingParams, ol: OpenLoopConfig, rep: int | None,
               progress: bool) -> dict:
    """One arm's open loop at one offered rate: its record (tagged with the pass where there are several)."""
    pool_before = _pool_start(engine)
    rr = assess(rate, asyncio.run(_open_loop(aeng, prompts, arrivals, params)), ol)
    if progress:
        print(f"  {arm.name:22s} {rate:g} req/s{f' (pass {rep + 1})' if rep else ''}: "
              f"{'sustained' if rr.sustained else 'NOT sustained'} (completed {rr.completed_rate:.2f}/"
              f"{rr.offered_rate:.2f} req/s, queue {rr.queue_slope:+.2f}/s), per user "
              f"{rr.per_user_tokens_per_s:6.1f} tok/s, tpot p99 {rr.tpot_s.get('p99', 0) * 1e3:6.1f} ms", flush=True)
    return {"arm": arm.name, "policy": arm.policy, "k": arm.k, "drafter": arm.drafter, **asdict(rr),
            "pool": _pool_use(engine, pool_before), **({"repeat": rep} if rep is not None else {})}


def run(cfg: ServeBenchConfig, out: Path, progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(cfg.target, dtype=cfg.dtype)
    target.source_dir = cfg.target
    tokenizer = Tokenizer.from_dir(cfg.target)
    profile: StepProfile = load_or_measure(target, progress=progress)
    prompts = _prompts(tokenizer, cfg.max_prompt_tokens, cfg.seed)
    open_prompts = _prompts(tokenizer, cfg.max_prompt_tokens, cfg.seed, cfg.min_prompt_tokens)
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    ol = cfg.open_loop()
    # One schedule per rate, shared by every arm: the arms see the same arrivals.
    schedules = {r: poisson_arrivals(r, ol.duration_s, random.Random(f"{ol.seed}:{r}")) for r in ol.rates}
    overload = [] if cfg.capacity_rate is None else poisson_arrivals(
        cfg.capacity_rate, ol.duration_s, random.Random(f"{ol.seed}:capacity:{cfg.capacity_rate}"))
    results: list[LoadResult] = []
    passes: list[dict] = []  # every open-loop record of every pass
    capacity: list[dict] = []  # every arm's record at the capacity rate, per pass
    arms = cfg.arms()
    order = {a.name: i for i, a in enumerate(arms)}
    repeats = cfg.poisson_repeats if schedules else 1
    for rep in range(repeats):
        # Load by load, every arm in turn (its order rotated each load and pass), so that the arms compared at a
        # load run minutes apart, not a whole pass: a host that drifted between one arm's loads and another's sank
        # one arm's readings (open-loop runs 15 and 18). Each arm keeps its engine (its draft gate, its drafters)
        # through the pass and sees its loads in the same order as before (closed loop, then rates ascending), but
        # only one engine thread lives at a time: every thread that runs forwards keeps an OpenMP pool, and with
        # more pools than CPUs libgomp's workers sleep between parallel regions (runs 19-20 with four engine
        # threads alive: plain's one-client speed halved, threads.py).
        loads = [("closed", float(c)) for c in (cfg.concurrency if rep == 0 else ())]
        loads += [("open", rate) for rate in sorted(schedules)]
        loads += [("capacity", cfg.capacity_rate)] if overload else []
        engines = {a.name: Engine(target, tokenizer, cfg.engine_config(a), profile=profile) for a in arms}
        mine: dict[str, list[dict]] = {a.name: [] for a in arms}
        for arm in arms:
            with _running(engines[arm.name]) as aeng:
                asyncio.run(_closed(aeng, prompts[:2], 2, 2, SamplingParams(max_tokens=8)))  # warm-up
        for i, (mode, load) in enumerate(loads):
            turn = (rep + i) % len(arms)
            for arm in arms[turn:] + arms[:turn]:
                engine = engines[arm.name]
                if mode == "open" and cfg.skip_above_unsustained and any(not r["sustained"] for r in mine[arm.name]):
                    continue
                with _running(engine) as aeng:
                    if mode == "closed":
                        results.append(_closed_load(cfg, arm, engine, aeng, prompts, int(load), params, progress))
                    elif mode == "capacity":
                        capacity.append(_open_load(arm, engine, aeng, open_prompts, load, overload, params, ol, rep,
                                                   progress))
                    else:
                        mine[arm.name].append(_open_load(arm, engine, aeng, open_prompts, load, schedules[load],
                                                         params, ol, rep if repeats > 1 else None, progress))
        passes += [r for a in arms for r in mine[a.name]]
    results.sort(key=lambda r: (order[r.arm], r.load))  # the report's tables: arm by arm, as before
    open_results = combine_repeats(passes, repeats, [a.name for a in arms])
    report = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                   "threads": torch.get_num_threads(), "arm_order": "per load"},
        "profile": {"tokens": list(profile.tokens), "seconds": list(profile.seconds),
                    "per_request_s": profile.per_request_s, "key": profile.key},
        "results": [asdict(r) for r in results],
        "open_loop": open_results,
        **({"open_loop_passes": passes} if repeats > 1 else {}),
        "sustained": sustained_rates(open_results, cfg.tpot_slo_s),
        **({"capacity": capacities(capacity, [a.name for a in arms]), "capacity_passes": capacity} if capacity
           else {}),
    }
    report["goals"] = goals(report, cfg)
    (out / "serve_results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve_summary.md").write_text(summary_markdown(report))
    plot(report, out / "serve_pareto.png")
    plot_open_loop(report, out / "serve_openloop.png")
    plot_profile(profile, out / "profile.png")
    return report
