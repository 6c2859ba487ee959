"""Issue 23's report: VeriCache on the zoo target over the long-context prompts, written to reports/vericache/.

    python scripts/vericache_report.py --prompts 4 --repeats 3 --out reports/vericache
    bash scripts/target_2k.sh && python scripts/vericache_report.py --target data/target-2k --repeats 2 \
        --out reports/vericache/target-2k   # the 2,048-window stage

1. Step costs against context length (the speed model's inputs): a forward of 1..33 rows after 64..1,900 cached
   positions, for the bf16 target and its int4 (w4a16 g32 RTN) copy, medians of 31 (row counts interleaved).
2. Acceptance (greedy, fixed horizon 32): mean accepted run per round and per-position acceptance (per_position.png) for each
   compressor x budget x prompt length, drafting with the target's own weights (and its int4 copy for snapkv), and
   the compressed view's memory against the full cache's at the end of each run (greedy: timing-free, so
   `--skip acceptance` keeps the last run's rows).
3. Speed (bf16 target, greedy, 192 new tokens): plain, the best single drafters (dspark, lookup:dspark, k=8) and
   vericache alone and composed (k=32, adaptive horizon unless named fixed; drafting on the target's own weights,
   its w4a16 copy, or its W4A8 copy with an int8 head), arms interleaved per prompt, medians over repeats, end to
   end (prefill included) and per output token, and the end-to-end ceiling plain's prefill share sets; every output
   checked against plain.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from verispec.bench.prompts import load_task
from verispec.cache import KVCache
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import build_drafter
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TARGET, DSPARK = ROOT / "zoo/target", ROOT / "zoo/dspark"
COMPRESSORS = ("streaming", "snapkv", "retrieval", "snapkv+kivi")
BUDGETS = (64, 128, 256, 512)


def int4_copy(target: Path, cache: Path) -> Path:
    """The target's w4a16 g32 RTN copy (made once): the zoo target's under its old name, another's by its own."""
    out = cache / ("w4a16-g32" if target == TARGET else f"{target.name}-w4a16-g32")
    if not (out / "quantization.json").is_file():
        quantize_checkpoint(target, out, QuantizeConfig(scheme="w4a16", group_size=32), progress=False)
    return out


def w4a8_copy(target: Path, cache: Path) -> Path:
    """The target's W4A8 copy (made once): w4a16 g32's int4 weights with each matmul input rounded to int8 (the
    int4 x int8 tiles) and the LM head int8 per channel, the cheapest one-row step the kernels have
    (reports/quant)."""
    out = cache / f"{target.name}-w4a8-head8-g32"
    if not (out / "quantization.json").is_file():
        quantize_checkpoint(target, out, QuantizeConfig(scheme="w4a8", group_size=32, lm_head="w8a16"), progress=False)
    return out


def step_costs(target: Path, int4: Path) -> dict:
    """Median of 31 forwards per cell; the row counts are interleaved within each repeat so that a slow spell of
    the host spreads over every cell of a context instead of landing on one."""
    toks = torch.randint(3, 8000, (1, 2048), generator=torch.Generator().manual_seed(0))
    rows_swept = (1, 2, 4, 8, 9, 17, 33)
    out = {}
    for name, path in (("bf16", target), ("w4a16", int4)):
        m = load_model(path, dtype="bf16")
        for ctx in (64, 256, 512, 1000, 1500, 1900):
            c = KVCache.for_model(m, 2048)
            ts: dict[int, list[float]] = {r: [] for r in rows_swept}
            with torch.inference_mode():
                m(toks[:, :ctx], cache=c, num_logits=0)
                for _ in range(33):
                    for rows in rows_swept:
                        t0 = time.perf_counter()
                        m(toks[:, ctx : ctx + rows], cache=c)
                        ts[rows].append(time.perf_counter() - t0)
                        c.truncate(ctx)
            for rows in rows_swept:
                out[f"{name}/{ctx}/{rows}"] = statistics.median(ts[rows][2:]) * 1e3
        print("step costs", name, "done", flush=True)
    return out


