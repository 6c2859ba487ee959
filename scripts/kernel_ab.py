"""In-process A/B of the native kernels against another git revision's: builds REV's kernel libraries (gemm.c,
attention.c, decoder.c, ... and qgemm.c's, which an int8/int4 target's matmuls call) beside the working tree's, then
times one target's forwards with each, the active libraries swapped call by call (interleaved, order reversed every
other repeat, medians), and says whether their outputs are bit-identical. Whole runs on a shared host drift by more
than most kernel changes; calls side by side in one process do not.
    python scripts/kernel_ab.py --base HEAD~1 --target bf16 --contexts 150,1000,1800 --rows 1,9 --prefill 1000
--target: a name of quant_report.py's copies (bf16 is zoo/target; the others are made under .cache/quant if missing).
--generate ARMS (e.g. plain,ngram@dspark) adds end-to-end cases: each arm's greedy generations over a bucket's
prompts (quant_report.py's; --gen-bucket, short by default), prefill included, each kernel build with its own LLM
(its own acceptance estimate), outputs compared token for token.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import quant_report as qr  # scripts/ is on sys.path when this script runs
import torch

from verispec.api import LLM
from verispec.cache import KVCache
from verispec.kernels import native
from verispec.sampling import SamplingParams


def base_library(rev: str, isa: str):
    """REV's kernel sources and headers, built for `isa` (cached by content like the working tree's): the main
    library and qgemm.c's."""
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        src = Path(tmp)
        for path in (*native.SOURCES, *native.QSOURCES, *native.HEADERS):
            rel = path.relative_to(qr.ROOT)
            text = subprocess.run(["git", "-C", str(qr.ROOT), "show", f"{rev}:{rel}"], check=True,
                                  capture_output=True).stdout
            (src / path.name).write_bytes(text)
        flags = (*native.FLAGS, *native._ISA_FLAGS[isa])
        main = native._declare(native.build_library(f"{isa}-base", tuple(src / p.name for p in native.SOURCES), flags))
        qlib = native.build_library(f"q{isa}-base", tuple(src / p.name for p in native.QSOURCES), flags)
        return main, qlib


def activate(libs: tuple) -> None:
    """Make (main library, qgemm library) the active kernels: decoder.c reads qgemm's vs_qlinear by address."""
    isa = native.isa()
    native._state["lib"], native._qlibs[isa] = libs
    native._qaddrs[isa] = ctypes.cast(libs[1].vs_qlinear, ctypes.c_void_p).value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree's kernels with")
    ap.add_argument("--target", default="bf16", choices=sorted(qr.COPIES))
    ap.add_argument("--contexts", default="150,1000,1800", help="cached positions before each timed step")
    ap.add_argument("--rows", default="1,9", help="rows a timed step verifies")
    ap.add_argument("--prefill", type=int, default=1000, help="tokens of a timed prefill (0: none)")
    ap.add_argument("--repeats", type=int, default=150)
    ap.add_argument("--generate", default="", help="drafter arms timed end to end (plain, ngram@dspark, ...)")
    ap.add_argument("--gen-bucket", default="short", choices=sorted(qr.BUCKETS), help="quant_report.py's bucket "
                    "whose prompts the generate cases run (short: 64-token prompts; long: ~1,800)")
    ap.add_argument("--gen-prompts", type=int, default=8, help="prompts per generate case")
    ap.add_argument("--gen-tokens", type=int, default=0, help="new tokens per generation (0: the bucket's)")
    args = ap.parse_args()
    tdir = qr.copy_dir(args.target)
    plain = LLM(tdir)
    target = plain.target
    if native.library() is None:
        raise SystemExit("error: no native kernels on this machine")
    native.qavailable()  # the working tree's qgemm library declared before REV's is built beside it
    libs = {"base": base_library(args.base, native.isa()), "tree": (native.library(), native._qlibrary())}
    for name in ("restype", "argtypes"):  # native.qlinear's ctypes signature (the LM head may call it from Python)
        setattr(libs["base"][1].vs_qlinear, name, getattr(libs["tree"][1].vs_qlinear, name))
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    longest = max([*contexts, args.prefill]) + max(rows)
    if longest > target.config.context_limit:
        raise SystemExit(f"error: {longest} positions exceed the target's {target.config.context_limit}")
    ids = torch.randint(3, target.config.vocab_size, (1, longest), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(target, max_len=longest)

    def prefill(n: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            cache.truncate(0)
            return target(ids[:, :n], cache=cache, num_logits=1)[0]
        return run

    def step(ctx: int, r: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            cache.truncate(ctx)
            return target(ids[:, ctx:ctx + r], cache=cache)[0]
        return run

    cases = {}
    if args.prefill:  # a prefill costs ~100 steps: fewer repeats
        cases[f"prefill {args.prefill}"] = (None, prefill(args.prefill), max(args.repeats // 12, 3))
    cases.update({f"{r} rows at {c}": (c, step(c, r), args.repeats) for c in contexts for r in rows})
    if args.generate:
        gen_tokens = args.gen_tokens or qr.BUCKETS[args.gen_bucket]
        prompts, _ = qr.bucket_prompts(args.gen_bucket, plain.tokenizer, args.gen_prompts, gen_tokens, 64)
        params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
        for arm in args.generate.split(","):
            spec = qr.base(arm)
            llms = {k: plain if spec == "plain" else LLM(target, drafter=spec, k=8, policy="dspark" if arm.endswith(
                qr.DSPARK) else "fixed") for k in libs}

            def gen(llms=llms) -> torch.Tensor:  # the active build's LLM (its own estimator)
                llm = llms["tree" if native._state["lib"] is libs["tree"][0] else "base"]
                return torch.tensor([t for r in llm.generate(prompts, params) for t in r.token_ids])
            cases[f"generate {arm}"] = (None, gen, max(args.repeats // 30, 3))
    print(f"{args.target}, kernels {native.isa()}, {torch.get_num_threads()} threads, base {args.base}")
    with torch.inference_mode():
        for name, (ctx, run, reps) in cases.items():
            if ctx is not None:  # the cache filled once, by the working tree's kernels, for both arms
                activate(libs["tree"])
                cache.truncate(0)
                target(ids[:, :ctx], cache=cache, num_logits=0)
            seconds: dict[str, list[float]] = {k: [] for k in libs}
            out = {}
            for i in range(reps):
                for k in (list(libs) if i % 2 == 0 else list(libs)[::-1]):
                    activate(libs[k])
                    t0 = time.perf_counter()
                    out[k] = run()
                    seconds[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
            print(f"  {name}: base {med['base']:.3f} ms, working tree {med['tree']:.3f} ms, "
                  f"{med['tree'] / med['base']:.3f}x the time; outputs "
                  f"{'bit-identical' if torch.equal(out['base'], out['tree']) else 'DIFFER'}", flush=True)
    activate(libs["tree"])


if __name__ == "__main__":
    main()
