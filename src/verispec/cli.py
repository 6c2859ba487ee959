"""`verispec <verb>`: one typed function per verb. Bad input prints one `error:` line and exits 2."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.config import DECODE_POLICIES, DEFAULT_DTYPE, DTYPES, SamplingParams, SpecConfig, TreeConfig
from verispec.errors import VerispecError

if TYPE_CHECKING:
    from verispec.api import LLM
    from verispec.decode import GenerationResult


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, speculatively or plainly")
    p.add_argument("--target", type=Path, default=None,
                   help="target checkpoint directory, Hugging Face layout (default: the zoo's target)")
    p.add_argument("--drafter", default=None,
                   help="ngram | ngram:MAX_N | model:DIR | model (self-draft) | dspark:DIR | lookup:SPEC | "
                        "vericache(compress=..., budget=..., draft=SPEC) | none (plain decoding); default: with the "
                        "zoo's target, the zoo's fastest drafter (lookup:dspark:zoo/dspark, else ngram), with any "
                        "other target ngram")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (the most, with --policy dspark)")
    p.add_argument("--kv-tier", default=None,
                   help="keep the target's KV cache on this device between forwards and swap it in for each "
                        "(e.g. cpu: host memory when the model runs on CUDA); default: beside the model")
    p.add_argument("--verify", default="auto", choices=["auto", "rejection", "sample-match"])
    p.add_argument("--tree", default=None, choices=["auto", "off"],
                   help="draft trees (EAGLE-2 dynamic trees; Medusa's static tree) from drafters that draw them "
                        "(model, eagle, mtp, medusa); default: the drafter spec's own (chains); raise --k with the nodes")
    p.add_argument("--tree-width", type=int, default=TreeConfig.width)
    p.add_argument("--tree-depth", type=int, default=TreeConfig.depth)
    p.add_argument("--tree-nodes", type=int, default=TreeConfig.nodes)
    p.add_argument("--policy", default=SpecConfig.policy, choices=list(DECODE_POLICIES),
                   help="fixed: verify every draft token; dspark: verify the prefix DSpark's rule picks from the "
                        "drafter's confidences and the target's measured step time")
    p.add_argument("--temperature", type=float, default=SamplingParams.temperature)
    p.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    p.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=SamplingParams.max_tokens)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file whose contents are the prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--compare", action="store_true",
                   help="also decode plainly, interleaved (plain, speculative, plain, ...): report equal_to_plain "
                        "per repeat and the median speedup, end to end and per output token")
    p.add_argument("--repeats", type=int, default=3, help="plain/speculative pairs timed by --compare (default 3)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec.api import LLM, set_threads

    set_threads(args.threads)
    if args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text()
        except OSError as e:
            raise VerispecError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None
    else:
        prompt = args.prompt
    if args.compare and args.repeats < 1:
        raise VerispecError(f"--repeats must be at least 1 (got {args.repeats})")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    from verispec.zoo import default_target

    target = args.target or default_target()
    drafter = args.drafter or _default_drafter(target)
    llm = LLM(target, drafter=None if drafter == "none" else drafter, k=args.k,
              verify=args.verify, policy=args.policy, dtype=args.dtype, kv_tier=args.kv_tier,
              tree=None if args.tree is None else TreeConfig(args.tree, args.tree_width, args.tree_depth,
                                                             args.tree_nodes))
    if args.compare and llm.drafter is None:
        raise VerispecError("--compare needs a drafter (it compares speculative with plain decoding)")
    if not args.json:
        what = "plain decoding" if llm.drafter is None else f"drafter {drafter}, k {args.k}, policy {args.policy}"
        print(f"target {target} ({args.dtype}), {what}", file=sys.stderr)
    if args.compare:
        # Warm both paths once so one-off allocation costs fall on neither measurement.
        warm = SamplingParams(max_tokens=2 * args.k + 2, ignore_eos=True)
        llm.generate(prompt, warm, plain=True)
        llm.generate(prompt, warm)
    result = None
    if not args.json:
        if args.compare:  # the prompt too, so the continuation reads in context (stdout: prompt + continuation)
            print(f"--- prompt ({len(llm.encode(prompt))} tokens) ---", file=sys.stderr)
            sys.stdout.write(prompt)
            sys.stdout.flush()
            newline = "" if prompt.endswith("\n") else "\n"
            print(f"{newline}--- continuation (speculative) ---", file=sys.stderr)
        for event in llm.stream(prompt, params):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            result = event.result or result
        sys.stdout.write("\n")
        sys.stdout.flush()
    pairs = _interleaved_runs(llm, prompt, params, args.repeats) if args.compare else []
    if result is None:  # --json: the first timed speculative run, or a run of its own
        result = pairs[0][1] if pairs else llm.generate(prompt, params)[0]
    out = result.to_dict()
    out["drafter"] = None if llm.drafter is None else drafter
    if args.compare:
        out.update(_compare_summary(pairs, result))
    if args.json:
        print(json.dumps(out))
        return 0
    s = out["stats"]
    print(f"[{len(result.token_ids)} tokens, {s['tokens_per_s']:.1f} tok/s, tau {s['tau']:.2f}, "
          f"acceptance {s['acceptance_rate']:.2f}, finish {result.finish_reason}]", file=sys.stderr)
    if args.compare:
        _print_compare(out)
    return 0


def _specs(text: str) -> list[str]:
    """Comma-separated drafter specs; a structured spec's own commas stay inside its parentheses."""
    from verispec.drafters.spec import split_specs

    return split_specs(text)


