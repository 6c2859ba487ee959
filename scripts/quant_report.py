"""Issue 20's first report: quantized targets x drafters on the zoo, written to reports/quant/README.md.

    python scripts/quant_report.py --prompts-per-task 8 --max-tokens 128 --repeats 5 --out reports/quant

1. Makes (or reuses, under .cache/quant/) w8a16, w4a16 g32 RTN and w4a16 g32 GPTQ copies of zoo/target.
2. Quality, fp32 activations: greedy agreement of each copy with the unquantized target over the bench's
   code_completion prompts, and held-out perplexity on the bench's code and prose records (prompt + reference).
3. Speed, bf16 activations: {bf16, w8a16, w4a16 RTN} x {plain, dspark, lookup:dspark} (k=8), arms interleaved per
   prompt, medians over repeats, on the bench prompts (~590 tokens) and a short bucket (their last 64 tokens);
   every speculative output is checked against the same target's plain greedy output.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from verispec import LLM, SamplingParams
from verispec.api import set_threads
from verispec.bench.prompts import PROMPT_DIR
from verispec.model.tokenizer import Tokenizer
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "zoo/target"
DSPARK = ROOT / "zoo/dspark"
# name -> QuantizeConfig (None: the dense checkpoint itself)
COPIES = {
    "bf16": None,
    "w8a16": QuantizeConfig(scheme="w8a16"),
    "w4a16": QuantizeConfig(scheme="w4a16", group_size=32),
    "w4a16-gptq": QuantizeConfig(scheme="w4a16", group_size=32, method="gptq", calib_samples=32, calib_len=512),
}
SPEED_TARGETS = ("bf16", "w8a16", "w4a16")
DRAFTERS = {"plain": None, "dspark": f"dspark:{DSPARK}", "lookup:dspark": f"lookup:dspark:{DSPARK}"}


def target_dirs(cache: Path, with_gptq: bool, w4_group: int = 32) -> tuple[dict[str, Path], dict[str, float]]:
    """Each copy's checkpoint directory, quantizing the ones not cached yet, and the seconds each took (kept
    beside the cached copy in quantize_seconds.txt). The w4a16 copies use groups of `w4_group`."""
    dirs, seconds = {}, {}
    for name, cfg in COPIES.items():
        if cfg is not None and cfg.scheme == "w4a16":
            cfg = replace(cfg, group_size=w4_group)
        if cfg is None:
            dirs[name] = TARGET
            continue
        if cfg.method == "gptq" and not with_gptq:
            continue
        out = cache / f"{name}-g{cfg.group_size or 0}"
        if not (out / "quantization.json").is_file():
            t0 = time.perf_counter()
            quantize_checkpoint(TARGET, out, cfg, progress=False)
            (out / "quantize_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
            print(f"quantized {name} -> {out}", flush=True)
        dirs[name] = out
        if (out / "quantize_seconds.txt").is_file():
            seconds[name] = float((out / "quantize_seconds.txt").read_text())
    return dirs, seconds


def records(task: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPT_DIR / f"{task}.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- quality

@torch.inference_mode()
def perplexity(llm: LLM, texts: list[list[int]]) -> float:
    """exp of the mean next-token NLL over every token of every text (one forward each, no cache)."""
    nll, n = 0.0, 0
    for ids in texts:
        x = torch.tensor(ids)[None]
        logits, _ = llm.target(x)
        logp = torch.log_softmax(logits[0, :-1].float(), -1)
        nll -= logp.gather(-1, x[0, 1:, None]).sum().item()
        n += len(ids) - 1
    return math.exp(nll / n)


def quality(dirs: dict[str, Path], tok: Tokenizer, n_prompts: int, n_tokens: int, n_ppl: int) -> dict:
    ctx = 2048
    prompts = [tok.encode(r["prompt"])[-(ctx - n_tokens - 1):] for r in records("code_completion")[:n_prompts]]
    held = {task: [tok.encode(r["prompt"] + r["reference"])[-ctx:] for r in records(task)[:n_ppl]]
            for task in ("code_completion", "prose")}
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    outs, out = {}, {}
    for name, d in dirs.items():
        llm = LLM(d, dtype="fp32")
        t0 = time.perf_counter()
        outs[name] = [r.token_ids for r in llm.generate(prompts, params)]
        out[name] = {"ppl_code": perplexity(llm, held["code_completion"]), "ppl_prose": perplexity(llm, held["prose"])}
        print(f"quality {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    ref = outs["bf16"]
    for name in dirs:
        same = [sum(a == b for a, b in zip(o, r)) for o, r in zip(outs[name], ref)]
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs[name], ref)]
        out[name].update(agree=sum(same) / sum(len(r) for r in ref), prefix=statistics.mean(prefix),
                         identical=sum(p == len(r) for p, r in zip(prefix, ref)))
    out["_config"] = {"prompts": len(prompts), "tokens": n_tokens,
                      "ppl_texts": {k: [len(v), sum(map(len, v))] for k, v in held.items()}}
    return out


# ---------------------------------------------------------------------------------------------- speed

@dataclass
class Arm:
    target: str
    drafter: str
    llm: LLM
    times: list[float] = field(default_factory=list)  # per repeat: seconds summed over the prompts
    decode_times: list[float] = field(default_factory=list)  # the same after each prefill (SpecStats.decode_s)
    prefill: float = 0.0
    draft: float = 0.0
    decode: float = 0.0
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    equal: int = 0
    compared: int = 0


def speed(prompts: list[list[int]], max_tokens: int, repeats: int, arms: list[Arm]) -> dict:
    """Time every arm on every prompt, interleaved, `repeats` times; rows of speeds, τ and equality."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for a in arms:  # warm-up: one generation per arm, not timed
        a.llm.generate(prompts[0], params)
    for rep in range(repeats):
        tot = {id(a): 0.0 for a in arms}
        dec = {id(a): 0.0 for a in arms}
        for p in prompts:
            plain_out = {}
            for a in arms:  # interleaved: every arm on this prompt before the next prompt
                r = a.llm.generate(p, params)[0]
                s = r.stats
                tot[id(a)] += s.elapsed_s
                dec[id(a)] += s.decode_s
                if a.drafter == "plain":
                    plain_out[a.target] = r.token_ids
                else:
                    a.compared += 1
                    a.equal += r.token_ids == plain_out[a.target]
                if rep == 0:
                    a.tokens += len(r.token_ids)
                    a.drafts += s.num_drafts
                    a.accepted += s.num_accepted_tokens
                    a.per_pos += [0] * (len(s.accepted_per_pos) - len(a.per_pos))
                    for j, c in enumerate(s.accepted_per_pos):
                        a.per_pos[j] += c
                a.prefill += s.prefill_s
                a.draft += s.draft_s
                a.decode += s.decode_s
        for a in arms:
            a.times.append(tot[id(a)])
            a.decode_times.append(dec[id(a)])
        print(f"  repeat {rep + 1}/{repeats} done", flush=True)
    base = next(a for a in arms if a.target == "bf16" and a.drafter == "plain")
    rows = []
    for a in arms:
        rows.append({
            "target": a.target, "drafter": a.drafter, "tokens": a.tokens,
            "tokens_per_s": a.tokens / statistics.median(a.times),
            "decode_tokens_per_s": a.tokens / statistics.median(a.decode_times),
            "speedup": statistics.median(b / t for b, t in zip(base.times, a.times)),
            "decode_speedup": statistics.median(b / t for b, t in zip(base.decode_times, a.decode_times)),
            "prefill_share": a.prefill / (a.prefill + a.decode),
            "draft_share_of_decode": a.draft / a.decode if a.decode else 0.0,
            "tau": 1 + a.accepted / a.drafts if a.drafts else None,
            "accept_per_pos": [c / a.drafts for c in a.per_pos] if a.drafts else [],
            "equal": a.equal, "compared": a.compared,
        })
    return {"prompts": len(prompts), "prompt_tokens": statistics.mean(map(len, prompts)), "rows": rows}


