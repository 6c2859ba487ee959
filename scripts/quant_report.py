"""Issue 20's report: quantized targets x drafters (bf16 and int4) on the zoo, llama.cpp side by side in the same
run, written to reports/quant/README.md with PNG plots beside it.

    python scripts/quant_report.py --prompts-per-task 8 --repeats 3 --out reports/quant

1. Makes (or reuses, under .cache/quant/) w8a16, w4a16 g32 RTN, w4a16 g32 GPTQ and w4a16 g32 RTN with the LM head
   quantized too (w4a16-head, `verispec quantize --lm-head`; w4a8-head: the same with int8 activations) copies of
   zoo/target, and int4
   copies of zoo/drafter and zoo/dspark (w4a16 RTN; `verispec quantize`'s default group of 128 where it divides every
   quantized layer's input, else the largest group that does).
2. Quality, fp32 activations: greedy agreement of each copy with the unquantized target over the bench's
   code_completion prompts, and held-out perplexity on the bench's code and prose records (prompt + reference).
3. Speed, bf16 activations: {bf16, w8a16, w4a16 RTN, w4a16-head target} x {plain, ngram, model, dspark, lookup:dspark and the
   int4 drafters model-int4, dspark-int4, lookup:dspark-int4} (k = 8), then llama.cpp's arms (GGUFs of zoo/target,
   the same prompt token ids) on each prompt, medians over repeats, in buckets: short (the code prompts' last 64
   tokens + 128 new), medium (~1,000 + 256) and long (~1,840 + 192; `--buckets ...,bench` adds the bench's ~590 +
   128). Every speculative output is checked against the same target's plain greedy output (llama.cpp's against
   plain decoding of the same GGUF).
4. A measured step profile per target and bucket: one target forward of 1 and k + 1 tokens at the bucket's context.

`--rerender` rewrites README.md and the plots from OUT/results.json without measuring (a results.json from before
the buckets and llama.cpp arms renders what it holds).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from verispec import LLM, SamplingParams
from verispec.api import set_threads
from verispec.bench import llamacpp
from verispec.bench.prompts import PROMPT_DIR, load_task
from verispec.cache import KVCache
from verispec.decode import GenerationResult
from verispec.errors import ConfigError
from verispec.metrics import SpecStats
from verispec.model.tokenizer import Tokenizer
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "zoo/target"
CONTEXT = 2048  # the zoo target's context: prompts are cut from the left to CONTEXT - new tokens - 1
# name -> QuantizeConfig (None: the dense checkpoint itself)
COPIES = {
    "bf16": None,
    "w8a16": QuantizeConfig(scheme="w8a16"),
    "w4a16": QuantizeConfig(scheme="w4a16", group_size=32),
    "w4a16-gptq": QuantizeConfig(scheme="w4a16", group_size=32, method="gptq", calib_samples=32, calib_len=512),
    "w4a16-head": QuantizeConfig(scheme="w4a16", group_size=32, lm_head="w4a16"),
    "w4a16-head8": QuantizeConfig(scheme="w4a16", group_size=32, lm_head="w8a16"),
    # w4a16-head's weights, every input rounded to int8 per group at run time: the integer matmul (vpdpbusd)
    "w4a8-head": QuantizeConfig(scheme="w4a8", group_size=32, lm_head="w4a8"),
    "w4a8-head8": QuantizeConfig(scheme="w4a8", group_size=32, lm_head="w8a16"),  # an int8, weight-only head
    "w4a16-gptq-head8": QuantizeConfig(scheme="w4a16", group_size=32, method="gptq", calib_samples=32, calib_len=512,
                                       lm_head="w8a16"),
    # GPTQ's grid (w4a16-gptq's calibration), int8 activations and the int8 head: the quality-first W4A8 copy
    "w4a8-gptq-head8": QuantizeConfig(scheme="w4a8", group_size=32, method="gptq", calib_samples=32, calib_len=512,
                                      lm_head="w8a16"),
}
SPEED_TARGETS = ("bf16", "w8a16", "w4a16", "w4a16-head")  # the default speed targets; --targets takes any copy
# the int4 configurations of goals (2) and (3)
INT4_TARGETS = ("w4a16", "w4a16-gptq", "w4a16-head", "w4a16-head8", "w4a16-gptq-head8", "w4a8-head", "w4a8-head8",
                "w4a8-gptq-head8")
DRAFT_SOURCES = {"model": ROOT / "zoo/drafter", "dspark": ROOT / "zoo/dspark"}
INT4 = "-int4"  # a drafter arm on the int4 copy of its checkpoint
# A drafter arm under the dspark policy (each round's draft cut where one more verified row stops paying, by the
# target's step profile and the drafter's acceptance) instead of verifying all k: where a k+1-row step costs several
# one-row steps (int4 on AVX-512 BF16), verifying all k can cost more than its accepted tokens save.
DSPARK = "@dspark"
# arm -> drafter spec; {model} and {dspark}: DRAFT_SOURCES, or their int4 copies for the -int4 arms
DRAFTERS = {"plain": None, "ngram": "ngram", "model": "model:{model}", "dspark": "dspark:{dspark}",
            "lookup:dspark": "lookup:dspark:{dspark}", "model-int4": "model:{model}",
            "dspark-int4": "dspark:{dspark}", "lookup:dspark-int4": "lookup:dspark:{dspark}"}
BUCKETS = {"short": 128, "medium": 256, "long": 192, "bench": 128}  # bucket -> its default new tokens
DEFAULT_BUCKETS = ("short", "medium", "long")
LONG_SIZES = {"medium": 1000, "long": 1900}  # long_context's length_bucket of each
LLAMACPP_ARMS = "plain-q4_0,lookup-q4_0,speculative-q4_0,plain-q8_0"
# A rough guess of this machine's pace, for the estimate printed before a run: tokens/s of a prefill and of a
# generation's decoding averaged over the arms (plain and drafted), and fp32 greedy tokens/s in the quality step.
PACE = {"prefill": 5000.0, "decode": 400.0, "fp32": 60.0}


def target_dirs(cache: Path, with_gptq: bool, w4_group: int = 32) -> tuple[dict[str, Path], dict[str, float]]:
    """Each copy's checkpoint directory, quantizing the ones not cached yet, and the seconds each took (kept
    beside the cached copy in quantize_seconds.txt). The int4 copies use groups of `w4_group`."""
    dirs, seconds = {}, {}
    for name, cfg in COPIES.items():
        if cfg is not None and cfg.scheme in ("w4a16", "w4a8"):
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


def copy_dir(name: str, cache: Path = ROOT / ".cache/quant") -> Path:
    """One copy's checkpoint directory (COPIES; bf16: zoo/target), quantized into `cache` first if missing (the
    helper scripts' way to the report's targets)."""
    cfg = COPIES[name]
    if cfg is None:
        return TARGET
    out = cache / f"{name}-g{cfg.group_size or 0}"
    if not (out / "quantization.json").is_file():
        quantize_checkpoint(TARGET, out, cfg, progress=False)
    return out


def int4_copy(src: Path, cache: Path) -> dict:
    """An int4 (w4a16 RTN) copy of the drafter at `src`, made once and cached as `cache/NAME-w4a16-gG`: G is
    `verispec quantize`'s default (128) where it divides every quantized layer's input, else the largest that does.
    Returns {"dir", "group_size", "seconds"} (seconds: when the copy was made; None if unknown)."""
    for group in (QuantizeConfig.group_size, 64, 32):  # the CLI's default first (None: the scheme's 128)
        cfg = QuantizeConfig(scheme="w4a16", group_size=group)
        size = cfg.quant_scheme.group_size
        out = cache / f"{src.name}-w4a16-g{size}"
        if not (out / "quantization.json").is_file():
            t0 = time.perf_counter()
            try:
                quantize_checkpoint(src, out, cfg, progress=False)
            except ConfigError:  # this group does not divide a layer's input features (checked before writing)
                continue
            (out / "quantize_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
            print(f"quantized {src.name} -> {out}", flush=True)
        made = out / "quantize_seconds.txt"
        return {"dir": out, "group_size": size, "seconds": float(made.read_text()) if made.is_file() else None}
    raise ConfigError(f"no int4 group size divides the layers of {src}")


def records(task: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPT_DIR / f"{task}.jsonl").read_text().splitlines() if line.strip()]


def bucket_prompts(bucket: str, tok: Tokenizer, n: int, max_tokens: int, short_len: int) -> tuple[list[list[int]], str]:
    """A bucket's first `n` prompts (token ids, cut from the left to fit `max_tokens` more in the context) and the
    README's words for them."""
    room = CONTEXT - max_tokens - 1
    if bucket in LONG_SIZES:
        size = LONG_SIZES[bucket]
        recs = [r for r in load_task("long_context") if r.get("length_bucket") == size][:n]
        return [tok.encode(r["prompt"])[-room:] for r in recs], (
            f"the long_context prompts of ~{size:,} tokens (windows of bench-split source files; at most {room})")
    code = [tok.encode(r["prompt"])[-room:] for r in load_task("code_completion")[:n]]
    if bucket == "short":
        return [p[-short_len:] for p in code], f"the last {short_len} tokens of the code_completion prompts"
    return code, f"the code_completion prompts (the bench's cut: at most {room} tokens)"


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
    """One verispec (target, drafter) arm's sums: per repeat (seconds over the prompts), over every repeat
    (prefill, drafter, rounds) and from the first repeat (tokens and acceptance)."""

    target: str
    drafter: str
    llm: LLM
    times: list[float] = field(default_factory=list)  # per repeat: SpecStats.elapsed_s summed over the prompts
    decode_times: list[float] = field(default_factory=list)  # the same after each prefill (SpecStats.decode_s)
    now: SpecStats = field(default_factory=SpecStats)  # the current repeat's sums
    every: SpecStats = field(default_factory=SpecStats)  # every repeat's (times, rounds)
    first: SpecStats = field(default_factory=SpecStats)  # the first repeat's (acceptance)
    runs: int = 0
    tokens: int = 0  # output tokens of the first repeat
    equal: int = 0
    compared: int = 0

    def add(self, r: GenerationResult, first_repeat: bool, plain: list[int] | None) -> None:
        """One generation's stats; `plain`: the same target's plain output on this prompt (None: a plain arm)."""
        self.now.add(r.stats)
        self.every.add(r.stats)
        self.runs += 1
        if plain is not None:
            self.compared += 1
            self.equal += r.token_ids == plain
        if first_repeat:
            self.tokens += len(r.token_ids)
            self.first.add(r.stats)

    def end_repeat(self) -> None:
        self.times.append(self.now.elapsed_s)
        self.decode_times.append(self.now.decode_s)
        self.now = SpecStats()

    def row(self, base: Arm) -> dict:
        """Speeds, and speedups against `base` (bf16 plain) in the same repeat, τ and equality."""
        e, f = self.every, self.first
        return {
            "target": self.target, "drafter": self.drafter, "tokens": self.tokens,
            "tokens_per_s": self.tokens / statistics.median(self.times),
            "decode_tokens_per_s": self.tokens / statistics.median(self.decode_times),
            "speedup": statistics.median(b / t for b, t in zip(base.times, self.times)),
            "decode_speedup": statistics.median(b / t for b, t in zip(base.decode_times, self.decode_times)),
            "prefill_share": e.prefill_s / e.elapsed_s,
            "draft_share_of_decode": e.draft_s / e.decode_s if e.decode_s else 0.0,
            "draft_ms_per_round": 1e3 * e.draft_s / e.num_rounds if e.num_rounds else 0.0,
            "prefill_ms": 1e3 * e.prefill_s / self.runs,
            "tau": f.tau if f.num_drafts else None,
            "accept_per_pos": [c / f.num_drafts for c in f.accepted_per_pos] if f.num_drafts else [],
            "equal": self.equal, "compared": self.compared,
        }


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def drafter_specs(names: list[str], int4: dict[str, dict]) -> dict[str, str | None]:
    """Each drafter arm's spec, the -int4 arms on the int4 copies."""
    dense = {k: str(v) for k, v in DRAFT_SOURCES.items()}
    quant = {k: str(v["dir"]) for k, v in int4.items()}
    templates = {n: DRAFTERS[base(n)] for n in names}
    return {n: t and t.format(**(quant if base(n).endswith(INT4) else dense)) for n, t in templates.items()}


