"""`verispec bench`: every registered drafter over a grid of k on the task prompt sets, against plain
decoding in the same run, plus Hugging Face baselines on the same weights and dtype.

Timing is interleaved prompt by prompt (plain, then each method), and speedups are medians over repeats of
(plain time / method time) summed over a task's prompts.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from verispec.bench.prompts import PROMPT_DIR, TASKS, load_prompts
from verispec.config import DEFAULT_DTYPE, SamplingParams, SpecConfig
from verispec.decode import GenerationResult, decode
from verispec.drafters import BENCH_SPECS, build_drafter
from verispec.metrics import SpecStats
from verispec.model import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.zoo import zoo_dir

NEAR_TIE_LOGPROB = 0.05  # reliability.md A7: a bf16 divergence is explained if the top-2 log-probs are this close


@dataclass(frozen=True)
class BenchConfig:
    target: Path
    dtype: str = DEFAULT_DTYPE
    ks: tuple[int, ...] = (2, 4, 8)
    prompts_per_task: int = 12
    max_tokens: int = 128
    repeats: int = 3
    tasks: tuple[str, ...] = TASKS
    prompt_files: tuple[Path, ...] = ()
    methods: tuple[str, ...] = ()  # drafter specs; default: every registered drafter's bench spec
    policies: tuple[str, ...] = ("fixed",)  # SpecConfig.policy values, each run with every method and k
    baselines: bool = True
    baseline_prompts: int = 4
    llamacpp: tuple[str, ...] = ()  # llama.cpp arms (bench/llamacpp.py: KIND-QUANT), after verispec's on each prompt
    llamacpp_draft: Path | None = None  # its `speculative` arm's draft model (default: the `model:` method's)

    @classmethod
    def quick(cls, target: Path, **kw) -> BenchConfig:
        return cls(target, **{**dict(ks=(4,), prompts_per_task=3, max_tokens=48, repeats=1, baseline_prompts=2), **kw})


@dataclass
class Cell:
    """Accumulated results of one (task, method, k)."""

    times: list[float] = field(default_factory=list)  # per repeat: seconds summed over the task's prompts
    plain_times: list[float] = field(default_factory=list)
    decode_times: list[float] = field(default_factory=list)  # the same after each prompt's prefill (SpecStats.decode_s)
    plain_decode_times: list[float] = field(default_factory=list)
    tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    equal: int = 0
    diverged: list[tuple[list[int], list[int], list[int]]] = field(default_factory=list)  # (prompt, plain, spec)


def method_labels(specs: list[str]) -> dict[str, str]:
    """A report's name for each spec: the drafter's name (a `lookup:` wrapper's with its inner drafter's,
    `lookup:dspark`), with the rest of the spec where two specs share one (`dspark (zoo/dspark)` and
    `dspark (zoo/dspark:full-vocab)`)."""
    parts = [s.split(":") for s in specs]
    names = [":".join(p[:2]) if p[0] == "lookup" and len(p) > 1 else p[0] for p in parts]
    return {s: n if names.count(n) == 1 else f"{n} ({s[len(n) + 1:] or n})" for s, n in zip(specs, names)}


def _task_prompts(cfg: BenchConfig) -> dict[str, list[str]]:
    sets: dict[str, list[str]] = {}
    for task in cfg.tasks:
        sets[task] = [r["prompt"] for r in load_prompts(PROMPT_DIR / f"{task}.jsonl")][: cfg.prompts_per_task]
    for f in cfg.prompt_files:
        for r in load_prompts(f):
            sets.setdefault(f"{f.stem}:{r['task']}", []).append(r["prompt"])
    return sets


def conditional_acceptance(s: SpecStats) -> list[float]:
    """P(position j accepted | all before it accepted), j = 1..k."""
    out, before = [], s.num_drafts
    for a in s.accepted_per_pos:
        out.append(a / before if before else 0.0)
        before = a
    return out


@torch.inference_mode()
def _top2_gap(model, tokens: list[int]) -> float:
    """|log p(top1) - log p(top2)| of the next token after `tokens`."""
    logits, _ = model(torch.tensor([tokens]), num_logits=1)
    top = logits[0, -1].float().log_softmax(-1).topk(2).values
    return float(top[0] - top[1])


def _llamacpp_arms(cfg: BenchConfig, specs: list[str], n_ctx: int):
    """The llama.cpp arms, converted and checked before any timing; the draft model defaults to the `model:`
    method's, then the zoo's."""
    from verispec.bench.llamacpp import BenchArms

    draft = cfg.llamacpp_draft or next((Path(s.split(":", 1)[1]) for s in specs if s.startswith("model:")), None)
    if draft is None and (zoo_dir() / "drafter" / "config.json").is_file():
        draft = zoo_dir() / "drafter"
    return BenchArms(cfg.target, cfg.llamacpp, n_ctx, torch.get_num_threads(), draft)


def run(cfg: BenchConfig, out: Path, progress: bool = True) -> dict:
    from tqdm import tqdm

    target = load_model(cfg.target, dtype=cfg.dtype)
    target.source_dir = cfg.target
    tok = Tokenizer.from_dir(cfg.target)
    specs = list(cfg.methods) or [s for f in BENCH_SPECS.values() if (s := f(zoo_dir())) is not None]
    drafters = {s: build_drafter(s, target=target, dtype=target.dtype, device=target.device) for s in specs}
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
    room = target.config.context_limit - cfg.max_tokens - 1
    sets = {task: [tok.encode(p)[-room:] for p in prompts] for task, prompts in _task_prompts(cfg).items()}
    methods = [(s, k, pol) for s in specs for k in cfg.ks for pol in cfg.policies]
    cells = {(task, *m): Cell() for task in sets for m in methods}
    lcpp = _llamacpp_arms(cfg, specs, target.config.context_limit) if cfg.llamacpp else None
    total_runs = cfg.repeats * sum(len(p) for p in sets.values()) * (1 + len(methods) + len(cfg.llamacpp))
    bar = tqdm(total=total_runs, disable=not progress, desc="bench", unit="gen")
    decode(target, sets[next(iter(sets))][0], replace(params, max_tokens=8))  # warm-up
    profile = None
    if "dspark" in cfg.policies:  # measured (or read from the cache) before any timing
        from verispec.profile import load_or_measure

        profile = load_or_measure(target)
    for rep in range(cfg.repeats):
        for task, prompts in sets.items():
            plain_total, method_total = 0.0, {m: 0.0 for m in methods}
            plain_decode, method_decode = 0.0, {m: 0.0 for m in methods}
            for prompt in prompts:
                t0 = time.perf_counter()
                plain = decode(target, prompt, params)
                plain_total += time.perf_counter() - t0
                plain_decode += plain.stats.decode_s
                bar.update(1)
                for s, k, pol in methods:
                    t0 = time.perf_counter()
                    res: GenerationResult = decode(target, prompt, params, drafter=drafters[s],
                                                   spec=SpecConfig(k=k, policy=pol), profile=profile)
                    method_total[(s, k, pol)] += time.perf_counter() - t0
                    method_decode[(s, k, pol)] += res.stats.decode_s
                    bar.update(1)
                    if rep == 0:
                        cell = cells[(task, s, k, pol)]
                        cell.tokens += len(res.token_ids)
                        cell.stats.add(res.stats)
                        if res.token_ids == plain.token_ids:
                            cell.equal += 1
                        else:
                            cell.diverged.append((prompt, plain.token_ids, res.token_ids))
                if lcpp is not None:
                    lcpp.run_prompt(task, prompt, cfg.max_tokens, first_repeat=rep == 0)
                    bar.update(len(cfg.llamacpp))
            if lcpp is not None:
                lcpp.end_repeat(task)
            for m in methods:
                cell = cells[(task, *m)]
                cell.times.append(method_total[m])
                cell.plain_times.append(plain_total)
                cell.decode_times.append(method_decode[m])
                cell.plain_decode_times.append(plain_decode)
    bar.close()

    labels = method_labels(specs)
    records = []
    for (task, s, k, pol), cell in cells.items():
        gaps = []
        for prompt, a, b in cell.diverged:
            i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            gaps.append(_top2_gap(target, prompt + a[:i]))
        plain_tps = cell.tokens / statistics.median(cell.plain_times) if cell.plain_times else 0.0
        records.append({
            "task": task, "method": labels[s] if pol == "fixed" else f"{labels[s]} +{pol} policy", "spec": s,
            "k": k, "policy": pol,
            "tau": cell.stats.tau, "acceptance_rate": cell.stats.acceptance_rate,
            "accepted_per_pos": conditional_acceptance(cell.stats),
            "tokens_per_s": cell.tokens / statistics.median(cell.times),
            "plain_tokens_per_s": plain_tps,
            "decode_tokens_per_s": cell.tokens / statistics.median(cell.decode_times),
            "plain_decode_tokens_per_s": cell.tokens / statistics.median(cell.plain_decode_times),
            "speedup_vs_plain": statistics.median(p / t for p, t in zip(cell.plain_times, cell.times)),
            # The same ratio without the prompt's prefill, identical work on both sides (time per output token).
            "decode_speedup_vs_plain": statistics.median(
                p / t for p, t in zip(cell.plain_decode_times, cell.decode_times)),
            # Where a round's time goes after the prefill (first repeat): the drafter's share, the rest is the
            # verifying target forward.
            "round_ms": 1e3 * (cell.stats.elapsed_s - cell.stats.prefill_s) / max(1, cell.stats.num_rounds),
            "draft_ms": 1e3 * cell.stats.draft_s / max(1, cell.stats.num_rounds),
            "plain_step_ms": 1e3 * statistics.median(cell.plain_decode_times) / max(1, cell.tokens),
            "equal_to_plain": not cell.diverged, "num_prompts": cell.equal + len(cell.diverged),
            "num_diverged": len(cell.diverged),
            "num_diverged_at_near_tie": sum(g < NEAR_TIE_LOGPROB for g in gaps),
            "divergence_top2_gaps": gaps,
        })
    report = {"config": json.loads(json.dumps(asdict(cfg), default=str)), "threads": torch.get_num_threads(),
              "records": records, "baselines": []}
    if cfg.baselines:
        from verispec.bench.baselines import run_baselines

        report["baselines"] = run_baselines(cfg, target, tok, sets, drafters, progress)
    if lcpp is not None:
        from verispec.bench.llamacpp import fp32_equality

        report["llamacpp"] = {"records": lcpp.records(),
                              "fp32_equality": fp32_equality(cfg.target, sets, cfg.max_tokens, torch.get_num_threads())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    from verispec.bench.report import write_report

    write_report(report, out)
    return report