def build_arms(dirs: dict[str, Path], k: int) -> list[Arm]:
    arms = []
    for t in SPEED_TARGETS:
        for dname, spec in DRAFTERS.items():
            arms.append(Arm(t, dname, LLM(dirs[t], drafter=spec, k=k, dtype="bf16")))
    return arms


# ---------------------------------------------------------------------------------------------- report

def machine() -> list[str]:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    keep = [line.strip() for line in info if line.startswith(("Model name", "Flags", "CPU(s):"))]
    return keep + [f"torch {torch.__version__}, Python {platform.python_version()}"]


def round_ms(bucket: dict, r: dict) -> tuple[float, float]:
    """(target, drafter) milliseconds per decode round, derived: rounds = (tokens - prompts) / τ (every round
    drafts; plain: one token a round), the median decode time split by the drafter's share of it."""
    rounds = (r["tokens"] - bucket["prompts"]) / (r["tau"] or 1.0)
    decode_ms = 1e3 * r["tokens"] / r["decode_tokens_per_s"]
    return decode_ms * (1 - r["draft_share_of_decode"]) / rounds, decode_ms * r["draft_share_of_decode"] / rounds


def step_profile(bucket: dict, k: int) -> list[str]:
    """Why the levers do or do not compound: a verify round's target cost against a one-token step's."""
    rows = {(r["target"], r["drafter"]): r for r in bucket["rows"]}
    out = []
    for t in SPEED_TARGETS:
        one, _ = round_ms(bucket, rows[(t, "plain")])
        ver, dr = round_ms(bucket, rows[(t, "dspark")])
        r = rows[(t, "plain")]
        prefill = 1e3 * r["tokens"] / r["tokens_per_s"] * r["prefill_share"] / bucket["prompts"]
        out.append(f"{t}: prefill {prefill:.0f} ms a prompt, one-token step {one:.2f} ms, "
                   f"dspark round {ver:.2f} ms target ({k + 1} rows, "
                   f"{ver / one:.1f}x a step) + {dr:.2f} ms drafter")
    return out