def base(drafter: str) -> str:
    """The drafter arm's name without its policy."""
    return drafter.removesuffix(DSPARK)


def build_arms(dirs: dict[str, Path], targets: list[str], specs: dict[str, str | None], k: int) -> list[Arm]:
    """One loaded model per target, shared by its arms (the drafters are each arm's own); plain first, so that
    every drafted arm is compared with it, and bf16 plain always (the reference)."""
    arms = []
    for t in dict.fromkeys(["bf16", *targets]):
        plain = LLM(dirs[t], dtype="bf16")
        for d, spec in specs.items():
            if t in targets or spec is None:
                arms.append(Arm(t, d, plain if spec is None else LLM(
                    plain.target, drafter=spec, k=k, policy="dspark" if d.endswith(DSPARK) else "fixed")))
    return arms


def llamacpp_arms(names: tuple[str, ...], threads: int) -> tuple[llamacpp.BenchArms | None, list[str]]:
    """llama.cpp's arms that can run here (their GGUFs converted before any timing), and a note for each skipped
    one. `speculative` drafts with zoo/drafter's GGUF (bf16), as `verispec bench --llamacpp` does."""
    if not names:
        return None, []
    try:
        llamacpp.import_llama_cpp()
    except llamacpp.LlamaCppMissing as e:
        return None, [f"llama.cpp skipped: {e}"]
    ok, notes = [], []
    for name in names:
        kind, _ = llamacpp.parse_arm(name)
        try:
            if kind in llamacpp.BINARIES:
                llamacpp.binary(kind)
            ok.append(name)
        except llamacpp.LlamaCppMissing as e:
            notes.append(f"llama.cpp {name} skipped: {e}")
    if not ok:
        return None, notes
    return llamacpp.BenchArms(TARGET, tuple(ok), CONTEXT, threads, DRAFT_SOURCES["model"]), notes


