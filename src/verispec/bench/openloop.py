"""Open-loop load: Poisson arrivals at a fixed offered rate, and whether an arm sustains it.

Closed-loop clients wait for their last answer, so a slow server is offered less load and every arm "keeps up";
comparing arms there pairs points of different load. Open loop fixes the offered rate: requests arrive on a
Poisson schedule whatever the server does, and an arm *sustains* a rate when, over the measurement window (the
arrival window minus a warm-up):
- its completed rate is within `tolerance` (2%) of the offered rate (one request of integer slack), completions
  counted over the window shifted by the median latency of the window's requests: what arrives in the window
  completes about one latency later, and counted unshifted, a burst of arrivals in the window's last latency (as
  Poisson arrivals have) read as a shortfall of 4-11% at 12 req/s for arms that kept up (queue not growing), and
- its queue is not growing: the least-squares slope of requests-in-system over the window, times the window,
  piles up at most `tolerance` of the window's arrivals (or one request).
Two arms are compared "at matched throughput" only at rates both sustain. The pieces are pure or take an injected
clock, so the tests drive them with a fake server and no sleeping.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class OpenLoopConfig:
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)  # offered request rates (req/s)
    duration_s: float = 30.0  # arrivals per rate; the requests still running after it are waited for
    warmup_frac: float = 0.2  # the window's first part, while the queue fills, is not measured
    tolerance: float = 0.02  # completed rate within 2% of offered; queue growth at most 2% of arrivals
    tpot_slo_s: float = 0.1  # the highest sustained rate whose TPOT p99 is within this is the arm's SLO rate
    grid: int = 50  # samples of requests-in-system over the window for the queue slope
    seed: int = 0


@dataclass
class Timing:
    """One request: its scheduled arrival, when it was sent, its first output token, its end (seconds, the
    clock's origin); tokens it produced; ok False when it failed."""

    arrival: float
    sent: float = 0.0
    first: float = 0.0
    done: float = 0.0
    tokens: int = 0
    ok: bool = True


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class RealClock:
    """Monotonic seconds since construction."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of `rate` per second (exponential gaps)."""
    if rate <= 0:
        return []
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_open_loop(send: Callable[[int, Timing], Awaitable[None]], arrivals: Sequence[float],
                        clock: Clock) -> list[Timing]:
    """Sends request i at arrivals[i] whether or not earlier ones have finished (open loop), then waits for all.
    `send(i, timing)` fills in first/done/tokens/ok with `clock.now()` as it goes."""
    timings = [Timing(a) for a in arrivals]
    tasks = []
    for i, timing in enumerate(timings):
        await clock.sleep_until(timing.arrival)
        timing.sent = clock.now()  # later than the arrival when the client itself falls behind: reported
        tasks.append(asyncio.ensure_future(send(i, timing)))
        await asyncio.sleep(0)  # let it start (submit) now, even when the next arrival is already due
    await asyncio.gather(*tasks)
    return timings


def percentiles(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] for q in (50, 90, 99)}


@dataclass
class RateResult:
    """One arm at one offered rate."""

    rate: float  # the nominal offered rate
    requests: int
    offered_rate: float  # arrivals in the window / the window (the schedule's own rate, Poisson noise included)
    completed_rate: float  # completions in the window / the window
    queue_slope: float  # requests-in-system per second over the window (least squares)
    sustained: bool
    per_user_tokens_per_s: float  # each request's tokens over its latency, averaged
    aggregate_tokens_per_s: float  # all tokens over the time from the first arrival to the last completion
    ttft_s: dict = field(default_factory=dict)  # p50 / p90 / p99
    tpot_s: dict = field(default_factory=dict)
    failed: int = 0
    send_lag_s: float = 0.0  # the largest delay between a request's scheduled arrival and its sending


