"""In-process A/B of the Python fast paths around a native decode step: the same target with the named fast paths
turned off (the code before them) and on, arms interleaved, order flipped every repeat, medians, outputs compared.
  binding     model.fused.FusedForward.binding: a KV cache described to decoder.c once, not on every forward
  feature_binding  the same for a feature drafter's steps (FusedFeature.binding: EAGLE, MTP)
  argmax_ids  verify.greedy_ids: a greedy verify's winners read from the kernel as ints, no output tensor
  block_args  model.block._BlockLayer.native_args: a block drafter layer's kernel arguments (norms, packs,
              descriptors) checked and described once, not on every proposal

The Python around a native forward is ~45 us warm, but runs at 3-5x that right after a forward's kernels have
streamed the weights through the caches; what a decode step pays for it is only seen in situ, so both cases time
real loops: one-token decode steps through `target(...)` (prefill of 64, then 128 steps, greedy), and whole greedy
generations of the short bucket's prompts (quant_report.py's: 8 x 128 tokens, prefill included) per arm.

    python scripts/fastpath_ab.py --target w4a8-head --off binding,argmax_ids --generate plain,ngram@dspark

--target: a name of quant_report.py's copies (bf16 is zoo/target; the others are made under .cache/quant if missing).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import quant_report as qr  # scripts/ is on sys.path when this script runs
import torch

from verispec import verify
from verispec.api import LLM
from verispec.cache import KVCache
from verispec.model.block import _BlockLayer
from verispec.model.fused import FusedFeature, FusedForward
from verispec.sampling import SamplingParams, greedy

# each fast path: (owner, attribute, what it is with the path off)
FAST_PATHS = {
    "binding": (FusedForward, "binding", lambda self, cache: None),
    "feature_binding": (FusedFeature, "binding", lambda self, cache: None),
    "argmax_ids": (verify, "greedy_ids", lambda logits: greedy(logits).tolist()),
    # off: the arguments made afresh on every call, as before they were kept
    "block_args": (_BlockLayer, "native_args", lambda self, x: (setattr(self, "_args", None),
                                                                 ORIGINAL["block_args"](self, x))[1]),
}
ORIGINAL = {name: getattr(owner, attr) for name, (owner, attr, _) in FAST_PATHS.items()}


def switch(names: list[str], on: bool) -> None:
    for name in names:
        owner, attr, off = FAST_PATHS[name]
        setattr(owner, attr, ORIGINAL[name] if on else off)


def compare(name: str, run: Callable[[], list[int]], repeats: int, paths: list[str]) -> None:
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    out = {}
    for i in range(repeats):
        for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
            switch(paths, arm == "on")
            t0 = time.perf_counter()
            out[arm] = run()
            seconds[arm].append(time.perf_counter() - t0)
    switch(paths, True)
    off, on = (statistics.median(seconds[a]) * 1e3 for a in ("off", "on"))
    print(f"  {name}: off {off:.2f} ms, on {on:.2f} ms, {on / off:.3f}x the time; outputs "
          f"{'equal' if out['on'] == out['off'] else 'DIFFER'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="w4a8-head", choices=sorted(qr.COPIES))
    ap.add_argument("--off", default="binding", help=f"fast paths the off arm lacks, of {sorted(FAST_PATHS)}")
    ap.add_argument("--generate", default="plain", help="arms of whole generations (plain, ngram@dspark, ...)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    paths = args.off.split(",")
    if unknown := set(paths) - set(FAST_PATHS):
        raise SystemExit(f"error: unknown fast paths {sorted(unknown)}; known: {sorted(FAST_PATHS)}")
    plain = LLM(qr.copy_dir(args.target))
    target = plain.target
    if target.fused is None:
        raise SystemExit("error: this target has no native forward here")
    prompts, _ = qr.bucket_prompts("short", plain.tokenizer, 8, 128, 64)
    cache = KVCache.for_model(target, max_len=64 + 128)

    def steps() -> list[int]:  # 128 one-token greedy steps after a 64-token prefill
        cache.truncate(0)
        target(torch.tensor([prompts[0][:-1]]), cache=cache, num_logits=0)
        token, out = prompts[0][-1], []
        for _ in range(128):
            logits, _ = target(torch.tensor([[token]]), cache=cache)
            token = int(logits[0, -1].argmax())
            out.append(token)
        return out

    print(f"{args.target}, {torch.get_num_threads()} threads, {args.repeats} repeats, off: {args.off}; medians")
    with torch.inference_mode():
        compare("128 decode steps", steps, args.repeats, paths)
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        for arm in args.generate.split(","):
            spec = qr.base(arm)
            llm = plain if spec == "plain" else LLM(target, drafter=spec, k=8,
                                                    policy="dspark" if arm.endswith(qr.DSPARK) else "fixed")
            compare(f"generate {arm}", lambda llm=llm: [t for r in llm.generate(prompts, params) for t in r.token_ids],
                    args.repeats, paths)


if __name__ == "__main__":
    main()