def speed(bucket: str, prompts: list[list[int]], max_tokens: int, repeats: int, arms: list[Arm],
          lcpp: llamacpp.BenchArms | None) -> dict:
    """Time every arm on every prompt, interleaved (verispec's arms, then llama.cpp's), `repeats` times."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for a in arms:  # warm-up: one generation per arm, not timed
        a.llm.generate(prompts[0], params)
    for arm in (lcpp.arms.values() if lcpp else ()):
        arm.generate(prompts[0], max_tokens)
    one = time.perf_counter() - t0  # about one prompt's worth of every arm
    print(f"  warm-up {one:.0f} s: about {one * len(prompts) * repeats / 60:.1f} min for {len(prompts)} prompts x "
          f"{repeats} repeats", flush=True)
    t0 = time.perf_counter()
    for rep in range(repeats):
        for p in prompts:
            plain_out = {}
            for a in arms:  # interleaved: every arm on this prompt before the next prompt
                r = a.llm.generate(p, params)[0]
                if a.drafter == "plain":
                    plain_out[a.target] = r.token_ids
                a.add(r, rep == 0, None if a.drafter == "plain" else plain_out[a.target])
            if lcpp is not None:
                lcpp.run_prompt(bucket, p, max_tokens, first_repeat=rep == 0)
        for a in arms:
            a.end_repeat()
        if lcpp is not None:
            lcpp.end_repeat(bucket)
        spent = time.perf_counter() - t0
        print(f"  repeat {rep + 1}/{repeats} done ({spent / 60:.1f} min; about "
              f"{spent / (rep + 1) * (repeats - rep - 1) / 60:.1f} min left in this bucket)", flush=True)
    base = next(a for a in arms if a.target == "bf16" and a.drafter == "plain")
    return {"prompts": len(prompts), "prompt_tokens": statistics.mean(map(len, prompts)), "max_tokens": max_tokens,
            "rows": [a.row(base) for a in arms], "llamacpp": llamacpp_rows(lcpp, bucket, base) if lcpp else []}


def llamacpp_rows(lcpp: llamacpp.BenchArms, bucket: str, base: Arm) -> list[dict]:
    """llama.cpp's records for this bucket with speedups against verispec's bf16 plain in the same repeat (by
    tokens/s: a binary may stop a few tokens past N, at the end of a round)."""
    out = []
    for rec in (r for r in lcpp.records() if r["task"] == bucket):
        c = lcpp.cells[(bucket, rec["arm"])]
        for key, mine, ref in (("speedup", c.total_times, base.times),
                               ("decode_speedup", c.decode_times, base.decode_times)):
            rec[key] = statistics.median((c.tokens / t) / (base.tokens / b) for t, b in zip(mine, ref))
        out.append(rec)
    return out


@torch.inference_mode()
def step_ms(llm: LLM, context: int, rows: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median milliseconds of one target forward of each count in `rows` after `context` cached positions, as a
    decode round runs it (logits for every row). Random tokens: the CPU forward's cost does not depend on them."""
    target = llm.target
    gen = torch.Generator().manual_seed(0)  # leave the global RNG alone
    ids = torch.randint(0, target.config.vocab_size, (1, context + max(rows)), generator=gen)
    cache = KVCache.for_model(target, max_len=context + max(rows) + 1)
    target(ids[:, :context], cache=cache, num_logits=0)
    times: dict[int, list[float]] = {r: [] for r in rows}
    for rep in range(repeats + 1):  # the first round warms up
        for r in rows:
            cache.truncate(context)
            t0 = time.perf_counter()
            target(ids[:, context:context + r], cache=cache)
            if rep:
                times[r].append(time.perf_counter() - t0)
    return {r: 1e3 * statistics.median(t) for r, t in times.items()}


