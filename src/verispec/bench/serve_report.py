"""The report of `verispec bench serve`: its goals, summary table and plots (from the JSON report alone, so a
committed report can be re-rendered).

"Matched throughput" is open loop: two arms are compared at an offered request rate only when both sustain it
(`bench.openloop`), never by interpolating closed-loop curves (which, once the aggregate saturates, pairs points of
different concurrency).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.bench.openloop import RateResult, matched_rates, max_sustained

if TYPE_CHECKING:
    from verispec.bench.serve import ServeBenchConfig

SPEEDUP_GOAL = 1.6  # dspark's per-user speed over fixed k=1, at every matched rate up to 80% of saturation
LIGHT_TO = 0.8  # ... "saturation" being the highest rate plain decoding sustains
KEEP, LOSE = 0.97, 0.90  # at the highest load: dspark keeps 97% of plain's sustained rate, fixed-long at most 90%
# At the capacity rate an arm is overloaded where its queue grows by at least this share of the offered rate: busy
# throughout, so it completes requests at its capacity. Not "not sustained" alone: offered 16 req/s, plain completed
# 15.3-16.1 with its queue growing 0.4-1.7 a second (Zen 4): not busy throughout, so that read as a lower bound.
OVERLOAD = 0.1


def _rate_results(open_loop: list[dict], arm: str) -> list[RateResult]:
    fields = RateResult.__dataclass_fields__
    return [RateResult(**{k: v for k, v in r.items() if k in fields}) for r in open_loop if r["arm"] == arm]


def sustained_rates(open_loop: list[dict], tpot_slo_s: float) -> dict[str, dict]:
    """Per arm: the highest offered rate it sustains, and the highest it sustains with TPOT p99 within the SLO."""
    arms = dict.fromkeys(r["arm"] for r in open_loop)
    return {arm: {"max_sustained_rate": max_sustained(_rate_results(open_loop, arm)),
                  "max_rate_under_slo": max_sustained(_rate_results(open_loop, arm), tpot_slo_s),
                  "tpot_slo_s": tpot_slo_s} for arm in arms}


def capacities(records: list[dict], arms: list[str]) -> dict[str, dict]:
    """Per arm (in `arms`' order), from its records at the capacity rate (one per pass): the requests it completed
    per second there, per pass and as the median, and over plain's in the same pass (the arms of a pass run minutes
    apart, passes further: the ratio's median pairs like with like). Overloaded, an arm is busy throughout, so its
    completion rate is its capacity; `overloaded` is False unless a majority of passes saw its queue grow by at
    least OVERLOAD of the offered rate: the completion rate then only bounds the capacity from below."""
    by_arm: dict[str, dict[int, dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r.get("repeat") or 0] = r
    plain = by_arm.get("off", {})
    out = {}
    for arm in (a for a in arms if a in by_arm):
        passes = by_arm[arm]
        rates = [passes[p]["completed_rate"] for p in sorted(passes)]
        ratios = [passes[p]["completed_rate"] / plain[p]["completed_rate"] for p in sorted(passes)
                  if p in plain and plain[p]["completed_rate"] > 0]
        over = sum(r["queue_slope"] >= OVERLOAD * r["offered_rate"] for r in passes.values())
        out[arm] = {"rate": next(iter(passes.values()))["rate"], "completed_rate": statistics.median(rates),
                    "by_pass": rates, "vs_off": statistics.median(ratios) if ratios else None,
                    "vs_off_by_pass": ratios, "overloaded": 2 * over > len(passes), "overloaded_passes": over,
                    "passes": len(passes)}
    return out


def _ratios(ol: list[dict], arm: str, baseline: str, limit: float | None) -> list[dict]:
    """arm's per-user speed over baseline's at each rate both sustain (at most `limit` req/s where given)."""
    return [{"rate": a.rate, "ratio": a.per_user_tokens_per_s / b.per_user_tokens_per_s}
            for a, b in matched_rates(_rate_results(ol, arm), _rate_results(ol, baseline))
            if (limit is None or a.rate <= limit) and b.per_user_tokens_per_s > 0]


def _at_least(goal: str, ratios: list[dict], line: float) -> dict:
    worst = min((r["ratio"] for r in ratios), default=None)
    return {"goal": goal, "matched_points": ratios, "worst_ratio": worst, "met": worst is not None and worst >= line}


def goals(report: dict, cfg: ServeBenchConfig) -> list[dict]:
    """The issue's goals on the open-loop results (none when the open loop did not run), per drafter: the dspark
    policy's speed over fixed k=1 with the same drafter, and over MTP-1 (the MTP drafter at fixed k=1, the issue's
    baseline once that drafter exists) where the bench ran it; never slower than plain; and the highest load."""
    ol = report.get("open_loop") or []
    if not ol:
        return []
    out = []
    ran = {r["arm"] for r in ol}  # a bench run with --arms may leave some out: no goal names an arm that did not run
    if "off" not in ran:
        return []
    plain = max_sustained(_rate_results(ol, "off"))
    cap = report.get("capacity") or {}
    # "saturation": plain's capacity where it was measured overloaded, else the highest rate plain sustained
    measured = "off" in cap and cap["off"]["overloaded"]
    saturation = cap["off"]["completed_rate"] if measured else plain
    limit = LIGHT_TO * saturation if saturation is not None else -1.0  # no rate counts where plain sustained none
    labels = [d.split(":")[0] for d in cfg.drafters]
    for label in labels:
        dspark, fixed_long = f"dspark/{label}", f"fixed-{cfg.long_k}/{label}"
        if dspark not in ran:
            continue
        light = (f"at every rate both sustain, up to {LIGHT_TO:.0%} of plain's "
                 + ("capacity" if measured else "highest sustained rate"))
        if f"fixed-1/{label}" in ran:
            out.append(_at_least(f"dspark >= {SPEEDUP_GOAL:g}x per-user speed of fixed k=1 {light} ({label})",
                                 _ratios(ol, dspark, f"fixed-1/{label}", limit), SPEEDUP_GOAL))
        if "mtp" in labels and label != "mtp" and "fixed-1/mtp" in ran:
            out.append(_at_least(f"dspark >= {SPEEDUP_GOAL:g}x per-user speed of MTP-1 (fixed-1/mtp) {light} ({label})",
                                 _ratios(ol, dspark, "fixed-1/mtp", limit), SPEEDUP_GOAL))
        out.append(_at_least(f"dspark never slower than plain per user, at every rate both sustain ({label})",
                             _ratios(ol, dspark, "off", None), 1.0))
        if fixed_long not in ran:
            continue
        ds, fl = max_sustained(_rate_results(ol, dspark)), max_sustained(_rate_results(ol, fixed_long))
        if all(a in cap for a in ("off", dspark, fixed_long)):
            out.append(_capacity_goal(cap, dspark, fixed_long, cfg.long_k, label, grid=(plain, ds, fl)))
            continue
        goal = {"goal": f"at the highest load: dspark sustains >= {KEEP:.0%} of plain's highest sustained rate, "
                        f"fixed-{cfg.long_k} <= {LOSE:.0%} ({label})",
                "off": plain, "dspark": ds, f"fixed-{cfg.long_k}": fl, "met": False}
        if plain:
            goal.update(dspark_vs_off=(ds or 0.0) / plain, fixed_long_vs_off=(fl or 0.0) / plain,
                        met=(ds or 0.0) >= KEEP * plain and (fl or 0.0) <= LOSE * plain)
        out.append(goal)
    return out


def _capacity_goal(cap: dict, dspark: str, fixed_long: str, long_k: int, label: str,
                   grid: tuple[float | None, ...]) -> dict:
    """The highest-load goal on the capacities (`capacities`), the rate grid's highest sustained rates beside them.
    Met only where every arm was overloaded at the capacity rate."""
    off, ds, fl = cap["off"], cap[dspark], cap[fixed_long]
    measured = off["overloaded"] and ds["overloaded"] and fl["overloaded"]
    goal = {"goal": f"at the highest load: dspark's capacity >= {KEEP:.0%} of plain's, fixed-{long_k}'s <= {LOSE:.0%} "
                    f"(requests completed per second, offered {off['rate']:g} req/s; {label})",
            "off": off["completed_rate"], "dspark": ds["completed_rate"], f"fixed-{long_k}": fl["completed_rate"],
            "dspark_vs_off": ds["vs_off"], "fixed_long_vs_off": fl["vs_off"],
            "grid_off": grid[0], "grid_dspark": grid[1], f"grid_fixed-{long_k}": grid[2],
            "met": measured and ds["vs_off"] is not None and fl["vs_off"] is not None
            and ds["vs_off"] >= KEEP and fl["vs_off"] <= LOSE}
    if not measured:
        goal["why"] = ("an arm was not overloaded at the capacity rate (its completion rate bounds its capacity from "
                       "below): raise --capacity-rate")
    return goal


def summary_markdown(report: dict) -> str:
    lines = ["# Load benchmark (`verispec bench serve`)", ""]
    c = report["config"]
    lines += [f"Target `{c['target']}`, {c['dtype']}, {c['threads']} threads, {c['max_tokens']} new tokens per "
              f"request (greedy, ignore_eos), prompts from the shipped task sets mixed.", "",
              "## Closed loop (C clients, each sending its next request when its last one finished)", ""]
    lines += ["| arm | mode | load | requests | aggregate tok/s | per-user tok/s | τ | verified/round | "
              "TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | " + _POOL_HEAD, "|" + "---|" * 16]
    for r in report["results"]:
        lines.append(
            f"| {r['arm']} | {r['mode']} | {r['load']:g} | {r['requests']} | {r['aggregate_tokens_per_s']:.1f} | "
            f"{r['per_user_tokens_per_s']:.1f} | {r['tau']:.2f} | {r['mean_verified_per_round']:.2f} | "
            f"{r['ttft_s'].get('p50', 0) * 1e3:.0f} | {r['ttft_s'].get('p99', 0) * 1e3:.0f} | "
            f"{r['tpot_s'].get('p50', 0) * 1e3:.1f} | {r['tpot_s'].get('p99', 0) * 1e3:.1f} | {_pool(r)}")
    lines += _open_loop_lines(report)
    lines += ["", "## Goals", ""]
    for g in report["goals"]:
        detail = {k: v for k, v in g.items() if k not in ("goal", "met", "matched_points")}
        shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in detail.items())
        lines.append(f"- {g['goal']}: **{'met' if g['met'] else 'not met'}** ({shown})")
    p = report["profile"]
    lines += ["", "## Step-time profile (SPS)", "", "| tokens per step | ms |", "|---|---|"]
    lines += [f"| {b} | {s * 1e3:.2f} |" for b, s in zip(p["tokens"], p["seconds"])]
    lines.append(f"\nEach request beyond the first adds {p['per_request_s'] * 1e3:.2f} ms per step.")
    lines += ["", "![per-user vs aggregate](serve_pareto.png)", "", "![per-user vs offered rate](serve_openloop.png)",
              "", "![step-time profile](profile.png)"]
    return "\n".join(lines) + "\n"


def _line_style(arm: str) -> str:  # the dspark policy solid, plain dashed, the other policies dotted
    return "-" if arm.startswith("dspark") else ("--" if arm == "off" else ":")


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
        style = _line_style(arm)
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


def _open_loop_lines(report: dict) -> list[str]:
    ol = report.get("open_loop") or []
    if not ol:
        return []
    c = report["config"]
    lines = ["", "## Open loop (Poisson arrivals at a fixed offered rate, the same schedule for every arm)", "",
             f"{c['poisson_duration_s']:g} s of arrivals per rate, prompts of {c['min_prompt_tokens']} to "
             f"{c['max_prompt_tokens']} tokens. Sustained: completed rate within 2% of offered over the window after "
             "a 20% warm-up (completions counted one median latency later than arrivals), and the queue (requests "
             "in the system) not growing. Arms are compared only at rates "
             "both sustain." + (" Rates above the first one an arm did not sustain are not run for it."
                                if c.get("skip_above_unsustained") else "")
             + (" Load by load, every arm in turn, their order rotated by one each load and pass."
                if c.get("arm_order") == "per load" else "")
             + (f" {c['poisson_repeats']} passes, the arms' order rotated by one each pass: per arm and rate the "
                "median per-user speed (per pass in `serve_results.json`), sustained where a majority of passes "
                "sustained it (a pass that skipped the rate counts as not); the other columns are the median pass's."
                if c.get("poisson_repeats", 1) > 1 else ""), "",
             "| arm | offered req/s | realized | completed req/s | queue growth /s | sustained | per-user tok/s | "
             "TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | " + _POOL_HEAD, "|" + "---|" * 15]
    for r in ol:
        lines.append(
            f"| {r['arm']} | {r['rate']:g} | {r['offered_rate']:.2f} | {r['completed_rate']:.2f} | "
            f"{r['queue_slope']:+.3f} | {_held(r)} | {r['per_user_tokens_per_s']:.1f} | "
            f"{r['ttft_s'].get('p50', 0) * 1e3:.0f} | {r['ttft_s'].get('p99', 0) * 1e3:.0f} | "
            f"{r['tpot_s'].get('p50', 0) * 1e3:.1f} | {r['tpot_s'].get('p99', 0) * 1e3:.1f} | {_pool(r)}")
    slo = c["tpot_slo_s"]
    lines += ["", f"| arm | highest sustained rate (req/s) | highest with TPOT p99 <= {slo * 1e3:g} ms |",
              "|---|---|---|"]
    for arm, s in report["sustained"].items():
        lines.append(f"| {arm} | {_rate(s['max_sustained_rate'])} | {_rate(s['max_rate_under_slo'])} |")
    return lines + _capacity_lines(report)


def _capacity_lines(report: dict) -> list[str]:
    cap = report.get("capacity") or {}
    if not cap:
        return []
    rate = next(iter(cap.values()))["rate"]
    lines = ["", f"## Capacity (every arm offered {rate:g} req/s, above what it sustains)", "",
             f"Overloaded (its queue growing by at least {OVERLOAD:.0%} of the offered rate), an arm is busy throughout "
             "and completes requests at its capacity: the rate it could sustain, read finer than the grid of rates. "
             "Over plain: the median of per-pass ratios (each pass runs the arms close together).", "",
             "| arm | completed req/s (median) | per pass | over plain | per pass | overloaded in |",
             "|---|---|---|---|---|---|"]
    for arm, c in cap.items():
        vs = "-" if c["vs_off"] is None else f"{c['vs_off']:.3f}"
        lines.append(f"| {arm} | {c['completed_rate']:.2f} | {', '.join(f'{x:.2f}' for x in c['by_pass'])} | {vs} | "
                     f"{', '.join(f'{x:.3f}' for x in c['vs_off_by_pass'])} | "
                     f"{c['overloaded_passes']} of {c['passes']} passes |")
    return lines


_POOL_HEAD = "preemptions | prefix-cache hits | KV pool peak | steps kept plain by the draft gate |"


def _pool(r: dict) -> str:
    """The KV pool and gate columns (reports written before they were recorded show dashes)."""
    p = r.get("pool")
    if not p:
        return "- | - | - | - |"
    gate = f"{p['undrafted_steps']} of {p['steps']}" if "steps" in p else "-"
    return f"{p['preemptions']} | {p['prefix_hit_rate']:.0%} | {p['kv_peak_use']:.1%} | {gate} |"


def _held(r: dict) -> str:
    verdict = "yes" if r["sustained"] else "**no**"
    return f"{verdict} ({r['sustained_passes']} of {r['passes']} passes)" if "passes" in r else verdict


def _rate(x: float | None) -> str:
    return "none (not even the lowest rate)" if x is None else f"{x:g}"


def plot_open_loop(report: dict, path: Path) -> None:
    """Per-user tokens/s against offered rate, one line per arm; hollow markers where the arm did not sustain."""
    ol = report.get("open_loop") or []
    if not ol:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for arm in dict.fromkeys(r["arm"] for r in ol):
        pts = sorted((r for r in ol if r["arm"] == arm), key=lambda r: r["rate"])
        style = _line_style(arm)
        line, = ax.plot([r["rate"] for r in pts], [r["per_user_tokens_per_s"] for r in pts], style, label=arm)
        for r in pts:
            ax.plot(r["rate"], r["per_user_tokens_per_s"], "o", color=line.get_color(),
                    markerfacecolor=line.get_color() if r["sustained"] else "none")
    ax.set_xlabel("offered request rate (req/s, Poisson)")
    ax.set_ylabel("per-user tokens/s")
    ax.set_title("open loop: per-user speed at each offered rate (hollow: not sustained)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
