"""Rebuild the long-context prompt set, src/verispec/bench/prompts/long_context.jsonl (bench/prompts.py's
build_long_context): windows of the stdlib's bench-split code files sized to ~1,000 / ~1,500 / ~1,900 tokens of
the zoo target's tokenizer, 8 per length. Needs only the stdlib sources and zoo/target/tokenizer.json.

    python scripts/build_long_prompts.py [--lengths 1000,1500,1900] [--per-length 8] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verispec.bench.prompts import LONG_LENGTHS, PROMPT_DIR, build_long_context
from verispec.model.tokenizer import Tokenizer
from verispec.zoo import default_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=",".join(map(str, LONG_LENGTHS)), help="comma-separated token lengths")
    p.add_argument("--per-length", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=Path, default=None, help="checkpoint whose tokenizer counts (default: the zoo's)")
    p.add_argument("--out", type=Path, default=PROMPT_DIR / "long_context.jsonl")
    args = p.parse_args()
    tokenizer = Tokenizer.from_dir(args.target or default_target())
    lengths = tuple(int(x) for x in args.lengths.split(","))
    counts = build_long_context(args.out, lengths, args.per_length, args.seed, tokenizer)
    for length, ns in counts.items():
        print(f"{length}: {len(ns)} prompts, {min(ns)}-{max(ns)} tokens")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