def step_profile(arms: list[Arm], bucket: dict, k: int, repeats: int) -> dict[str, dict]:
    """Per target: one forward of 1 and k + 1 tokens at the bucket's mid-generation context (prompt + half the new
    tokens), and the measured prefill per prompt."""
    context = round(bucket["prompt_tokens"] + bucket["max_tokens"] / 2)
    rows = {(r["target"], r["drafter"]): r for r in bucket["rows"]}
    out = {}
    for a in (a for a in arms if a.drafter == "plain"):
        ms = step_ms(a.llm, context, (1, k + 1), repeats)
        out[a.target] = {"context": context, "one_ms": ms[1], "verify_ms": ms[k + 1], "rows": k + 1,
                         "prefill_ms": rows[(a.target, "plain")]["prefill_ms"]}
    return out


# ---------------------------------------------------------------------------------------------- report

def machine() -> list[str]:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    keep = [line.strip() for line in info if line.startswith(("Model name", "Flags", "CPU(s):"))]
    return keep + [f"torch {torch.__version__}, Python {platform.python_version()}"]


def weights(drafter: str) -> str:
    """The drafter arm's own weights: int4, bf16, or - (plain, ngram: none)."""
    if base(drafter).endswith(INT4):
        return "int4"
    return "-" if DRAFTERS.get(base(drafter), "") in (None, "ngram") else "bf16"


def slug(bucket: str) -> str:
    return bucket.split()[0]


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def speed_table(bucket: dict) -> list[str]:
    lines = ["| target | drafter | drafter weights | tok/s e2e | x e2e | tok/s after prefill | x per token | τ | "
             "accept pos 1..k | prefill share | drafter ms/round | = plain |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in bucket["rows"]:
        pos = " ".join(f"{x:.2f}" for x in r["accept_per_pos"]) or "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        eq = f"{r['equal']}/{r['compared']}" if r["compared"] else "(reference)"
        dms = f"{r['draft_ms_per_round']:.2f}" if r.get("draft_ms_per_round") else "-"
        lines.append(f"| {r['target']} | {r['drafter']} | {weights(r['drafter'])} | {r['tokens_per_s']:.0f} | "
                     f"{_x(r['speedup'])} | {r['decode_tokens_per_s']:.0f} | {_x(r['decode_speedup'])} | {tau} | "
                     f"{pos} | {r['prefill_share']:.0%} | {dms} | {eq} |")
    return lines


def llamacpp_table(bucket: dict) -> list[str]:
    lines = ["| llama.cpp arm | tok/s e2e | x e2e | tok/s after prefill | x per token | acceptance | "
             "= llama.cpp plain (same GGUF) |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in bucket["llamacpp"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        eq = "(plain)" if r["equal_to_plain"] is None else f"{r['equal_to_plain']}/{r['num_prompts']}"
        if r["kind"] != "plain" and r["prompt_ids_equal"] < r["num_prompts"]:
            eq += f" ({r['num_prompts'] - r['prompt_ids_equal']} prompt(s) tokenized differently)"
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:.0f} | {_x(r['speedup'])} | "
                     f"{r['decode_tokens_per_s']:.0f} | {_x(r['decode_speedup'])} | {acc} | {eq} |")
    return lines


def profile_line(bucket: dict) -> str:
    prof = bucket.get("profile") or {}
    if not prof:
        return "- Step profile: not measured in this run."
    parts = [f"{t}: 1 token {p['one_ms']:.2f} ms, {p['rows']} tokens {p['verify_ms']:.2f} ms "
             f"({p['verify_ms'] / p['one_ms']:.1f}x one), prefill {p['prefill_ms']:.0f} ms a prompt"
             for t, p in prof.items()]
    ctx = next(iter(prof.values()))["context"]
    return (f"- Step profile (measured: one target forward after {ctx} cached positions, the bucket's prompt + half "
            "its new tokens, median of repeats; prefill: the plain arm's mean): " + "; ".join(parts) + ".")


def compounding_table(bucket: dict) -> list[str]:
    """speedup(t, d) against speedup(t, plain) x speedup(bf16, d), e2e and per output token; and the drafter's gain
    over t's plain per token, measured and as the step profile predicts it: τ x t(1) / (t(k+1) + drafter)."""
    rows = {(r["target"], r["drafter"]): r for r in bucket["rows"]}
    prof = bucket.get("profile") or {}
    lines = ["| target | drafter | e2e | product e2e | e2e verdict | per token | product per token | "
             "per-token verdict | gain over the target's plain per token: measured / profile |",
             "|---|---|---:|---:|---|---:|---:|---|---:|"]
    for (t, d), r in rows.items():
        if d == "plain" or (t, "plain") not in rows:
            continue
        cells = []
        for key in ("speedup", "decode_speedup"):
            if t == "bf16" or ("bf16", d) not in rows:
                cells += [_x(r[key]), "-", "-"]
                continue
            prod = rows[(t, "plain")][key] * rows[("bf16", d)][key]
            verdict = "compound" if r[key] >= prod else f"conflict ({math.floor(100 * r[key] / prod)}% of it)"
            cells += [_x(r[key]), _x(prod), verdict]
        gain = r["decode_speedup"] / rows[(t, "plain")]["decode_speedup"]
        p = prof.get(t)
        model = (f"{r['tau'] * p['one_ms'] / (p['verify_ms'] + r.get('draft_ms_per_round', 0.0)):.2f}x"
                 if p and r["tau"] else "-")
        lines.append(f"| {t} | {d} | " + " | ".join(cells) + f" | {gain:.2f}x / {model} |")
    return lines