def run(target, ids, spec: str | None, k: int, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    drafter = build_drafter(spec, target=target, dtype=target.dtype, device=target.device) if spec else None
    memory = []
    if drafter is not None and hasattr(drafter, "memory"):  # the view's size just before the sequence ends
        finish = drafter.finish
        drafter.finish = lambda seq_id: (memory.append(drafter.memory(seq_id)), finish(seq_id))
    t0 = time.perf_counter()
    res = decode(target, ids, params, drafter=drafter, spec=SpecConfig(k=k) if drafter else SpecConfig())
    return res, time.perf_counter() - t0, (memory[0] if memory else None)


def acceptance(target, prompts, int4: Path, max_tokens: int) -> list[dict]:
    rows = []
    configs = [(c, b, None) for c in COMPRESSORS for b in BUDGETS] + [("snapkv", b, int4) for b in BUDGETS]
    for comp, budget, weights in configs:
        w = f",weights={weights}" if weights else ""
        spec = f"vericache(compress={comp},budget={budget},horizon=fixed{w})"
        for p in prompts:
            res, _, mem = run(target, p["ids"], spec, 32, max_tokens)
            s = res.stats
            rows.append({"compress": comp, "budget": budget, "weights": "w4a16" if weights else "bf16",
                         "bucket": p["length_bucket"], "prompt": p["id"], "rounds": s.num_rounds,
                         "drafts": s.num_drafts, "accepted": s.num_accepted_tokens,
                         "per_pos": list(s.accepted_per_pos), "view_bytes": mem[0], "full_bytes": mem[1]})
        print("acceptance", spec, flush=True)
    return rows


@torch.inference_mode()
def margins(target, prompts, max_tokens: int) -> list[dict]:
    """How decided the target is over its own greedy continuation: the mean top-1 probability and the share of
    positions whose top-2 margin is under 0.1 (where a lossy view's small perturbation flips the argmax)."""
    rows = []
    for p in prompts:
        res, _, _ = run(target, p["ids"], None, 0, max_tokens)
        seq = torch.tensor([p["ids"] + res.token_ids[:-1]])
        logits, _ = target(seq, num_logits=len(res.token_ids))
        top = logits[0].float().softmax(-1).topk(2, dim=-1).values  # [n, 2]
        rows.append({"bucket": p["length_bucket"], "prompt": p["id"], "top1": float(top[:, 0].mean()),
                     "close": float(((top[:, 0] - top[:, 1]) < 0.1).float().mean())})
    return rows


@torch.inference_mode()
def positions(target, prompts, window: int = 256, short: int = 768) -> list[dict]:
    """Is the target worse far from the start? Teacher-forced loss of each prompt's last `window` tokens given the
    whole prompt before them, against only the `short` tokens before them (so every position stays under the
    1,024-token windows the zoo target was trained on). More context should never raise the loss of a model that
    generalises to those positions."""
    rows = []
    for p in prompts:
        ids = torch.tensor([p["ids"]])
        n = ids.shape[1]
        out = {"bucket": p["length_bucket"], "prompt": p["id"], "tokens": n}
        for name, start in (("full", 0), ("short", max(0, n - window - short))):
            logits, _ = target(ids[:, start:], num_logits=window + 1)
            logp = logits[0, :-1].float().log_softmax(-1)  # [window, V] predicting the last `window` tokens
            gold = ids[0, n - window :]
            out[f"nll_{name}"] = float(-logp.gather(-1, gold[:, None]).mean())
            out[f"top1_{name}"] = float((logp.argmax(-1) == gold).float().mean())
        rows.append(out)
    return rows


def speed(target, prompts, int4: Path, w4a8: Path, repeats: int, max_tokens: int,
          only: set[str] | None = None) -> tuple[list[dict], dict]:
    vc = "vericache(compress=snapkv,budget=256"
    arms = {
        "plain": (None, 0),
        "dspark": (f"dspark:{DSPARK}", 8),
        "lookup:dspark": (f"lookup:dspark:{DSPARK}", 8),
        "vericache snapkv-256": (vc + ")", 32),
        "vericache snapkv-256 int4": (vc + f",weights={int4})", 32),
        "vericache snapkv-256 int4 fixed-8": (vc + f",weights={int4},horizon=fixed)", 8),
        "vericache retrieval-256 int4": (f"vericache(compress=retrieval,budget=256,weights={int4})", 32),
        "vericache snapkv-256 int4 + lookup:dspark": (vc + f",weights={int4},draft=lookup:dspark:{DSPARK})", 32),
        "vericache snapkv-256 w4a8": (vc + f",weights={w4a8})", 32),
        "vericache snapkv-256 w4a8 + lookup:dspark": (vc + f",weights={w4a8},draft=lookup:dspark:{DSPARK})", 32),
    }
    if only:  # plain always: every arm is measured against it
        arms = {a: v for a, v in arms.items() if a == "plain" or a in only}
    for spec, k in arms.values():  # warm-up: kernel libraries built and loaded, step profiles measured
        run(target, prompts[0]["ids"], spec, k, 8)
    rows = []
    for p in prompts:
        plain_ids = None
        for r in range(repeats):
            for arm, (spec, k) in arms.items():
                res, secs, _ = run(target, p["ids"], spec, k, max_tokens)
                if arm == "plain":
                    plain_ids = plain_ids or res.token_ids
                rows.append({"arm": arm, "bucket": p["length_bucket"], "prompt": p["id"], "repeat": r,
                             "e2e_s": secs, "prefill_s": res.stats.prefill_s, "tokens": len(res.token_ids),
                             "tau": res.stats.tau, "equal": res.token_ids == plain_ids})
        print("speed", p["id"], flush=True)
    return rows, {a: s for a, (s, _) in arms.items()}


def summarize(rows_acc, rows_speed, costs, specs, args, margins=(), positions=()) -> str:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in cpu.splitlines() if l.startswith("Flags")), [])
    isa = " ".join(f for f in flags if f.startswith(("avx", "amx", "fma")))
    tdir = args.target.resolve()
    target = tdir.relative_to(ROOT) if tdir.is_relative_to(ROOT) else tdir
    out_dir = args.out.resolve().relative_to(ROOT) if args.out.resolve().is_relative_to(ROOT) else args.out
    out = [f"# VeriCache on {target} (issue 23)", "",
           f"Machine: {model}, {torch.get_num_threads()} threads, flags `{isa}`; torch {torch.__version__}, "
           f"Python {platform.python_version()}. Command: `python scripts/vericache_report.py --target {target} "
           f"--prompts {args.prompts} --repeats {args.repeats} --max-tokens {args.max_tokens} --out {out_dir}"
           + (f" --skip {args.skip}" if args.skip else "") + (f" --arms '{args.arms}'" if args.arms else "")
           + "`" + (" (the skipped sections are the last run's, from raw.json)" if args.skip else "") + ".", ""]
    out += ["## Step costs against context length (ms, one forward of R rows after C cached positions)", "",
            "| weights | C | " + " | ".join(f"R={r}" for r in (1, 2, 4, 8, 9, 17, 33)) + " |",
            "|---|---|" + "---|" * 7]
    for name in ("bf16", "w4a16"):
        for ctx in (64, 256, 512, 1000, 1500, 1900):
            out.append(f"| {name} | {ctx} | " + " | ".join(f"{costs[f'{name}/{ctx}/{r}']:.2f}"
                                                         for r in (1, 2, 4, 8, 9, 17, 33)) + " |")
    out += ["", "## Acceptance (greedy, horizon fixed at 32)", "",
            "Mean accepted run = accepted draft tokens per round (the bonus token not counted); pos1 = share of "
            "rounds whose first drafted token was accepted; memory = the view's bytes in its storage format / the "
            "full cache's, at the end of the run.", "",
            "| compressor | budget | weights | bucket | mean accepted run | pos1 | memory |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["compress"], r["budget"], r["weights"], r["bucket"]) for r in rows_acc},
                  key=lambda t: (t[2], t[0], t[1], t[3]))
    for comp, budget, w, bucket in keys:
        sel = [r for r in rows_acc if (r["compress"], r["budget"], r["weights"], r["bucket"]) == (comp, budget, w, bucket)]
        drafts = max(1, sum(r["drafts"] for r in sel))
        acc = sum(r["accepted"] for r in sel) / drafts
        pos1 = sum(r["per_pos"][0] if r["per_pos"] else 0 for r in sel) / drafts
        mem = statistics.mean(r["view_bytes"] / r["full_bytes"] for r in sel)
        out.append(f"| {comp} | {budget} | {w} | {bucket} | {acc:.2f} | {pos1:.2f} | {mem:.2f} |")
    if margins:
        out += ["", "## How decided the target is over its own continuation (bf16, greedy)", "",
                "| bucket | mean top-1 probability | positions with top-2 margin < 0.1 |", "|---|---|---|"]
        for bucket in sorted({m["bucket"] for m in margins}):
            sel = [m for m in margins if m["bucket"] == bucket]
            out.append(f"| {bucket} | {statistics.mean(m['top1'] for m in sel):.3f} | "
                       f"{statistics.mean(m['close'] for m in sel):.3f} |")
    if positions:
        out += ["", "## Far positions: the last 256 prompt tokens, teacher-forced (bf16)", "",
                "Loss (nats/token) and argmax accuracy of each prompt's last 256 tokens given the whole prompt, and "
                "given only the 768 tokens before them (every position < 1,024, the zoo target's training window).", "",
                "| bucket | prompt tokens | loss, whole prompt | loss, last 1,024 only | top-1, whole | top-1, last 1,024 |",
                "|---|---|---|---|---|---|"]
        for bucket in sorted({m["bucket"] for m in positions}):
            sel = [m for m in positions if m["bucket"] == bucket]
            out.append(f"| {bucket} | {statistics.mean(m['tokens'] for m in sel):.0f} | "
                       f"{statistics.mean(m['nll_full'] for m in sel):.3f} | "
                       f"{statistics.mean(m['nll_short'] for m in sel):.3f} | "
                       f"{statistics.mean(m['top1_full'] for m in sel):.3f} | "
                       f"{statistics.mean(m['top1_short'] for m in sel):.3f} |")
    out += ["", "## Speed (bf16 target, greedy, median over repeats per prompt, then median over prompts)", "",
            "| arm | bucket | e2e speedup vs plain | per-token speedup vs plain | tau | outputs equal |",
            "|---|---|---|---|---|---|"]
    for arm in specs:
        for bucket in sorted({r["bucket"] for r in rows_speed}):
            e2e, tok, taus, eq = [], [], [], True
            for pid in sorted({r["prompt"] for r in rows_speed if r["bucket"] == bucket}):
                def med(a: str, key) -> float:
                    return statistics.median(key(r) for r in rows_speed if r["arm"] == a and r["prompt"] == pid)
                e2e.append(med("plain", lambda r: r["e2e_s"]) / med(arm, lambda r: r["e2e_s"]))
                tok.append(med("plain", lambda r: r["e2e_s"] - r["prefill_s"]) /
                           med(arm, lambda r: r["e2e_s"] - r["prefill_s"]))
                taus.append(med(arm, lambda r: r["tau"]))
                eq = eq and all(r["equal"] for r in rows_speed if r["arm"] == arm and r["prompt"] == pid)
            out.append(f"| {arm} | {bucket} | {statistics.median(e2e):.2f}x | {statistics.median(tok):.2f}x | "
                       f"{statistics.median(taus):.2f} | {'yes' if eq else 'NO'} |")
    out += ["", "Ceiling: plain decoding's prefill is the same for every arm, so no drafter's end-to-end speedup can "
            "exceed (plain's time) / (its prefill time) at these lengths (Amdahl):", ""]
    for bucket in sorted({r["bucket"] for r in rows_speed}):
        share = statistics.median(r["prefill_s"] / r["e2e_s"] for r in rows_speed
                                  if r["arm"] == "plain" and r["bucket"] == bucket)
        out.append(f"- {bucket}: prefill {share:.0%} of plain's time, so at most {1 / share:.2f}x end to end")
    out += ["", "Specs: " + "; ".join(f"`{a}` = `{s}`" for a, s in specs.items() if s).replace(str(ROOT) + "/", "")]
    return "\n".join(out) + "\n"


