"""Where a speculative round's time goes, piece by piece: a block drafter's propose (block forward, LM head, head
loop), its context append (alone, and fused with the next propose as a round runs it), and the target's verify
and plain steps. Medians of repeated calls on one held-out code prompt; the bench's `ms/round (draft)` column is
the same split measured inside whole generations.

    python scripts/round_cost.py [--drafter dspark:zoo/dspark] [--dtype fp32] [--context 450] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from verispec.api import LLM, set_threads
from verispec.cache import KVCache
from verispec.drafters.base import DraftRequest, Verified
from verispec.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parent.parent / "src/verispec/bench/prompts/code_completion.jsonl"


def median_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="dspark:zoo/dspark")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--context", type=int, default=450, help="prompt tokens before the anchor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    set_threads(args.threads)
    llm = LLM("zoo/target", args.drafter, k=8, dtype=args.dtype)
    drafter, target, model = llm.drafter, llm.target, llm.drafter.model
    ids = llm.encode(json.loads(PROMPTS.read_text().splitlines()[0])["prompt"])[-args.context :]
    width, g = len(ids) - 1, model.config.block_size
    with torch.inference_mode():
        cache = KVCache.for_model(target, max_len=len(ids) + g + 1)
        layers = drafter.capabilities.hidden_layers
        _, hidden = target(torch.tensor([ids[:-1]]), cache=cache, num_logits=0, hidden_layers=layers)
        drafter.start(0, ids)
        drafter.observe(0, 0, {k: v[0] for k, v in hidden.items()})
        ctx_cache = drafter._context(0)
        request = [DraftRequest(0, ids, g, SamplingParams(), None)]
        after = [DraftRequest(0, ids + ids[-5:], g, SamplingParams(), None)]  # the anchor five positions later
        anchor, anchor_pos = torch.tensor([ids[-1]]), torch.tensor([width])

        def block():  # as propose runs it for one request: over its context cache, no mask
            return model.block_hidden(target.model.embed_tokens, anchor, anchor_pos, ctx_cache)

        h = block()
        drafter.propose(request)  # the observed rows reach the context cache at the first proposal: read it after
        seen, first = ctx_cache.length, drafter._ctx_start[0]  # the drafter's window of the context
        rows = {k: v[0, :5] for k, v in hidden.items()}  # an anchor and four accepted drafts

        def append():  # on its own, as observe and batched proposals do
            model.append_context(ctx_cache, model.context_features(rows)[None], first + seen, first)
            ctx_cache.truncate(seen)

        def propose_after_accept():  # a round's drafter work: the accepted rows go through propose's forward
            drafter.accept(Verified(0, 4, [], rows))
            drafter.propose(after)
            ctx_cache.truncate(seen)

        def step(tokens):
            target(tokens, cache=cache, hidden_layers=layers)
            cache.truncate(width)

        verify, plain = torch.tensor([ids[-1:] + [ids[-1]] * g]), torch.tensor([ids[-1:]])
        n = args.repeats
        propose = median_ms(lambda: drafter.propose(request), n)
        head = median_ms(lambda: drafter._block_logits(h.to(target.dtype)), n)  # the draft vocabulary's rows
        parts = {"block forward": median_ms(block, n), "LM head": head}
        vocab = "all" if drafter.draft_vocab is None else drafter.draft_vocab.numel()
        print(f"{args.drafter}, {args.dtype}, {args.threads} threads, {width}-token context ({seen} in the drafter's "
              f"window), matmuls={target.matmuls}, draft vocabulary {vocab} tokens")
        print(f"  propose ({g} drafts)        {propose:7.2f} ms")
        for name, ms in parts.items():
            print(f"    {name:24s}{ms:7.2f} ms")
        print(f"    {'head loop (the rest)':24s}{propose - sum(parts.values()):7.2f} ms")
        print(f"  context append (5 rows)     {median_ms(append, n):7.2f} ms")
        print(f"  accept 5 rows + propose     {median_ms(propose_after_accept, n):7.2f} ms")
        print(f"  target verify ({g + 1} rows)     {median_ms(lambda: step(verify), n):7.2f} ms")
        print(f"  target plain step (1 row)   {median_ms(lambda: step(plain), n):7.2f} ms")


if __name__ == "__main__":
    main()