def spec_ok(r: dict) -> bool:
    """Every output equal to the same target's plain decoding (plain arms: trivially)."""
    return r["equal"] == r["compared"]


def goals(buckets: dict, note: bool) -> list[str]:
    """The issue's three goals as measured: (1) on the short bucket, (2) and (3) per bucket."""
    L = ["## The issue's goals", ""]
    short = next((b for name, b in buckets.items() if slug(name) == "short"), None)
    if short:
        best = max((r for r in short["rows"] if spec_ok(r)), key=lambda r: r["speedup"])
        fastest = max(short["rows"], key=lambda r: r["speedup"])
        eq = f", {best['equal']}/{best['compared']} outputs equal" if best["compared"] else ""
        extra = "" if fastest is best else (f" (faster but with outputs NOT all equal: {fastest['target']} + "
                                            f"{fastest['drafter']} {fastest['speedup']:.2f}x)")
        L.append(f"- (1) Best combination >= 4x bf16 plain end to end on the short bucket, every output equal to "
                 f"its target's plain decoding: {best['target']} + {best['drafter']} {best['speedup']:.2f}x{eq}"
                 f"{extra} -> **{'met' if best['speedup'] >= 4 else 'not met'}**.")
    for bname, b in buckets.items():
        # goal (2) is about weight-only int4: w4a8 copies also round their activations
        for q in (r for r in b["rows"] if r["target"] in INT4_TARGETS and r["drafter"] == "plain"
                  and not COPIES[r["target"]].scheme.startswith("w4a8")):
            L.append(f"- (2) int4 plain >= 1.8x bf16 plain, {bname} bucket, {q['target']}: {q['speedup']:.2f}x end "
                     f"to end (**{'met' if q['speedup'] >= 1.8 else 'not met'}**), {q['decode_speedup']:.2f}x per "
                     f"output token ({'met' if q['decode_speedup'] >= 1.8 else 'not met'}).")
    for bname, b in buckets.items():
        ours = [r for r in b["rows"] if r["target"] in INT4_TARGETS and spec_ok(r)]
        theirs = [r for r in b.get("llamacpp", []) if r["quant"] == "q4_0"]
        if ours and theirs:
            o, t = max(ours, key=lambda r: r["speedup"]), max(theirs, key=lambda r: r["speedup"])
            ratio = o["speedup"] / t["speedup"]
            L.append(f"- (3) verispec's best int4 configuration >= 1.2x llama.cpp's best q4_0 mode end to end, "
                     f"{bname} bucket: {o['target']} + {o['drafter']} {o['speedup']:.2f}x bf16 plain, llama.cpp "
                     f"{t['arm']} {t['speedup']:.2f}x: {ratio:.2f}x -> **{'met' if ratio >= 1.2 else 'not met'}**.")
    if not any(b.get("llamacpp") for b in buckets.values()):
        L.append("- (3) verispec's best int4 configuration >= 1.2x llama.cpp's best q4_0 mode: "
                 + ("see the llama.cpp section below." if note else "not measured in this run."))
    return L + [""]