def _default_drafter(target: Path) -> str:
    """The zoo's fastest drafter for the zoo's own target; prompt lookup (`ngram`, any vocabulary) for another."""
    from verispec.zoo import best_drafter_spec, zoo_dir

    return best_drafter_spec() if Path(target).resolve() == (zoo_dir() / "target").resolve() else "ngram"


def _interleaved_runs(
    llm: LLM, prompt: str, params: SamplingParams, repeats: int
) -> list[tuple[GenerationResult, GenerationResult]]:
    """(plain, speculative) results, run plain, speculative, plain, ... so machine load drifts over both alike."""
    return [(llm.generate(prompt, params, plain=True)[0], llm.generate(prompt, params)[0]) for _ in range(repeats)]


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _compare_summary(pairs: list[tuple[GenerationResult, GenerationResult]], shown: GenerationResult) -> dict:
    """Per-repeat records and their medians. A run's speed comes from its own stats: end to end (from the start of
    decoding, the prompt's prefill included) and per output token (after the prefill, the work speculation can
    remove). `speedup` (end to end), `equal_to_plain` (every repeat, and `shown`, the reported run) and
    `plain_tokens_per_s` keep the meaning they had with a single run."""
    import statistics

    runs = []
    for plain, spec in pairs:
        p, s = plain.stats, spec.stats
        r = {"equal_to_plain": spec.token_ids == plain.token_ids,
             "tokens_per_s": s.tokens_per_s, "plain_tokens_per_s": p.tokens_per_s,
             "decode_tokens_per_s": _rate(s.num_output_tokens, s.decode_s),
             "plain_decode_tokens_per_s": _rate(p.num_output_tokens, p.decode_s)}
        r["speedup"] = _ratio(r["tokens_per_s"], r["plain_tokens_per_s"])
        r["decode_speedup"] = _ratio(r["decode_tokens_per_s"], r["plain_decode_tokens_per_s"])
        runs.append(r)

    def median(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "equal_to_plain": all(r["equal_to_plain"] for r in runs) and shown.token_ids == pairs[0][0].token_ids,
        "speedup": median("speedup"), "decode_speedup": median("decode_speedup"),
        "plain_tokens_per_s": median("plain_tokens_per_s"), "median_tokens_per_s": median("tokens_per_s"),
        "speedup_basis": "end to end, prompt prefill included; decode_speedup: per output token, after the prefill",
        "repeats": runs,
    }