def assess(rate: float, timings: Sequence[Timing], cfg: OpenLoopConfig) -> RateResult:
    """Rates, queue slope, sustained-or-not and latency percentiles of one open-loop run."""
    w0, w1 = cfg.warmup_frac * cfg.duration_s, cfg.duration_s
    width = w1 - w0
    ok = [t for t in timings if t.ok]
    arrived = sum(1 for t in timings if w0 <= t.sent < w1)
    lags = [t.done - t.sent for t in ok if w0 <= t.sent < w1]
    lag = statistics.median(lags) if lags else 0.0
    completed = sum(1 for t in ok if w0 + lag <= t.done < w1 + lag)
    offered_rate, completed_rate = arrived / width, completed / width
    slope = queue_slope(timings, w0, w1, cfg.grid)
    slack = max(cfg.tolerance * arrived, 1.0)
    sustained = (len(ok) == len(timings) and completed_rate * width >= (1 - cfg.tolerance) * arrived - 1
                 and slope * width <= slack)
    tpots = [(t.done - t.first) / (t.tokens - 1) for t in ok if t.tokens > 1]
    end = max((t.done for t in ok), default=0.0)
    start = min((t.sent for t in timings), default=0.0)
    return RateResult(
        rate=rate, requests=len(timings), offered_rate=offered_rate, completed_rate=completed_rate,
        queue_slope=slope, sustained=sustained,
        per_user_tokens_per_s=statistics.fmean(t.tokens / (t.done - t.sent) for t in ok if t.done > t.sent)
        if ok else 0.0,
        aggregate_tokens_per_s=sum(t.tokens for t in ok) / (end - start) if end > start else 0.0,
        ttft_s=percentiles([t.first - t.sent for t in ok if t.tokens]), tpot_s=percentiles(tpots),
        failed=len(timings) - len(ok), send_lag_s=max((t.sent - t.arrival for t in timings), default=0.0),
    )


def queue_slope(timings: Sequence[Timing], w0: float, w1: float, grid: int) -> float:
    """Least-squares slope (requests per second) of the number of requests in the system, sampled at `grid`
    evenly spaced times in [w0, w1]. A request that never finished stays in the system."""
    inf = float("inf")
    spans = [(t.sent, t.done if t.ok else inf) for t in timings]
    xs = [w0 + (w1 - w0) * i / (grid - 1) for i in range(grid)]
    ys = [sum(1 for a, d in spans if a <= x < d) for x in xs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def max_sustained(results: Sequence[RateResult], tpot_slo_s: float | None = None) -> float | None:
    """The highest rate sustained (and, with an SLO, with TPOT p99 within it) such that every lower rate tried
    was sustained too: a rate sustained only above a failing one is noise, not capacity."""
    best = None
    for r in sorted(results, key=lambda r: r.rate):
        within = tpot_slo_s is None or r.tpot_s.get("p99", float("inf")) <= tpot_slo_s
        if not (r.sustained and within):
            break
        best = r.rate
    return best


def matched_rates(a: Sequence[RateResult], b: Sequence[RateResult]) -> list[tuple[RateResult, RateResult]]:
    """Pairs of results at the same offered rate that both arms sustained: where they can be compared."""
    by_rate = {r.rate: r for r in b if r.sustained}
    return [(r, by_rate[r.rate]) for r in sorted(a, key=lambda r: r.rate) if r.sustained and r.rate in by_rate]


def combine_repeats(records: list[dict], repeats: int, arms: Sequence[str]) -> list[dict]:
    """One record per (arm, rate) from the open loop's `repeats` passes, in the order of `arms` then rate. Within a
    pass the arms take each rate in turn, so one phase of a drifting host can still sink one arm's reading; over
    passes the arm's speed is the median (its record: the pass at the lower median) and it sustains a rate where a
    majority of passes did (a pass that skipped the rate, having failed a lower one, counts as not sustaining it).
    One pass: unchanged."""
    if repeats <= 1:
        return list(records)
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in records:
        groups.setdefault((r["arm"], r["rate"]), []).append(r)
    order = {arm: i for i, arm in enumerate(arms)}
    out = []
    for (arm, rate), rs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        by_pass = {r["repeat"]: r for r in rs}
        speeds = sorted(r["per_user_tokens_per_s"] for r in rs)
        median = statistics.median(speeds)
        chosen = min(rs, key=lambda r: (abs(r["per_user_tokens_per_s"] - speeds[(len(speeds) - 1) // 2]),
                                        r["repeat"]))
        held = sum(r["sustained"] for r in rs)
        rec = {k: v for k, v in chosen.items() if k != "repeat"}
        rec.update(per_user_tokens_per_s=median, sustained=2 * held > repeats, sustained_passes=held, passes=repeats,
                   per_user_by_pass=[by_pass[p]["per_user_tokens_per_s"] if p in by_pass else None
                                     for p in range(repeats)])
        out.append(rec)
    return out
