"""Issue 21's first tree measurements on this CPU, written to reports/trees/ (README.md, results.json, verify_cost.png).

    python scripts/tree_cost.py --out reports/trees

1. Verify cost per node count: one target forward of an anchor and N draft nodes after `--context` cached
   positions, N = 1..64, three ways, interleaved, medians: a chain on the native decoder (what chains run), the
   same chain on the torch path (explicit positions; separates the path's cost from the mask's) and a 4-ary tree
   of N nodes (positions and a tree mask: the torch path, since the native kernels decline non-causal masks).
2. Chain against tree drafts of the zoo's draft model on code prompts: plain, a chain of k, and EAGLE-2 dynamic
   trees of several sizes, arms interleaved per prompt, medians over repeats; τ, speed per output token and end
   to end against plain, and whether every output equals plain decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from verispec import LLM, SamplingParams
from verispec.api import set_threads
from verispec.bench.prompts import load_task
from verispec.cache import KVCache, tree_mask, tree_positions
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
NODES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
DRAFT = ROOT / "zoo/drafter"
# arm -> (drafter spec or None, k)
ARMS = {
    "plain": (None, 0),
    "chain k=8": (f"model:{DRAFT}", 8),
    "tree 8 nodes (width 4, depth 4)": (f"model(path={DRAFT}, tree=auto, width=4, depth=4, nodes=8)", 8),
    "tree 16 nodes (width 4, depth 8)": (f"model(path={DRAFT}, tree=auto, width=4, depth=8, nodes=16)", 16),
    "tree 32 nodes (width 4, depth 8)": (f"model(path={DRAFT}, tree=auto, width=4, depth=8, nodes=32)", 32),
}


def four_ary(n: int) -> list[int]:  # parents of a breadth-first 4-ary tree of n nodes (-1: the anchor)
    return [i // 4 - 1 for i in range(n)]


@torch.inference_mode()
def verify_cost(target_dir: Path, dtype: str, context: int, repeats: int) -> list[dict]:
    model = load_model(target_dir, dtype)
    cache = KVCache.for_model(model, max_len=context + max(NODES) + 2)
    gen = torch.Generator().manual_seed(0)
    model(torch.randint(3, model.config.vocab_size, (1, context), generator=gen), cache=cache)
    dev = model.device

    def chain(n: int, torch_path: bool) -> float:
        cache.truncate(context)
        x = torch.randint(3, model.config.vocab_size, (1, n + 1), generator=gen)
        pos = torch.arange(context, context + n + 1)[None] if torch_path else None
        t0 = time.perf_counter()
        model(x, cache=cache, positions=pos)
        return time.perf_counter() - t0

    def tree(n: int) -> float:
        cache.truncate(context)
        parents = four_ary(n)
        x = torch.randint(3, model.config.vocab_size, (1, n + 1), generator=gen)
        pos, mask = tree_positions(context, parents, dev)[None], tree_mask(context, parents, dev)
        t0 = time.perf_counter()
        model(x, cache=cache, positions=pos, attn_mask=mask)
        return time.perf_counter() - t0

    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(repeats + 1):  # the first pass warms up, untimed
        for n in (0, *NODES):
            for kind, fn in (("chain native", lambda n: chain(n, False)), ("chain torch", lambda n: chain(n, True)),
                             ("tree torch", tree)):
                if n == 0 and kind != "chain native":
                    continue
                t = fn(n)
                if rep:
                    times.setdefault((kind, n), []).append(t)
    step = statistics.median(times[("chain native", 0)])
    rows = [{"nodes": 0, "chain native": step * 1e3}]
    for n in NODES:
        rows.append({"nodes": n, **{k: statistics.median(times[(k, n)]) * 1e3
                                    for k in ("chain native", "chain torch", "tree torch")}})
    return rows


def decode_arms(target_dir: Path, dtype: str, n_prompts: int, max_tokens: int, repeats: int) -> list[dict]:
    tok = Tokenizer.from_dir(target_dir)
    prompts = [tok.encode(r["prompt"])[-(2048 - max_tokens - 40):] for r in load_task("code_completion")[:n_prompts]]
    target = load_model(target_dir, dtype)
    arms = {name: LLM(target, drafter=spec, k=k, tokenizer=target_dir) if spec else LLM(target, tokenizer=target_dir)
            for name, (spec, k) in ARMS.items()}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for llm in arms.values():
        llm.generate(prompts[0], params)
    tot = {a: [] for a in arms}
    dec = {a: [] for a in arms}
    stats = {a: {"tokens": 0, "drafts": 0, "accepted": 0, "equal": 0} for a in arms}
    for rep in range(repeats):
        t_rep = {a: 0.0 for a in arms}
        d_rep = {a: 0.0 for a in arms}
        for p in prompts:
            plain = None
            for a, llm in arms.items():
                r = llm.generate(p, params)[0]
                t_rep[a] += r.stats.elapsed_s
                d_rep[a] += r.stats.decode_s
                if a == "plain":
                    plain = r.token_ids
                elif rep == 0:
                    stats[a]["equal"] += r.token_ids == plain
                if rep == 0:
                    stats[a]["tokens"] += len(r.token_ids)
                    stats[a]["drafts"] += r.stats.num_drafts
                    stats[a]["accepted"] += r.stats.num_accepted_tokens
        for a in arms:
            tot[a].append(t_rep[a])
            dec[a].append(d_rep[a])
    out = []
    for a in arms:
        s = stats[a]
        out.append({"arm": a, "spec": ARMS[a][0], "k": ARMS[a][1],
                    "tokens_per_s": s["tokens"] / statistics.median(tot[a]),
                    "speedup": statistics.median(b / t for b, t in zip(tot["plain"], tot[a])),
                    "decode_speedup": statistics.median(b / t for b, t in zip(dec["plain"], dec[a])),
                    "tau": 1 + s["accepted"] / s["drafts"] if s["drafts"] else None,
                    "equal": s["equal"], "prompts": len(prompts)})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["nodes"] for r in rows[1:]]
    for k in ("chain native", "chain torch", "tree torch"):
        ax.plot(xs, [r[k] for r in rows[1:]], marker="o", label=k)
    ax.axhline(rows[0]["chain native"], color="gray", lw=0.8, ls="--", label="one-token step (native)")
    ax.set_xlabel("draft nodes verified (plus the anchor)")
    ax.set_ylabel("ms per target forward")
    ax.set_title("verify cost per node count")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_readme(out: Path, res: dict, command: str) -> None:
    cost, arms = res["verify_cost"], {a["arm"]: a for a in res["decode"]}
    by_n = {r["nodes"]: r for r in cost}
    a = res["args"]
    L = ["# Draft trees on a CPU (issue 21, first measurements)", "",
         "Produced by one command (a few minutes; the numbers are also in results.json):", "", "```bash", command,
         "```", "", "Machine (lscpu):", "", "```", *res["cpu"], "```", "",
         f"## Verify cost per node count ({a['dtype']} zoo/target, {a['context']} cached positions, 2 threads)", "",
         "One target forward of the anchor and N draft nodes, median of interleaved repeats, ms. *chain native*: "
         "the causal forward on the native decoder (what chains run on a CPU); *chain torch*: the same rows on the "
         "torch path (explicit positions), to separate the path's cost from the mask's; *tree torch*: a 4-ary tree "
         "of N nodes with its tree mask (the native kernels decline non-causal masks, so trees take the torch path).",
         "", "| nodes | chain native | chain torch | tree torch | tree torch / chain native |",
         "|---:|---:|---:|---:|---:|",
         f"| 0 (one-token step) | {by_n[0]['chain native']:.2f} | | | |"]
    for r in cost[1:]:
        L.append(f"| {r['nodes']} | {r['chain native']:.2f} | {r['chain torch']:.2f} | {r['tree torch']:.2f} | "
                 f"{r['tree torch'] / r['chain native']:.2f}x |")
    L += ["", "![verify cost](verify_cost.png)", "",
          f"## Chain against tree drafts of zoo/drafter ({a['prompts']} code_completion prompts, {a['max_tokens']} "
          f"new tokens, greedy, {a['dtype']}, medians of {a['decode_repeats']} interleaved repeats)", "",
          "| arm | k | tok/s e2e | x plain e2e | x plain per token | τ | = plain |",
          "|---|---:|---:|---:|---:|---:|---|"]
    for r in res["decode"]:
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        eq = "(reference)" if r["spec"] is None else f"{r['equal']}/{r['prompts']}"
        L.append(f"| {r['arm']} | {r['k']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                 f"{r['decode_speedup']:.2f}x | {tau} | {eq} |")
    chain = arms["chain k=8"]
    trees = [r for r in res["decode"] if r["arm"].startswith("tree")]
    best = max(trees, key=lambda r: r["decode_speedup"])
    L += ["", "## Does a tree pay here?", "",
          f"- Goal (issue 21): the best tree >= 1.1x the best chain of the same drafter per output token. Best tree "
          f"here: {best['arm']}, {best['decode_speedup'] / chain['decode_speedup']:.2f}x the chain of 8 -> "
          f"**{'met' if best['decode_speedup'] >= 1.1 * chain['decode_speedup'] else 'not met'}**."]
    for r in trees:
        n = r["k"]
        if n in by_n and r["tau"]:
            L.append(f"- {r['arm']}: τ {r['tau'] / chain['tau']:.2f}x the chain's, for a verify forward "
                     f"{by_n[n]['tree torch'] / by_n[8]['chain native']:.2f}x the chain's as run "
                     f"({by_n[n]['chain native'] / by_n[8]['chain native']:.2f}x even with a native tree kernel "
                     f"costing what a native chain of {n} does).")
    L += ["- On this CPU a verify forward is compute-bound past a few rows: its cost grows with every node "
          "(the native chain of 64 costs "
          f"{by_n[64]['chain native'] / by_n[0]['chain native']:.1f}x a one-token step), while draft trees assume a "
          "verify forward whose cost barely grows with its rows (a GPU's premise, not measured here). A tree's "
          "extra nodes buy little τ (the draft model's top-1 chain is "
          "usually the accepted path), so the cost of verifying them is not repaid; the torch path's fixed "
          "overhead (chain torch against chain native) is the rest of the gap. SpecMQuant reports the same "
          "finding for low-bit targets; the quantized report (reports/quant/) shows the 9-row int4 verify at "
          "2.5-3x a one-token step.",
          "- Not measured yet (issue 21 asks for them): EAGLE-3, MTP and Medusa drafters and their trees, DSpark "
          "node budgets, prose prompts, a native tree-mask attention kernel.", ""]
    (out / "README.md").write_text("\n".join(L))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "zoo/target")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15, help="verify-cost repeats")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "reports/trees")
    ap.add_argument("--rerender", action="store_true", help="rewrite README.md from OUT/results.json")
    args = ap.parse_args()
    command = "python scripts/tree_cost.py --out " + (str(args.out.relative_to(ROOT)) if args.out.is_relative_to(ROOT)
                                                     else str(args.out))
    if args.rerender:
        write_readme(args.out, json.loads((args.out / "results.json").read_text()), command)
        return
    set_threads(args.threads)
    cost = verify_cost(args.target, args.dtype, args.context, args.repeats)
    print("verify cost done", flush=True)
    arms = decode_arms(args.target, args.dtype, args.prompts, args.max_tokens, args.decode_repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = [line.strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
           if line.startswith(("Model name", "CPU family", "Model:", "Flags"))]
    res = {"args": {k: v if isinstance(v, (int, str)) else str(v) for k, v in vars(args).items()}, "cpu": cpu,
           "verify_cost": cost, "decode": arms}
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(cost, args.out / "verify_cost.png")
    write_readme(args.out, res, command)
    print(f"wrote {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