def _print_compare(out: dict) -> None:
    runs = out["repeats"]
    for i, r in enumerate(runs, 1):
        print(f"repeat {i}: plain {r['plain_tokens_per_s']:.1f} tok/s, speculative {r['tokens_per_s']:.1f} tok/s: "
              f"{_times(r['speedup'])} end to end, {_times(r['decode_speedup'])} per output token; "
              f"equal_to_plain {r['equal_to_plain']}", file=sys.stderr)
    print(f"speedup over plain decoding, median of {len(runs)} interleaved repeats: {_times(out['speedup'])} end to "
          f"end (prompt prefill included), {_times(out['decode_speedup'])} per output token (after the prefill); "
          f"equal_to_plain {out['equal_to_plain']} (every repeat)", file=sys.stderr)


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from verispec.bench.suite import BenchConfig

    p = sub.add_parser("bench", help="benchmarks: side by side, medians over repeats")
    p.add_argument("suite", nargs="?", default="tasks", choices=["tasks", "core", "serve", "ablation"],
                   help="tasks (default): every drafter x k on the task prompt sets, with HF baselines; "
                        "core: plain decoding vs HF generate on a random 49M model, ngram, per-forward cost; "
                        "serve: load against the engine per verification policy and drafter; "
                        "ablation: block-drafter losses and heads trained on the same budget")
    p.add_argument("--quick", action="store_true", help="a few prompts, k=4, 48 tokens: minutes, not half an hour")
    p.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the zoo's)")
    p.add_argument("--methods", default=None,
                   help="comma-separated drafter specs (default: every registered drafter on the zoo)")
    p.add_argument("--k", default=None, help="comma-separated draft lengths (default 2,4,8; quick: 4)")
    p.add_argument("--policies", default=None,
                   help="comma-separated draft-length policies, each run with every method and k (fixed, dspark; "
                        "default fixed)")
    p.add_argument("--prompts", type=Path, action="append", default=[],
                   help="extra prompt file (JSONL of {'prompt'} or Spec-Bench question.jsonl), repeatable")
    p.add_argument("--tasks", default=None, help="comma-separated subset of the shipped task sets")
    p.add_argument("--prompts-per-task", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--dtype", default=BenchConfig.dtype, choices=DTYPES)
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--llamacpp", default=None, metavar="ARMS",
                   help="llama.cpp arms interleaved with verispec's: comma-separated KIND[-QUANT] (plain, speculative, "
                        "lookup; f32, bf16, q8_0, q4_0), or all (plain-bf16,plain-q8_0,plain-q4_0,speculative,lookup); "
                        "needs `bash scripts/llamacpp.sh`")
    p.add_argument("--llamacpp-draft", type=Path, default=None,
                   help="draft model of the llama.cpp speculative arm (default: the model: method's, else the zoo's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--new-tokens", type=int, default=128, help="core suite: tokens per generation")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache"), help="core suite: random checkpoints")
    p.add_argument("--concurrency", default=None, help="serve suite: comma-separated client counts")
    p.add_argument("--drafters", default=None, help="serve suite: comma-separated drafter specs (default: ngram, "
                                                    "the zoo's draft model and its dspark drafter)")
    p.add_argument("--poisson", default=None,
                   help="serve suite: comma-separated open-loop offered rates (req/s, Poisson; '' for none)")
    p.add_argument("--poisson-duration", type=float, default=None,
                   help="serve suite: seconds of arrivals per open-loop rate")
    p.add_argument("--poisson-repeats", type=int, default=None,
                   help="serve suite: passes of the open loop, the arms' order rotated each pass; medians per rate and "
                        "a majority's verdict (default 1)")
    p.add_argument("--capacity-rate", type=float, default=None,
                   help="serve suite: an open-loop rate above every arm's capacity (req/s), run by every arm in every "
                        "pass: its completion rate there is its capacity, the highest-load goal's reading")
    p.add_argument("--tpot-slo", type=float, default=None,
                   help="serve suite: TPOT p99 SLO in seconds of the 'highest sustained rate under the SLO'")
    p.add_argument("--kv-pool", type=int, default=None,
                   help="serve suite: the engine's KV pool in positions (EngineConfig.cache_budget_tokens); a small "
                        "one shows preemptions")
    p.add_argument("--steps", type=int, default=150, help="ablation suite: training steps per arm")
    p.add_argument("--arms", default=None, help="ablation and serve suites: comma-separated subset of the arms (serve: "
                                                "off, fixed-1/LABEL, fixed-K/LABEL, batch-table/LABEL, dspark/LABEL)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "core":
        from verispec.bench import core

        return core.main(args.out, args.repeats or 5, args.new_tokens, args.threads, args.cache_dir)
    if args.suite == "serve":
        return _bench_serve(args)
    if args.suite == "ablation":
        return _bench_ablation(args)
    import torch

    from verispec.bench.llamacpp import parse_arms
    from verispec.bench.suite import BenchConfig, run
    from verispec.zoo import default_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = args.target or default_target()
    overrides = {
        "ks": tuple(int(k) for k in args.k.split(",")) if args.k else None,
        "methods": tuple(_specs(args.methods)) if args.methods else None,
        "policies": tuple(args.policies.split(",")) if args.policies else None,
        "tasks": tuple(args.tasks.split(",")) if args.tasks else None,
        "prompt_files": tuple(args.prompts) or None,
        "prompts_per_task": args.prompts_per_task, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "dtype": args.dtype, "baselines": not args.no_baselines,
        "llamacpp": parse_arms(args.llamacpp) if args.llamacpp else None, "llamacpp_draft": args.llamacpp_draft,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    cfg = BenchConfig.quick(target, **overrides) if args.quick else BenchConfig(target, **overrides)
    report = run(cfg, args.out)
    from verispec.bench.report import summary_markdown

    print(summary_markdown(report))
    print(f"wrote {args.out}/results.json, summary.md, speedup.png, acceptance.png")
    return 0


def _bench_ablation(args: argparse.Namespace) -> int:
    from verispec.api import set_threads
    from verispec.bench.ablation import ARMS, AblationConfig, run
    from verispec.zoo import default_target

    set_threads(args.threads)
    cfg = AblationConfig(args.target or default_target(), steps=args.steps, dtype=args.dtype)
    arms = tuple(a for a in ARMS if not args.arms or a.name in args.arms.split(","))
    report = run(cfg, args.out, arms)
    for c in report["claims"]:
        print(f"claim: {c['claim']}: {'holds' if c['holds'] else 'does not hold'}")
    print(f"wrote {args.out}/ablation.json, ablation.md and PNGs")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from verispec.api import set_threads
    from verispec.bench.serve import ServeBenchConfig, run
    from verispec.zoo import default_drafter_spec, default_target

    set_threads(args.threads)
    from verispec.drafters import BENCH_SPECS
    from verispec.zoo import zoo_dir

    drafters = tuple(_specs(args.drafters)) if args.drafters else tuple(
        d for d in ("ngram", default_drafter_spec(), BENCH_SPECS["dspark"](zoo_dir())) if d)
    overrides = {
        "drafters": drafters, "dtype": args.dtype,
        "concurrency": tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None,
        "poisson_rates": tuple(float(r) for r in args.poisson.split(",") if r) if args.poisson is not None else None,
        "poisson_duration_s": args.poisson_duration, "tpot_slo_s": args.tpot_slo,
        "poisson_repeats": args.poisson_repeats, "capacity_rate": args.capacity_rate,
        "only_arms": tuple(a for a in args.arms.split(",") if a) if args.arms else None,
        "max_tokens": args.max_tokens, "kv_pool": args.kv_pool,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    target = args.target or default_target()
    cfg = ServeBenchConfig.quick(target, **overrides) if args.quick else ServeBenchConfig(target, **overrides)
    report = run(cfg, args.out)
    for g in report["goals"]:
        print(f"goal: {g['goal']}: {'met' if g['met'] else 'not met'}")
    print(f"wrote {args.out}/serve_results.json, serve_summary.md, serve_pareto.png, serve_openloop.png")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from verispec.train.target import TrainConfig

    p = sub.add_parser("train", help="train the zoo's models on the offline corpus")
    what = p.add_subparsers(dest="what", required=True)
    t = what.add_parser("target", help="pre-train the target model (resumes from --out/state)")
    t.add_argument("--data-dir", type=Path, default=Path("data"), help="corpus, tokenizer and token files")
    t.add_argument("--doc-dir", type=Path, default=None, help="Python reST doc sources (default: fetch the .deb)")
    t.add_argument("--out", type=Path, default=Path("data/runs/target"))
    t.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    t.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    t.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    t.add_argument("--lr", type=float, default=TrainConfig.lr)
    t.add_argument("--zoo-dir", type=Path, default=Path("zoo/target"), help="where the finished model ships")
    t.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and exit at this step (rerun the same command to continue)")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--init-from", type=Path, default=None,
                   help="warm start from this checkpoint (a second stage; fresh optimizer and schedule)")
    t.add_argument("--data-offset", type=int, default=0,
                   help="skip this many steps' batches of the data order (the steps an earlier stage used)")
    t.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    t.set_defaults(func=cmd_train_target)

    from verispec.model.block import SEQUENTIAL_HEADS
    from verispec.train.block import BlockTrainConfig
    from verispec.train.losses import LOSSES

    d = what.add_parser("drafter", help="distill the draft model from the target's continuations (resumable)")
    d.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the zoo's)")
    d.add_argument("--data-dir", type=Path, default=Path("data"))
    d.add_argument("--doc-dir", type=Path, default=None)
    d.add_argument("--kind", default="model", choices=["model", "block", "dspark", "eagle", "mtp", "medusa"],
                   help="model: a small causal LM; block: parallel block drafter (DFlash); dspark: block drafter "
                        "with the Markov head and the confidence head; eagle: EAGLE-3-style feature drafter; mtp: "
                        "DeepSeek-V3's MTP module; medusa: Medusa heads")
    d.add_argument("--ttt-steps", type=int, default=None, help="eagle: unrolled steps of training-time test")
    d.add_argument("--num-heads", type=int, default=None, help="medusa: number of heads")
    d.add_argument("--draft-vocab", type=Path, default=None,
                   help="eagle/mtp: a draft_vocab.json (e.g. zoo/dspark's) whose tokens the head trains and drafts over")
    d.add_argument("--loss", default=None, choices=list(LOSSES),
                   help="block drafters' loss (default: dspark for --kind dspark, ce+decay for block)")
    d.add_argument("--head", default=BlockTrainConfig.head, choices=list(SEQUENTIAL_HEADS),
                   help="dspark: the sequential head (markov: bias from the previous token; rnn: a gated state over "
                        "the drafted prefix, DSpark's option)")
    d.add_argument("--block-size", type=int, default=BlockTrainConfig.block_size)
    d.add_argument("--out", type=Path, default=None,
                   help="run directory (default: data/runs/KIND; data/runs/KIND-TARGETDIR for a target other than "
                        "the zoo's)")
    d.add_argument("--zoo-dir", type=Path, default=None,
                   help="where the finished drafter ships (default: zoo/KIND; zoo/KIND-TARGETDIR for a target other "
                        "than the zoo's, so a stage-2 run never overwrites the shipped drafter)")
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit at this step")
    d.add_argument("--num-sequences", type=int, default=1536, help="target continuations to distill from")
    d.add_argument("--anchors", type=int, default=None, help="block kinds: random anchors per sequence per step")
    d.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"],
                   help="the frozen target's compute dtype for its continuations (block kinds: and its hidden states "
                        "in training); fp32 is faster on CPUs without native bf16")
    d.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 1e-3 for block kinds, the draft model's recipe for model)")
    d.add_argument("--init-from", type=Path, default=None,
                   help="warm start from this drafter directory (block kinds: same architecture; model: a dense "
                        "draft model, whose architecture the run takes), fresh optimizer and schedule: stage 2 of the "
                        "recipe, with --target a quantized copy of the drafter's target")
    d.add_argument("--threads", type=int, default=None)
    d.set_defaults(func=cmd_train_drafter)

    v = what.add_parser("draft-vocab", help="a block drafter's frequency-ranked draft vocabulary (FR-Spec)")
    v.add_argument("drafter", type=Path, help="block drafter directory (writes draft_vocab.json there)")
    v.add_argument("--size", type=int, required=True, help="most frequent tokens to keep (plus the end tokens)")
    v.add_argument("--target", type=Path, default=None, help="target checkpoint with the tokenizer (default: zoo)")
    v.add_argument("--corpus", type=Path, default=None,
                   help="built corpus directory (its train.jsonl); default: the standard library's train split")
    v.set_defaults(func=cmd_train_draft_vocab)

    from verispec.quant.scheme import SCHEMES
    from verispec.train.qad import QADConfig

    q = what.add_parser("qad", help="quantization-aware distillation: train an int4/int8 copy of the target on a "
                                    "fixed grid with a per-token KL to the dense target (resumes from --out/state)")
    q.add_argument("--teacher", type=Path, default=None, help="dense target checkpoint (default: the zoo's)")
    q.add_argument("--init", type=Path, default=None,
                   help="pack-quantized copy of the teacher whose grid and weights to start from (verispec quantize "
                        "--method rtn|gptq), or a dense checkpoint (RTN grid); default: the teacher")
    q.add_argument("--scheme", default=QADConfig.scheme, choices=SCHEMES)
    q.add_argument("--group-size", type=int, default=QADConfig.group_size,
                   help="32, 64 or 128 input columns per scale (default: the scheme's; must match --init's)")
    q.add_argument("--data-dir", type=Path, default=Path("data"),
                   help="token files in DATA_DIR/tokens (verispec train target prepares them); where absent, the "
                        "standard library's train split is tokenized into --out/tokens")
    q.add_argument("--out", type=Path, default=Path("data/runs/qad"), help="run directory (state, tokens)")
    q.add_argument("--save", type=Path, default=None,
                   help="where the quantized checkpoint goes (default: data/quant/qad-SCHEME, e.g. qad-w4a16-g128)")
    q.add_argument("--max-steps", type=int, default=QADConfig.max_steps)
    q.add_argument("--batch-size", type=int, default=QADConfig.batch_size)
    q.add_argument("--seq-len", type=int, default=QADConfig.seq_len)
    q.add_argument("--lr", type=float, default=QADConfig.lr)
    q.add_argument("--dtype", default=QADConfig.dtype, choices=["bf16", "fp32"],
                   help="compute dtype (the latent weights are fp32 either way)")
    q.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and exit at this step (rerun the same command to continue)")
    q.add_argument("--threads", type=int, default=None)
    q.set_defaults(func=cmd_train_qad)


def cmd_train_draft_vocab(args: argparse.Namespace) -> int:
    from verispec.errors import ConfigError
    from verispec.model.tokenizer import Tokenizer
    from verispec.train.draft_vocab import write_draft_vocab
    from verispec.zoo import default_target

    if not (args.drafter / "config.json").is_file():
        raise ConfigError(f"{args.drafter} is not a drafter directory (no config.json)")
    tokenizer = Tokenizer.from_dir(args.target or default_target())
    try:
        meta = write_draft_vocab(args.drafter, tokenizer, args.size, args.corpus)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(f"wrote {args.drafter}/draft_vocab.json: {meta['size']} tokens covering {meta['coverage']:.1%} of "
          f"{meta['training_tokens']:,} training tokens ({meta['source']})")
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import torch

    from verispec.train.card import DRAFTER_METHOD, finalize
    from verispec.train.drafter import (DRAFT_TRAIN, continuations_file, draft_architecture, target_record,
                                        train_drafter)
    from verispec.train.prepare import prepare_data
    from verispec.zoo import default_target

    if args.threads:
        torch.set_num_threads(args.threads)
    prepare_data(args.data_dir, args.doc_dir)
    target = args.target or default_target()
    # Another target (a quantized copy, in stage 2) gets its own run and zoo directories by default.
    name = ("drafter" if args.kind == "model" else args.kind) + (
        "" if target.resolve() == default_target().resolve() else f"-{target.resolve().name}")
    out = args.out or args.data_dir / "runs" / name
    zoo_dir = args.zoo_dir or Path("zoo") / name
    if args.kind in ("eagle", "mtp", "medusa"):
        from verispec.train.feature_recipe import train_feature_recipe

        return train_feature_recipe(args, target, out, zoo_dir)
    if args.kind != "model":
        from verispec.train.block_recipe import train_block_recipe

        return train_block_recipe(args, target, out, zoo_dir)
    cfg = replace(DRAFT_TRAIN, max_steps=args.max_steps or DRAFT_TRAIN.max_steps)
    earlier = None
    if args.init_from is not None:
        cfg = replace(cfg, model=draft_architecture(args.init_from), init_from=str(args.init_from),
                      lr=args.lr or cfg.lr)
        summary_file = args.init_from / "training_summary.json"
        earlier = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    continuations = continuations_file(target, args.data_dir / "runs", "train", args.dtype)
    if train_drafter(target, args.data_dir / "tokens", out, cfg, num_sequences=args.num_sequences,
                     continuations=continuations, dtype=args.dtype, stop_at=args.stop_at) is None:
        print(f"checkpointed at step {args.stop_at} in {out}/state; rerun to continue")
        return 0
    summary = finalize(out, args.data_dir, zoo_dir, name="drafter", role="draft model",
                       method=DRAFTER_METHOD, recipe="verispec train drafter", earlier=earlier,
                       trained_for=target_record(target))
    print(f"saved {zoo_dir}: held-out perplexity {summary['heldout_perplexity']}")
    return 0


def cmd_train_qad(args: argparse.Namespace) -> int:
    from verispec.api import set_threads
    from verispec.train.qad import QADConfig, train_qad
    from verispec.zoo import default_target

    set_threads(args.threads)
    cfg = QADConfig(scheme=args.scheme, group_size=args.group_size, max_steps=args.max_steps,
                    batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, dtype=args.dtype)
    save = args.save or Path("data/quant") / f"qad-{cfg.quant_scheme.name}"
    tokens = args.data_dir / "tokens"
    summary = train_qad(args.teacher or default_target(), args.init, args.out, save, cfg,
                        tokens=tokens if (tokens / "train.bin").is_file() else None, stop_at=args.stop_at)
    if summary is None:
        print(f"checkpointed at step {args.stop_at} in {args.out}/state; rerun to continue")
        return 0
    kl = summary["heldout_kl"]
    print(f"wrote {save}: {summary['scheme']} after {summary['steps']} steps, held-out KL {kl[0]['kl']:.4f} -> "
          f"{kl[-1]['kl']:.4f}, {summary['values_changed']:.2%} of the int values moved")
    return 0


def cmd_train_target(args: argparse.Namespace) -> int:
    import torch

    from verispec.train.card import finalize
    from verispec.train.prepare import prepare_data
    from verispec.train.target import TrainConfig, train_target

    if args.threads:
        torch.set_num_threads(args.threads)
    prepare_data(args.data_dir, args.doc_dir)
    cfg = TrainConfig(max_steps=args.max_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=args.warmup_steps, data_offset=args.data_offset,
                      init_from=str(args.init_from) if args.init_from else None)
    if train_target(args.data_dir / "tokens", args.out, cfg, stop_at=args.stop_at) is None:
        print(f"checkpointed at step {args.stop_at} in {args.out}/state; rerun to continue")
        return 0
    earlier = None
    if args.init_from is not None and (args.init_from / "training_summary.json").is_file():
        earlier = json.loads((args.init_from / "training_summary.json").read_text())
    summary = finalize(args.out, args.data_dir, args.zoo_dir, name="target", role="target model", earlier=earlier)
    print(f"saved {args.zoo_dir}: held-out perplexity {summary['heldout_perplexity']}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from verispec.config import EngineConfig
    from verispec.serve.protocol import ServeLimits

    p = sub.add_parser("serve", help="OpenAI-compatible server over the batching engine")
    p.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the zoo's)")
    p.add_argument("--drafter", default="ngram", help="default drafter spec for requests (none: plain)")
    p.add_argument("--drafters", default="",
                   help="comma-separated extra drafter specs requests may choose (e.g. model:zoo/drafter,ngram:2)")
    p.add_argument("--policy", default=EngineConfig.policy, choices=["off", "fixed", "batch-table", "dspark"])
    p.add_argument("--k", type=int, default=EngineConfig.k, help="draft length (fixed) / maximum (other policies)")
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running)
    p.add_argument("--max-queued", type=int, default=EngineConfig.max_queued)
    p.add_argument("--cache-budget-tokens", type=int, default=EngineConfig.cache_budget_tokens,
                   help="the KV pool: cache positions over all running requests (short: the newest is preempted)")
    p.add_argument("--kv-block", type=int, default=EngineConfig.kv_block,
                   help="positions a request's cache grows by")
    p.add_argument("--prefix-cache-mb", type=int, default=EngineConfig.prefix_cache_bytes >> 20,
                   help="MiB of prompt-prefix KV rows kept for reuse across requests (0: off)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--max-tokens-limit", type=int, default=ServeLimits.max_tokens_limit,
                   help="the most new tokens one request may ask for; also a chat request's default "
                        f"(completions default to {ServeLimits.completion_max_tokens})")
    p.add_argument("--body-timeout", type=float, default=ServeLimits.body_timeout_s,
                   help="seconds a request body may take to arrive (then 408)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="required on every route but /health (or $VERISPEC_API_KEY)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES)
    p.add_argument("--threads", type=int, default=None,
                   help="threads per engine (with --replicas: default the CPU count divided among the replicas)")
    p.add_argument("--replicas", type=int, default=0,
                   help="N >= 1: N engine worker processes on loopback behind one endpoint, least-loaded routing, a "
                        "dead worker restarted (0, the default: one engine in this process)")
    p.add_argument("--ray", action="store_true",
                   help="with --replicas: run the replicas as a Ray Serve application (pip install verispec[ray]; "
                        "attaches to $RAY_ADDRESS's cluster, or starts a local one)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from verispec.config import EngineConfig
    from verispec.serve.guard import is_loopback
    from verispec.serve.protocol import ServeLimits
    from verispec.zoo import default_target

    api_key = args.api_key or os.environ.get("VERISPEC_API_KEY") or None
    if not is_loopback(args.host) and not api_key:
        raise VerispecError(f"refusing to listen on {args.host} without --api-key")
    limits = ServeLimits(max_tokens_limit=args.max_tokens_limit, body_timeout_s=args.body_timeout)
    if args.prefix_cache_mb < 0:
        raise VerispecError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.replicas < 0:
        raise VerispecError(f"--replicas must be >= 0, got {args.replicas}")
    if args.ray and not args.replicas:
        raise VerispecError("--ray runs replicas: give --replicas N")
    if args.replicas and not args.ray:
        return _serve_replicas(args, api_key, limits)
    config = EngineConfig(
        max_running=args.max_running, max_queued=args.max_queued, cache_budget_tokens=args.cache_budget_tokens,
        kv_block=args.kv_block,
        policy=args.policy, k=args.k, drafter=None if args.drafter == "none" else args.drafter,
        prefix_cache_bytes=args.prefix_cache_mb << 20,
    )
    target = args.target or default_target()
    if args.ray:
        from verispec.serve.ray_app import RayServeConfig, run

        run(RayServeConfig(target=str(target), engine=config, replicas=args.replicas, dtype=args.dtype,
                           api_key=api_key, model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                           drafters=tuple(_specs(args.drafters)), limits=limits, threads=args.threads),
            args.host, args.port)
        return 0
    from verispec.api import set_threads
    from verispec.serve.server import build_state, serve

    set_threads(args.threads)
    state = build_state(target, config, dtype=args.dtype, api_key=api_key,
                        model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                        drafters=tuple(_specs(args.drafters)), limits=limits)
    serve(state, args.host, args.port, args.log_level)
    return 0


def _serve_replicas(args: argparse.Namespace, api_key: str | None, limits) -> int:
    """The router here, and each replica a `verispec serve` worker process with these engine flags, on loopback."""
    import os
    import sys

    from verispec.serve.replicas import ReplicaConfig
    from verispec.serve.launch import serve_replicas
    from verispec.zoo import default_target

    target = args.target or default_target()
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    worker = [sys.executable, "-m", "verispec", "serve", "--host", "127.0.0.1", "--target", str(target),
              "--drafter", args.drafter, "--drafters", args.drafters, "--policy", args.policy, "--k", str(args.k),
              "--max-running", str(args.max_running), "--max-queued", str(args.max_queued),
              "--cache-budget-tokens", str(args.cache_budget_tokens), "--kv-block", str(args.kv_block),
              "--prefix-cache-mb", str(args.prefix_cache_mb),
              "--max-body-bytes", str(args.max_body_bytes),
              "--max-tokens-limit", str(args.max_tokens_limit), "--body-timeout", str(args.body_timeout),
              "--served-model-name", args.served_model_name or Path(target).name, "--dtype", args.dtype,
              "--threads", str(threads), "--log-level", "warning"]
    serve_replicas(worker, ReplicaConfig(replicas=args.replicas), args.host, args.port, api_key=api_key,
                   max_body_bytes=args.max_body_bytes, limits=limits, log_level=args.log_level)
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the target's step time against tokens verified per step")
    p.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the zoo's)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the profile here")
    p.add_argument("--no-pack", action="store_true",
                   help="plain F.linear matmuls instead of packed weights (to compare; see verispec.model.packing)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from verispec.api import set_threads
    from verispec.profile import cache_path, load_or_measure, plot_profile
    from verispec.model.checkpoint import load_model
    from verispec.zoo import default_target

    set_threads(args.threads)
    target = load_model(args.target or default_target(), dtype=args.dtype, pack=not args.no_pack)
    prof = load_or_measure(target, progress=True, refresh=args.refresh)
    packed = "packed weights" if prof.key.get("packed") else "unpacked weights"
    print(f"profile {cache_path(prof.key)} ({prof.key['dtype']}, {prof.key['threads']} threads, {prof.key['device']}, "
          f"{packed})")
    for b, s in zip(prof.tokens, prof.seconds):
        print(f"  B={b:4d}  {s * 1e3:8.2f} ms/step  {b / s:9.0f} tokens/s if all accepted")
    print(f"  each request beyond the first: +{prof.per_request_s * 1e3:.3f} ms/step")
    if args.plot:
        plot_profile(prof, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit STS temperatures of a dspark drafter's confidence head")
    p.add_argument("drafter", type=Path, help="dspark drafter directory (calibration.json is written there)")
    p.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the zoo's)")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="held-out prompts come from data/tokens/val.bin")
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts to decode")
    p.add_argument("--prompt-len", type=int, default=512,
                   help="tokens per prompt: confidences drift with the context, so fit them on prompts as long as "
                        "the ones they will score (128, as in training, left the zoo's drafter underconfident on "
                        "500-750-token code prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    import numpy as np

    from verispec.api import set_threads
    from verispec.drafters.block import load_block_drafter
    from verispec.drafters.calibration import calibrate
    from verispec.model.checkpoint import load_model
    from verispec.train.data import TokenWindows
    from verispec.zoo import default_target

    set_threads(args.threads)
    target_dir = args.target or default_target()
    target = load_model(target_dir, dtype=args.dtype)
    drafter = load_block_drafter(args.drafter, target)
    if not drafter.model.config.confidence:
        raise VerispecError(f"{args.drafter} has no confidence head to calibrate")
    val = args.data_dir / "tokens" / "val.bin"
    if not val.is_file():
        raise VerispecError(f"no held-out tokens at {val}: run `verispec train target` first (it prepares the data)")
    if not 2 <= args.prompt_len < target.config.context_limit - args.max_tokens:
        raise VerispecError(f"--prompt-len must be in [2, {target.config.context_limit - args.max_tokens}) "
                            f"(the context limit less --max-tokens), got {args.prompt_len}")
    inputs, targets = TokenWindows(val, args.prompt_len - 1, seed=3).batch(0, args.prompts)
    prompts = [row.tolist() + [int(t[-1])] for row, t in zip(inputs, targets)]
    result = calibrate(drafter, prompts, args.drafter, args.max_tokens)
    for j, (b, a, t, n) in enumerate(zip(result.ece_before, result.ece_after, result.temperatures, result.rounds), 1):
        print(f"  position {j}: ECE {b:.4f} -> {a:.4f}  (T {t:.2f}, {n} rounds)")
    print(f"mean ECE {np.nanmean(result.ece_before):.4f} -> {np.nanmean(result.ece_after):.4f}; "
          f"wrote {args.drafter / 'calibration.json'}")
    return 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    from verispec.quant.convert import METHODS, QuantizeConfig
    from verispec.quant.scheme import SCHEMES

    p = sub.add_parser("quantize", help="write a weight-only int8/int4 copy of a checkpoint (compressed-tensors "
                                        "pack-quantized, as vLLM reads it)")
    p.add_argument("src", type=Path, help="dense checkpoint directory, Hugging Face layout")
    p.add_argument("--out", type=Path, required=True, help="directory for the quantized checkpoint")
    p.add_argument("--scheme", default=QuantizeConfig.scheme, choices=SCHEMES)
    p.add_argument("--group-size", type=int, default=QuantizeConfig.group_size,
                   help="32, 64 or 128 input columns per scale (default: 128 for w4a16 and w4a8, per channel for "
                        "w8a16)")
    p.add_argument("--method", default=QuantizeConfig.method, choices=METHODS)
    p.add_argument("--calib-samples", type=int, default=QuantizeConfig.calib_samples,
                   help="gptq: calibration sequences from the training corpus")
    p.add_argument("--calib-len", type=int, default=QuantizeConfig.calib_len, help="gptq: tokens per sequence")
    p.add_argument("--corpus", type=Path, default=None,
                   help="gptq: built corpus directory (its train.jsonl); default: the standard library's train split")
    p.add_argument("--lm-head", nargs="?", const="same", default=None, choices=(*SCHEMES, "same"), metavar="SCHEME",
                   help="quantize the LM head too, in --scheme's grid or the one named (w8a16: int8 per channel), by "
                        "round to nearest; a tied embedding is untied and stays dense")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from verispec.api import set_threads
    from verispec.quant.convert import QuantizeConfig, quantize_checkpoint

    set_threads(args.threads)
    cfg = QuantizeConfig(scheme=args.scheme, group_size=args.group_size, method=args.method,
                         calib_samples=args.calib_samples, calib_len=args.calib_len,
                         lm_head=args.scheme if args.lm_head == "same" else args.lm_head)
    summary = quantize_checkpoint(args.src, args.out, cfg, corpus=args.corpus)
    print(f"wrote {args.out}: {summary['scheme']} by {cfg.method}"
          + (f" (calibration: {summary['calibration']})" if "calibration" in summary else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="verb", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_train(sub)
    _add_serve(sub)
    _add_profile(sub)
    _add_calibrate(sub)
    _add_quantize(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VerispecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