def plots(rows_acc, costs, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ctxs = (64, 256, 512, 1000, 1500, 1900)
    for name in ("bf16", "w4a16"):
        for rows in (1, 17):
            ax.plot(ctxs, [costs[f"{name}/{c}/{rows}"] for c in ctxs], marker="o", label=f"{name}, {rows} rows")
    ax.set_xlabel("cached positions"), ax.set_ylabel("forward (ms)"), ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout(), fig.savefig(out / "step_cost.png", dpi=120), plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    big = max(r["bucket"] for r in rows_acc)
    for comp in COMPRESSORS:
        for w in ("bf16", "w4a16"):
            sel = [r for r in rows_acc if r["compress"] == comp and r["weights"] == w and r["bucket"] == big]
            if not sel:
                continue
            ys = [sum(r["accepted"] for r in sel if r["budget"] == b) / max(1, sum(r["drafts"] for r in sel
                                                                                  if r["budget"] == b)) for b in BUDGETS]
            ax.plot(BUDGETS, ys, marker="o", label=f"{comp} ({w})")
    ax.axhline(12, color="grey", ls="--", label="goal: 12")
    ax.set_xscale("log", base=2), ax.set_xlabel("budget (tokens)"), ax.set_ylabel("mean accepted run")
    ax.set_title(f"~{big}-token prompts"), ax.legend(fontsize=7), ax.grid(alpha=0.3)
    fig.tight_layout(), fig.savefig(out / "acceptance.png", dpi=120), plt.close(fig)
    buckets = sorted({r["bucket"] for r in rows_acc})
    fig, axes = plt.subplots(1, len(buckets), figsize=(4 * len(buckets), 3.6), sharey=True)
    for ax, bucket in zip(axes, buckets):
        for comp in COMPRESSORS:
            sel = [r for r in rows_acc if (r["compress"], r["budget"], r["weights"], r["bucket"]) == (comp, 256, "bf16", bucket)]
            if not sel:
                continue
            drafts = max(1, sum(r["drafts"] for r in sel))
            depth = max(len(r["per_pos"]) for r in sel)
            ys = [sum(r["per_pos"][j] for r in sel if j < len(r["per_pos"])) / drafts for j in range(depth)]
            ax.plot(range(1, depth + 1), ys, label=comp)
        ax.set_title(f"~{bucket}-token prompts, budget 256"), ax.set_xlabel("draft position"), ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of rounds accepting it"), axes[0].legend(fontsize=7)
    fig.tight_layout(), fig.savefig(out / "per_position.png", dpi=120), plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per length bucket")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=Path, default=TARGET,
                    help="the target and the drafting weights' source (data/target-2k: scripts/target_2k.sh)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/vericache")
    ap.add_argument("--arms", default="", help="comma-separated speed arms to run (plain always; default: all)")
    ap.add_argument("--skip", default="",
                    help="comma-separated sections to skip (their rows from the last run's raw.json are kept): "
                         "costs, acceptance, margins, positions, speed")
    args = ap.parse_args()
    tdir = args.target.resolve()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    int4, w4a8 = int4_copy(tdir, ROOT / ".cache/quant"), w4a8_copy(tdir, ROOT / ".cache/quant")
    tok = Tokenizer.from_dir(tdir)
    prompts = []
    for bucket in (1000, 1500, 1900):
        for rec in [r for r in load_task("long_context") if r["length_bucket"] == bucket][: args.prompts]:
            prompts.append({**rec, "ids": tok.encode(rec["prompt"])})
    target = load_model(tdir, dtype="bf16")
    raw = args.out / "raw.json"
    data = json.loads(raw.read_text()) if raw.is_file() else {}
    if "costs" not in skip:
        data["costs"] = step_costs(tdir, int4)
    if "acceptance" not in skip:
        data["acceptance"] = acceptance(target, prompts, int4, args.max_tokens)
    if "margins" not in skip:
        data["margins"] = margins(target, prompts, args.max_tokens)
    if "positions" not in skip:
        data["positions"] = positions(target, prompts)
    if "speed" not in skip:
        data["speed"], data["specs"] = speed(target, prompts, int4, w4a8, args.repeats, args.max_tokens,
                                             set(filter(None, args.arms.split(","))))
    raw.write_text(json.dumps(data))
    (args.out / "summary.md").write_text(summarize(data["acceptance"], data["speed"], data["costs"], data["specs"], args,
                                                   data.get("margins", ()), data.get("positions", ())))
    plots(data["acceptance"], data["costs"], args.out)
    print((args.out / "summary.md").read_text())


if __name__ == "__main__":
    main()
