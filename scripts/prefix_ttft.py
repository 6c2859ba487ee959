"""TTFT with and without the prefix cache: requests that share a long prompt prefix (a document asked several
questions), one at a time through the engine, bf16 zoo target.

    python scripts/prefix_ttft.py --prefix-tokens 1000 --requests 16
"""

from __future__ import annotations

import argparse
import statistics

import torch

from verispec.bench.prompts import load_task
from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.zoo import default_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = default_target()
    target, tok = load_model(target_dir, dtype="bf16"), Tokenizer.from_dir(target_dir)
    doc = tok.encode(load_task("long_context")[8]["prompt"])[: args.prefix_tokens]
    tails = [tok.encode(r["prompt"][-200:]) for r in load_task("code_completion")][: args.requests]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engines = {"off": Engine(target, None, EngineConfig(drafter=None, prefix_cache_bytes=0)),
               "on": Engine(target, None, EngineConfig(drafter=None))}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    outs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for i, tail in enumerate(tails):  # interleaved; the first request of "on" fills its cache
        for name, engine in engines.items():
            engine.add_request(doc + tail, params, RequestSpec(), request_id=str(i))
            res = engine.run_until_done()[str(i)]
            ttft[name].append(res.stats.ttft_s)
            outs[name].append(res.token_ids)
    on = engines["on"].prefix
    print(f"prompts: {len(doc)}-token shared prefix + {min(map(len, tails))}-{max(map(len, tails))}-token tails, "
          f"{len(tails)} requests one at a time")
    for name in engines:
        print(f"prefix cache {name:3s}: TTFT median {1e3 * statistics.median(ttft[name][1:]):.1f} ms "
              f"(first request {1e3 * ttft[name][0]:.1f} ms)")
    print(f"hit rate {on.hit_tokens / max(on.queried_tokens, 1):.2f}; outputs equal: {outs['on'] == outs['off']}")


if __name__ == "__main__":
    main()