def speed_table(bucket: dict) -> list[str]:
    lines = ["| target | drafter | tok/s e2e | speedup e2e | tok/s decode | speedup decode | τ | "
             "accept pos 1..8 | prefill share | draft share of decode | ms/round target + draft | = plain |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in bucket["rows"]:
        tm, dm = round_ms(bucket, r)
        pos = " ".join(f"{x:.2f}" for x in r["accept_per_pos"]) or "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        eq = f"{r['equal']}/{r['compared']}" if r["compared"] else "(reference)"
        lines.append(f"| {r['target']} | {r['drafter']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['decode_tokens_per_s']:.0f} | {r['decode_speedup']:.2f}x | {tau} | {pos} | "
                     f"{r['prefill_share']:.0%} | {r['draft_share_of_decode']:.0%} | {tm:.2f} + {dm:.2f} | {eq} |")
    return lines


def compounding(bucket: dict, key: str) -> tuple[str, float, float, float]:
    rows = {(r["target"], r["drafter"]): r for r in bucket["rows"]}
    best = max(("dspark", "lookup:dspark"), key=lambda d: rows[("bf16", d)][key])
    both = max(("dspark", "lookup:dspark"), key=lambda d: rows[("w4a16", d)][key])
    return both, rows[("w4a16", both)][key], rows[("w4a16", "plain")][key], rows[("bf16", best)][key]


def write_report(out: Path, args: argparse.Namespace, quant_times: dict, qual: dict, buckets: dict, cmd: str) -> None:
    L = ["# Quantized targets x speculation on the zoo (issue 20, first figures)", "",
         "Produced by one command (about 10 minutes on 2 cores; quantized copies are cached under .cache/quant/; "
         "the numbers are also in results.json):", "",
         "```bash", cmd, "```", "",
         "Machine (lscpu):", "", "```", *machine(), "```", "",
         "Numbers from a shared 2-vCPU VM: other work on the host moves absolute tokens/s by a few percent; the "
         "arms are interleaved prompt by prompt, so ratios are the figures to read.", ""]
    L += ["## Quality (fp32 activations)", "",
          f"Greedy agreement with the unquantized zoo/target (same fp32 activations), over the first "
          f"{qual['_config']['prompts']} code_completion bench prompts, {qual['_config']['tokens']} greedy tokens "
          "each: the fraction of positions equal to the reference's, the mean length of the identical prefix, and "
          "how many of the continuations are identical. Perplexity: every next-token prediction over the bench's "
          "held-out records (prompt + reference text; "
          + ", ".join(f"{t}: {n} texts, {tok} tokens" for t, (n, tok) in qual["_config"]["ppl_texts"].items())
          + ").", "",
          "| target | quantized in (s, this machine) | greedy agreement | identical prefix (tokens) | "
          "identical continuations | "
          "ppl code | ppl prose |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in (n for n in qual if not n.startswith("_")):
        q = qual[name]
        qt = f"{quant_times[name]:.0f} s" if name in quant_times else "-"
        L.append(f"| {name} | {qt} | {q['agree']:.1%} | {q['prefix']:.1f} | "
                 f"{q['identical']}/{qual['_config']['prompts']} "
                 f"| {q['ppl_code']:.3f} | {q['ppl_prose']:.3f} |")
    L += ["", "w8a16: int8 per output channel; w4a16: int4, groups of 32, round to nearest; w4a16-gptq: the same "
          "grid by GPTQ (32 x 512 calibration tokens from the training split). All: decoder-layer projections "
          "only; embeddings, norms and the tied LM head stay bf16. Quantization times are wall seconds when the "
          "cached copy was made (2 threads; other jobs may have shared the CPU then).", ""]
    for bname, b in buckets.items():
        L += [f"## Speed and acceptance: {bname} bucket (bf16 activations, {args.threads} threads)", "",
              f"{b['prompts']} code_completion prompts (mean {b['prompt_tokens']:.0f} prompt tokens) + "
              f"{args.max_tokens} new tokens (ignore_eos), k = {args.k}, medians over {args.repeats} repeats of "
              "the sum over prompts; speedups against bf16 plain in the same repeat. e2e: prefill included; "
              "decode: after the target's prefill (SpecStats.decode_s; tok/s counts every output token). "
              "τ and per-position acceptance from the first repeat. `= plain`: generations (all repeats) whose "
              "tokens equal the same target's plain greedy output. ms/round: derived, the median decode time "
              "split by the drafter's share, over (tokens - prompts) / τ rounds.", "", *speed_table(b), "",
              "- Step profile (derived as above): " + "; ".join(step_profile(b, args.k)) + "."]
        for key, label in (("speedup", "end to end"), ("decode_speedup", "per output token (decode)")):
            d, both, q, s = compounding(b, key)
            verdict = ("compound (>= product)" if both >= q * s
                       else f"fall short of the product ({both / (q * s):.0%} of it)")
            L.append(f"- Compounding, {label}: w4a16 + {d} {both:.2f}x vs w4a16 plain {q:.2f}x x bf16 + best "
                     f"drafter {s:.2f}x = {q * s:.2f}x: the levers {verdict}.")
        rows = {(r["target"], r["drafter"]): r for r in b["rows"]}
        for d in ("dspark", "lookup:dspark"):
            L.append(f"- τ of {d} (bf16-trained drafter): bf16 {rows[('bf16', d)]['tau']:.2f}, "
                     f"int8 {rows[('w8a16', d)]['tau']:.2f}, int4 {rows[('w4a16', d)]['tau']:.2f}.")
        L.append("")
    L += goals(buckets, args)
    L += ["## Also here", "",
          "- `qgemm_cost.txt`: the per-matmul cost of verispec's int8/int4 kernel (kernels/qgemm.c) against "
          "PyTorch's own int kernels at 1-16 rows on the zoo target's shapes (scripts/qgemm_cost.py); the kernel "
          "choice behind the speed tables above.", "",
          "## Not measured yet (issue 20 still asks for them)", "",
          "- The stage-2 drafter (DSpark fine-tuned on the quantized target's continuations) and the int4 drafter "
          "in these speed tables: every τ here is the bf16-trained zoo/dspark's (their τ alone, from a short stage "
          "2: reports/quant/README.md's notes).",
          "- QAD (quantization-aware distillation, `verispec train qad`) in these tables: its first, short run's "
          "quality is in reports/quant/qad.md.",
          "- `ngram` and `model` drafters; the medium (~1,000 + 256) and long (~1,800 + 192) buckets (the bench "
          "bucket here is ~550 + 128); a measured step profile (the per-round figures above are derived from τ "
          "and the drafter's share of the decode time); PNG plots.",
          "- Speed of the GPTQ copy (same kernel and grid as RTN w4a16, so the same cost per step; only its "
          "τ could differ)."]
    if args.llamacpp_note:
        L += ["", "## llama.cpp side by side", "", Path(args.llamacpp_note).read_text().strip()]
    (out / "README.md").write_text("\n".join(L) + "\n")


def goals(buckets: dict, args: argparse.Namespace) -> list[str]:
    L = ["## The issue's goals", ""]
    short = buckets.get("short")
    for bname, b in buckets.items():
        rows = {(r["target"], r["drafter"]): r for r in b["rows"]}
        best = max(b["rows"], key=lambda r: r["speedup"])
        allspec = all(r["equal"] == r["compared"] for r in b["rows"] if r["compared"])
        if b is short:
            L.append(f"- Best combination >= 4x bf16 plain end to end on the short bucket, every output equal to "
                     f"the quantized target's plain decoding: {best['target']} + {best['drafter']} "
                     f"{best['speedup']:.2f}x, outputs equal: {'all' if allspec else 'NOT all'} -> "
                     f"**{'met' if best['speedup'] >= 4 and allspec else 'not met'}**.")
        q = rows[("w4a16", "plain")]
        L.append(f"- int4 plain >= 1.8x bf16 plain ({bname} bucket): {q['speedup']:.2f}x end to end, "
                 f"{q['decode_speedup']:.2f}x per output token -> **{'met' if q['speedup'] >= 1.8 else 'not met'}**.")
    L.append("- verispec's best int4 configuration >= 1.2x llama.cpp's best q4_0 mode: "
             + ("see the llama.cpp section below." if args.llamacpp_note else "not measured in this run."))
    return L + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-task", type=int, default=8, help="code_completion prompts in the speed runs")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per speed-run generation")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short-len", type=int, default=64, help="short bucket: the prompts' last N tokens (0: skip)")
    ap.add_argument("--quality-prompts", type=int, default=24)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--ppl-texts", type=int, default=24, help="held-out code and prose texts for perplexity")
    ap.add_argument("--no-gptq", action="store_true", help="skip the GPTQ copy")
    ap.add_argument("--w4-group", type=int, default=32, help="group size of the w4a16 copies")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                    help="another quantized copy for the quality table (e.g. w4a16-qad=data/quant/qad-w4a16-g128, "
                         "from `verispec train qad`), repeatable")
    ap.add_argument("--quality-only", action="store_true",
                    help="measure quality only: print its table and write OUT/quality.json (no speed, no README)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache/quant")
    ap.add_argument("--llamacpp-note", type=Path, default=None,
                    help="a markdown file appended as the llama.cpp section")
    ap.add_argument("--rerender", action="store_true",
                    help="rewrite README.md from OUT/results.json (e.g. to add --llamacpp-note) without measuring")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/quant")
    args = ap.parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    cmd = "python scripts/quant_report.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("prompts_per_task", args.prompts_per_task),
                                                   ("max_tokens", args.max_tokens), ("repeats", args.repeats)))
    shown = args.out.relative_to(ROOT) if args.out.is_absolute() and args.out.is_relative_to(ROOT) else args.out
    cmd += f" --out {shown}"
    if args.llamacpp_note:
        cmd += f" --llamacpp-note {args.llamacpp_note}"
    if args.rerender:
        res = json.loads((args.out / "results.json").read_text())
        args.__dict__.update(res["args"])
        cmd = res["command"].split("\n")[0]
        if args.llamacpp_note:
            cmd += (f"\npython scripts/quant_report.py --rerender --out {res['out']} "
                    f"--llamacpp-note {args.llamacpp_note}")
        write_report(args.out, args, res["quantize_seconds"], res["quality"], res["speed"], cmd)
        print(f"wrote {args.out / 'README.md'}")
        return
    dirs, quant_times = target_dirs(args.cache, not args.no_gptq, args.w4_group)
    tok = Tokenizer.from_dir(TARGET)
    extra = dict(e.split("=", 1) for e in args.extra)
    qual = quality({**dirs, **{k: Path(v) for k, v in extra.items()}}, tok, args.quality_prompts, args.agree_tokens,
                   args.ppl_texts)
    if args.quality_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quality.json").write_text(json.dumps({"w4_group": args.w4_group, "extra": extra,
                                                           "quality": qual}, indent=1) + "\n")
        for name in (n for n in qual if not n.startswith("_")):
            q = qual[name]
            print(f"{name}: agreement {q['agree']:.1%}, identical prefix {q['prefix']:.1f}, identical "
                  f"{q['identical']}/{qual['_config']['prompts']}, ppl code {q['ppl_code']:.3f}, "
                  f"ppl prose {q['ppl_prose']:.3f}")
        print(f"wrote {args.out / 'quality.json'}")
        return
    room = 2048 - args.max_tokens - 1
    prompts = [tok.encode(r["prompt"])[-room:] for r in records("code_completion")[: args.prompts_per_task]]
    buckets = {}
    arms = build_arms(dirs, args.k)
    print("speed: bench prompts", flush=True)
    buckets["bench (~590-token prompt)"] = speed(prompts, args.max_tokens, args.repeats, arms)
    if args.short_len:
        print("speed: short bucket", flush=True)
        buckets["short"] = speed([p[-args.short_len:] for p in prompts], args.max_tokens, args.repeats,
                                 build_arms(dirs, args.k))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"command": cmd, "out": str(args.out),
         "args": {k: args.__dict__[k] for k in ("max_tokens", "repeats", "k", "threads")},
         "quantize_seconds": quant_times, "quality": qual, "speed": buckets}, indent=1) + "\n")
    write_report(args.out, args, quant_times, qual, buckets, cmd)
    print(f"wrote {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