def quality_section(res: dict) -> list[str]:
    qual, quant_times = res["quality"], res["quantize_seconds"]
    L = ["## Quality (fp32 activations)", "",
         f"Greedy agreement with the unquantized zoo/target (same fp32 activations), over the first "
         f"{qual['_config']['prompts']} code_completion bench prompts, {qual['_config']['tokens']} greedy tokens "
         "each: the fraction of positions equal to the reference's, the mean length of the identical prefix, and "
         "how many of the continuations are identical. Perplexity: every next-token prediction over the bench's "
         "held-out records (prompt + reference text; "
         + ", ".join(f"{t}: {n} texts, {tok} tokens" for t, (n, tok) in qual["_config"]["ppl_texts"].items())
         + ").", "",
         "| target | quantized in (s, this machine) | greedy agreement | identical prefix (tokens) | "
         "identical continuations | ppl code | ppl prose |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in (n for n in qual if not n.startswith("_")):
        q = qual[name]
        qt = f"{quant_times[name]:.0f} s" if name in quant_times else "-"
        L.append(f"| {name} | {qt} | {q['agree']:.1%} | {q['prefix']:.1f} | "
                 f"{q['identical']}/{qual['_config']['prompts']} | {q['ppl_code']:.3f} | {q['ppl_prose']:.3f} |")
    L += ["", "w8a16: int8 per output channel; w4a16: int4, groups of 32, round to nearest; w4a16-gptq: the same "
          "grid by GPTQ (32 x 512 calibration tokens from the training split). These: decoder-layer projections "
          "only; embeddings, norms and the tied LM head stay bf16. w4a16-head: w4a16 with the LM head rounded to "
          "the same int4 grid too (`verispec quantize --lm-head`: the tied embedding is untied and stays bf16), "
          "since the bf16 head is 8 of the w4a16 copy's 20.6 MB and a one-token step reads all of them. "
          "w4a8-head: w4a16-head's weights with every matmul input rounded to int8 per group of the weights at run "
          "time (W4A8, `verispec quantize --scheme w4a8`: integer products through vpdpbusd; not weight-only, so "
          "not a candidate for goal 2); w4a8-head8: its LM head int8 per channel, weight-only, as w4a16-head8's. "
          "Quantization times are wall seconds when the cached copy was made (2 threads; other jobs may have "
          "shared the CPU then)."]
    copies = res.get("drafter_copies") or {}
    if copies:
        L.append("int4 drafters (the `-int4` arms below): " + "; ".join(
            f"{_rel(DRAFT_SOURCES[n])} -> {Path(c['dir']).name}, w4a16 RTN in groups of "
            f"{c['group_size']}" + (f", quantized in {c['seconds']:.0f} s" if c.get("seconds") else "")
            for n, c in copies.items())
                 + ". `verispec quantize` defaults to groups of 128 for w4a16; where 128 does not divide a layer's "
                 "input (zoo/drafter's 704-wide MLP) the largest group that does is used. A block drafter's "
                 "fc and layer projections are quantized, its sequential head stays dense (quant/drafter.py).")
    return L + [""]


def bucket_section(bname: str, b: dict, args: argparse.Namespace) -> list[str]:
    n = b.get("max_tokens", args.max_tokens)
    about = b.get("about", "code_completion prompts")
    L = [f"## Speed and acceptance: {bname} bucket (bf16 activations, {args.threads} threads)", "",
         f"{b['prompts']} prompts, {about} (mean {b['prompt_tokens']:.0f} prompt tokens) + {n} new tokens "
         f"(ignore_eos), k = {args.k} (arms named `{DSPARK}`: the dspark policy, which verifies at most k), "
         f"medians over {args.repeats} repeats of the sum over prompts; speedups against verispec's bf16 plain "
         "in the same repeat. e2e: prefill included; per token: after the target's prefill (SpecStats.decode_s; "
         "tok/s counts every output token). τ and per-position acceptance (the "
         "fraction of drafted rounds whose position j was accepted) from the first repeat. `= plain`: generations "
         "(all repeats) whose tokens equal the same target's plain greedy output. drafter ms/round: the drafter's "
         "own time (SpecStats.draft_s) per decode round.", "", *speed_table(b), ""]
    if b.get("llamacpp"):
        L += [f"llama.cpp {llamacpp.VERSION} on the same prompt token ids, right after verispec's arms on each "
              "prompt (GGUFs of zoo/target: q4_0 and q8_0 are llama.cpp's own quantizations of the same weights, "
              f"not verispec's copies; `plain` through the binding, `lookup` and `speculative` (draft zoo/drafter "
              f"bf16, {llamacpp.DRAFT} tokens) llama.cpp's own binaries timed by their own counters; flash "
              "attention on, K and V cached in f16: llama.cpp's CPU defaults). Speedups are tokens/s against "
              "verispec's bf16 plain in the same repeat.", "", *llamacpp_table(b), ""]
    L += [profile_line(b), "", "Compounding: each drafter on a quantized target against the product of the "
          "quantized target's plain speedup and the drafter's speedup on bf16 (compound: at least the product; "
          "conflict: short of it). Last column: the drafter's gain over its target's plain decoding per output "
          "token, measured, and as the step profile predicts it (τ x t(1) / (t(k+1) + drafter ms/round)).", "",
          *compounding_table(b), ""]
    name = slug(bname)
    if (args.out / f"speed-{name}.png").is_file():
        L += [f"![speedups, {bname}](speed-{name}.png)", "", f"![acceptance, {bname}](accept-{name}.png)", ""]
    return L


def write_report(out: Path, args: argparse.Namespace, res: dict) -> None:
    minutes = f"{res['wall_s'] / 60:.0f} minutes" if res.get("wall_s") else "tens of minutes"
    L = ["# Quantized targets x speculation on the zoo (issue 20)", "",
         f"Produced by one command ({minutes} on this machine, quality included; quantized copies and GGUFs are "
         "cached under .cache/quant/ and ~/.cache/verispec/llama.cpp/; the numbers are also in results.json):", "",
         "```bash", res["command"], "```", "",
         "Machine (lscpu):", "", "```", *res.get("machine", machine()), "```", "",
         "Numbers from a shared 2-vCPU VM: other work on the host moves absolute tokens/s by a few percent; the "
         "arms are interleaved prompt by prompt, so ratios are the figures to read.", ""]
    L += quality_section(res)
    for bname, b in res["speed"].items():
        L += bucket_section(bname, b, args)
    if res.get("llamacpp_skipped"):
        L += ["Not run: " + "; ".join(res["llamacpp_skipped"]) + ".", ""]
    L += goals(res["speed"], bool(args.llamacpp_note))
    L += ["## Also here", "",
          "- `qgemm_cost.txt`: the per-matmul cost of verispec's int8/int4 kernel (kernels/qgemm.c) against "
          "PyTorch's own int kernels at 1-16 rows on the zoo target's shapes (scripts/qgemm_cost.py).", ""]
    for note in args.note:
        L += [Path(note).read_text().strip(), ""]
    L += ["## Not measured yet (issue 20 still asks for them)", "",
          "- The stage-2 drafter (DSpark fine-tuned on the quantized target's continuations) in these tables: "
          "measured in a separate pair of runs on the short and medium buckets (notes above, stage2/), not on long.",
          "- QAD (quantization-aware distillation, `verispec train qad`) in these tables: its quality is in qad.md "
          "(groups of 32, 600 steps from GPTQ: greedy agreement with bf16 93.5% against GPTQ's 82.5%), measured by "
          "separate quality-only runs of this script.",
          "- A QAD copy in these tables: its speed and τ beside its GPTQ start are in qad-speed/ (short and medium "
          "buckets), not here."]
    if args.llamacpp_note:
        L += ["", "## llama.cpp side by side (a separate run)", "", Path(args.llamacpp_note).read_text().strip()]
    (out / "README.md").write_text("\n".join(L) + "\n")


# ---------------------------------------------------------------------------------------------- plots

def plot_speedups(bname: str, b: dict, path: Path) -> None:
    """Grouped bars of e2e and per-token speedup against bf16 plain: one group per drafter arm (drafter and its
    weights), one bar per target; llama.cpp's arms as dashed reference lines."""
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r["drafter"] for r in b["rows"]))
    targets = list(dict.fromkeys(r["target"] for r in b["rows"]))
    rows = {(r["target"], r["drafter"]): r for r in b["rows"]}
    width = 0.8 / len(targets)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.2 * len(drafters) + 3), 8), sharex=True)
    for ax, key, what in zip(axes, ("speedup", "decode_speedup"), ("end to end", "per output token")):
        for i, t in enumerate(targets):
            xs = [j for j, d in enumerate(drafters) if (t, d) in rows]
            ys = [rows[(t, drafters[j])][key] for j in xs]
            bars = ax.bar([x + (i - (len(targets) - 1) / 2) * width for x in xs], ys, width, label=f"{t} target")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        for j, r in enumerate(b.get("llamacpp", [])):
            ax.axhline(r[key], ls="--", lw=1.2, color=f"C{len(targets) + j}", label=f"llama.cpp {r['arm']}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel(f"x bf16 plain, {what}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    labels = [d if weights(d) == "-" else f"{d.replace(INT4, '')}\n{weights(d)} drafter" for d in drafters]
    axes[1].set_xticks(range(len(drafters)), labels, fontsize=8)
    fig.suptitle(f"{bname} bucket: {b['prompts']} prompts of ~{b['prompt_tokens']:.0f} tokens + "
                 f"{b.get('max_tokens', '?')} new")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(bname: str, b: dict, path: Path) -> None:
    """Per drafter arm, the fraction of drafted rounds whose position j was accepted, one line per target."""
    import matplotlib.pyplot as plt

    drafters = [d for d in dict.fromkeys(r["drafter"] for r in b["rows"]) if d != "plain"]
    if not drafters:
        return
    cols = min(4, len(drafters))
    nrows = math.ceil(len(drafters) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), sharey=True, squeeze=False)
    for ax, d in zip(axes.flat, drafters):
        for r in (r for r in b["rows"] if r["drafter"] == d and r["accept_per_pos"]):
            pos = range(1, len(r["accept_per_pos"]) + 1)
            ax.plot(pos, r["accept_per_pos"], "o-", ms=3, label=f"{r['target']} (τ {r['tau']:.2f})")
        ax.set_title(d, fontsize=9)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(drafters):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("accepted (share of rounds)")
    fig.suptitle(f"{bname} bucket: per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out: Path, buckets: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    for bname, b in buckets.items():
        plot_speedups(bname, b, out / f"speed-{slug(bname)}.png")
        plot_acceptance(bname, b, out / f"accept-{slug(bname)}.png")


# ---------------------------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-task", type=int, default=8, help="prompts in each speed bucket (at most 8 in "
                    "the medium and long ones)")
    ap.add_argument("--buckets", default=",".join(DEFAULT_BUCKETS),
                    help=f"speed buckets, comma-separated, of {', '.join(BUCKETS)} (bench: the bench's ~590-token "
                         "code prompts, not in the default set)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="new tokens per generation in every bucket (default: each bucket's own, "
                         + ", ".join(f"{b} {n}" for b, n in BUCKETS.items()) + ")")
    ap.add_argument("--targets", default=",".join(SPEED_TARGETS), help="speed-run targets, comma-separated, of "
                    f"{', '.join(COPIES)} (bf16 plain always runs: it is the reference)")
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help="drafter arms, comma-separated, of "
                    f"{', '.join(DRAFTERS)} (plain always runs); NAME{DSPARK}: that drafter, dspark policy")
    ap.add_argument("--llamacpp", default=LLAMACPP_ARMS,
                    help="llama.cpp arms (KIND-QUANT, as `verispec bench --llamacpp`), or none; arms whose build "
                         "is missing are skipped with a note")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short-len", type=int, default=64, help="short bucket: the code prompts' last N tokens")
    ap.add_argument("--profile-repeats", type=int, default=7, help="timed forwards per point of the step profile")
    ap.add_argument("--quality-prompts", type=int, default=24)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--ppl-texts", type=int, default=24, help="held-out code and prose texts for perplexity")
    ap.add_argument("--no-gptq", action="store_true", help="skip the GPTQ copy")
    ap.add_argument("--w4-group", type=int, default=32, help="group size of the int4 target copies")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                    help="another quantized copy for the quality table (e.g. w4a16-qad=data/quant/qad-w4a16-g128, "
                         "from `verispec train qad`), a speed target too where --targets names it; repeatable")
    ap.add_argument("--dspark", type=Path, default=DRAFT_SOURCES["dspark"],
                    help="the DSpark drafter of the dspark arms (e.g. a stage-2 drafter trained for a quantized target)")
    ap.add_argument("--model", type=Path, default=DRAFT_SOURCES["model"],
                    help="the draft model of the model arms (and llama.cpp's speculative arm), e.g. a stage-2 one")
    ap.add_argument("--quality-only", action="store_true",
                    help="measure quality only: print its table and write OUT/quality.json (no speed, no README)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache/quant")
    ap.add_argument("--llamacpp-note", type=Path, default=None,
                    help="a markdown file appended as a separate run's llama.cpp section")
    ap.add_argument("--note", type=Path, action="append", default=[],
                    help="a markdown file appended before 'Not measured yet', as is; repeatable")
    ap.add_argument("--rerender", action="store_true",
                    help="rewrite README.md and the plots from OUT/results.json (e.g. to add a note) without measuring")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/quant")
    args = ap.parse_args()
    if bad := [e for e in args.extra if "=" not in e or not e.split("=", 1)[0] or e.split("=", 1)[0] in COPIES]:
        ap.error(f"--extra: {', '.join(bad)}: use NAME=DIR with a NAME that is not one of {', '.join(COPIES)}")
    extra = [e.split("=", 1)[0] for e in args.extra]  # a copy made elsewhere (e.g. by QAD) can be a speed target
    for opt, allowed in (("buckets", BUCKETS), ("targets", [*COPIES, *extra]), ("drafters", DRAFTERS)):
        names = [x.strip() for x in getattr(args, opt).split(",") if x.strip()]
        if bad := [x for x in names if (base(x) if opt == "drafters" else x) not in allowed or x == "plain" + DSPARK]:
            ap.error(f"--{opt}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
        setattr(args, opt, names)
    args.drafters = ["plain", *(d for d in args.drafters if d != "plain")]
    args.llamacpp = () if args.llamacpp.strip() == "none" else llamacpp.parse_arms(args.llamacpp)
    return args


def rerender(args: argparse.Namespace) -> None:
    """README.md and the plots again from OUT/results.json (its run's settings; this command's notes)."""
    res = json.loads((args.out / "results.json").read_text())
    args.__dict__.update(res["args"])
    res["command"] = res["command"].split("\n")[0]
    notes = [f"--note {n}" for n in args.note] + (
        [f"--llamacpp-note {args.llamacpp_note}"] if args.llamacpp_note else [])
    if notes:
        res["command"] += f"\npython scripts/quant_report.py --rerender --out {res['out']} " + " ".join(notes)
    write_plots(args.out, res["speed"])
    write_report(args.out, args, res)
    print(f"wrote {args.out / 'README.md'}")


def estimate(args: argparse.Namespace, sets: dict[str, tuple[list[list[int]], str, int]], copies: int) -> str:
    """A rough guess of the run's minutes from PACE (the one-time quantization and GGUF conversion not included)."""
    arms = len(args.drafters) * len(args.targets) + len(args.llamacpp) + (1 if "bf16" not in args.targets else 0)
    speed_s = sum((args.repeats * len(p) + 1) * arms * (statistics.mean(map(len, p)) / PACE["prefill"]
                                                        + n / PACE["decode"]) for p, _, n in sets.values())
    quality_s = copies * args.quality_prompts * args.agree_tokens / PACE["fp32"]
    return f"speed ~{speed_s / 60:.0f} min, quality ~{quality_s / 60:.0f} min"


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    if args.rerender:
        return rerender(args)
    start = time.perf_counter()
    print(*(line for line in machine() if line.startswith("Model name")), flush=True)
    cmd = "python scripts/quant_report.py " + shlex.join(sys.argv[1:])
    tok = Tokenizer.from_dir(TARGET)
    sets = {}
    for b in args.buckets:
        n = args.max_tokens or BUCKETS[b]
        sets[b] = (*bucket_prompts(b, tok, args.prompts_per_task, n, args.short_len), n)
    extra = {k: Path(v) for k, v in (e.split("=", 1) for e in args.extra)}
    copies = len(COPIES) - args.no_gptq + len(extra)
    print(f"rough estimate: {estimate(args, sets, copies)} (plus quantizing and converting what is not cached)",
          flush=True)
    dirs, quant_times = target_dirs(args.cache, not args.no_gptq, args.w4_group)
    dirs.update(extra)
    qual = quality(dirs, tok, args.quality_prompts, args.agree_tokens, args.ppl_texts)
    if args.quality_only:
        return write_quality(args, extra, qual)
    DRAFT_SOURCES["dspark"] = args.dspark.resolve()
    DRAFT_SOURCES["model"] = args.model.resolve()
    int4 = {n: int4_copy(src, args.cache) for n, src in DRAFT_SOURCES.items()
            if any(base(d).endswith(INT4) and f"{{{n}}}" in DRAFTERS[base(d)] for d in args.drafters)}
    lcpp, skipped = llamacpp_arms(args.llamacpp, args.threads)
    for line in skipped:
        print(line, flush=True)
    arms = build_arms(dirs, args.targets, drafter_specs(args.drafters, int4), args.k)
    buckets = {}
    for b, (prompts, about, n) in sets.items():
        print(f"speed: {b} bucket ({len(prompts)} prompts, {n} new tokens)", flush=True)
        fresh = [Arm(a.target, a.drafter, a.llm) for a in arms]
        buckets[b] = {**speed(b, prompts, n, args.repeats, fresh, lcpp), "about": about}
        buckets[b]["profile"] = step_profile(fresh, buckets[b], args.k, args.profile_repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    keep = ("max_tokens", "repeats", "k", "threads", "prompts_per_task", "short_len", "profile_repeats", "buckets",
            "targets", "drafters", "llamacpp")
    res = {"format": 2, "command": cmd, "out": str(args.out), "args": {k: args.__dict__[k] for k in keep},
           "quantize_seconds": quant_times, "quality": qual, "speed": buckets, "llamacpp_skipped": skipped,
           "drafter_copies": {n: {**c, "dir": str(c["dir"])} for n, c in int4.items()},
           "wall_s": time.perf_counter() - start, "machine": machine()}  # rerender may run on another machine
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    write_plots(args.out, buckets)
    write_report(args.out, args, res)
    print(f"wrote {args.out / 'README.md'} ({res['wall_s'] / 60:.1f} min)")


def write_quality(args: argparse.Namespace, extra: dict, qual: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    saved = {"w4_group": args.w4_group, "extra": {k: str(v) for k, v in extra.items()}, "quality": qual}
    (args.out / "quality.json").write_text(json.dumps(saved, indent=1) + "\n")
    for name in (n for n in qual if not n.startswith("_")):
        q = qual[name]
        print(f"{name}: agreement {q['agree']:.1%}, identical prefix {q['prefix']:.1f}, identical "
              f"{q['identical']}/{qual['_config']['prompts']}, ppl code {q['ppl_code']:.3f}, "
              f"ppl prose {q['ppl_prose']:.3f}")
    print(f"wrote {args.out / 'quality.json'}")


if __name__ == "__main__":
    main()
