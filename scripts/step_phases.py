"""Where one target forward's time goes, phase by phase, in process: builds the native kernels with decoder.c's
phase timers (-DVS_PHASES; the package's own build has none), then times forwards of R rows after C cached positions
and splits their wall time into the layer matmuls, attention, the LM head, SiLU, the norms and residual adds, the
rest of decoder.c (checks, embedding, rounding, RoPE, the cache write) and the Python around the native call.

    python scripts/step_phases.py --target w4a8-head --contexts 100,1000,1800 --rows 1,5,9

--target: a name of quant_report.py's copies (bf16 is zoo/target; the others are made under .cache/quant if missing).
"""
from __future__ import annotations

import argparse
import ctypes
import time

import quant_report as qr  # scripts/ is on sys.path when this script runs
import torch

from verispec.api import LLM
from verispec.cache import KVCache
from verispec.kernels import native

PHASES = ("layer matmuls", "attention", "LM head", "SiLU", "norms + residuals", "other C")  # decoder.c's order


def phase_library(isa: str) -> ctypes.CDLL:
    lib = native._declare(native.build_library(f"{isa}-phases", native.SOURCES,
                                               (*native.FLAGS, *native._ISA_FLAGS[isa], "-DVS_PHASES")))
    lib.vs_phase_times.restype = ctypes.POINTER(ctypes.c_double * (len(PHASES) + 1))
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="w4a8-head", choices=sorted(qr.COPIES))
    ap.add_argument("--contexts", default="100,1000,1800", help="cached positions before each timed forward")
    ap.add_argument("--rows", default="1,5,9", help="rows per timed forward")
    ap.add_argument("--repeats", type=int, default=500)
    args = ap.parse_args()
    target = LLM(qr.copy_dir(args.target)).target
    if native.library() is None:
        raise SystemExit("error: no native kernels on this machine")
    native.qavailable()  # an int target's qgemm library, built before the timing
    lib = phase_library(native.isa())
    native._state["lib"] = lib
    times = lib.vs_phase_times().contents
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    longest = max(contexts) + max(rows)
    if longest > target.config.context_limit:
        raise SystemExit(f"error: {longest} positions exceed the target's {target.config.context_limit}")
    ids = torch.randint(3, target.config.vocab_size, (1, longest), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(target, max_len=longest)
    print(f"{args.target}, kernels {native.isa()}, {torch.get_num_threads()} threads; ms per forward (share of its "
          f"wall time), mean of {args.repeats} after {args.repeats // 10} untimed")
    print(f"{'forward':>16} {'wall':>7} " + " ".join(f"{p:>17}" for p in (*PHASES, "Python")))
    with torch.inference_mode():
        for ctx in contexts:
            cache.truncate(0)
            target(ids[:, :ctx], cache=cache, num_logits=0)
            for r in rows:
                for i in range(args.repeats // 10 + 1):
                    cache.truncate(ctx)
                    target(ids[:, ctx:ctx + r], cache=cache)
                for i in range(len(PHASES) + 1):
                    times[i] = 0.0
                wall = 0.0
                for _ in range(args.repeats):
                    cache.truncate(ctx)
                    t0 = time.perf_counter()
                    target(ids[:, ctx:ctx + r], cache=cache)
                    wall += time.perf_counter() - t0
                ms = [1e3 * times[i] / args.repeats for i in range(len(PHASES) + 1)]
                wall_ms = 1e3 * wall / args.repeats
                cols = [*ms[:len(PHASES)], wall_ms - ms[-1]]  # the Python: wall time outside decoder.c's call
                print(f"{f'{r} rows at {ctx}':>16} {wall_ms:7.3f} " + " ".join(
                    f"{c:8.3f} ({100 * c / wall_ms:4.1f}%)" for c in cols), flush=True)


if __name__ == "__main__":
    main()
