"""One round of verification, shared by the reference loop (`decode.py`) and the engine: check a drafter's
proposal, then verify it against the target's logits with the request's rule (verify.py's pure functions).

The reference loop verifies one request per round (`verify_round`); the engine verifies every request of a step
(`verify_batch`), greedy ones in one batched call and sampled ones each with its own generator, so each request
draws what it would draw alone and the engine's output equals the reference loop's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.cache import KVCache
from verispec.config import SamplingParams
from verispec.drafters.base import Draft, Drafter
from verispec.verify import VerifyOutput, greedy_verify, verify_chain


def lend_cache(drafter: Drafter, seq_id: int, cache: KVCache) -> None:
    """Lend the target's cache for a sequence to a drafter that reads it (self-speculation), once, before the
    prefill; the caller keeps owning it."""
    if drafter.capabilities.reads_target_kv:
        drafter.attach_cache(seq_id, cache)


def check_draft(draft: Draft, budget: int, vocab_size: int, drafter: Drafter) -> None:
    """Raise ValueError for a proposal longer than its budget, with a token outside the vocabulary, or shaped as a
    tree: this round verifies chains (verify.greedy_tree_verify is the pure rule a tree round will use)."""
    if not draft.is_chain:
        declared = "" if drafter.capabilities.trees else " without declaring trees in its capabilities"
        raise ValueError(f"drafter {type(drafter).__name__} proposed a tree draft (parents {draft.parents}){declared}; "
                         f"decode and the engine verify chain drafts only")
    if len(draft.tokens) > budget or any(not 0 <= t < vocab_size for t in draft.tokens):
        raise ValueError(
            f"drafter {type(drafter).__name__} proposed {draft.tokens} for a budget of {budget} tokens "
            f"in a vocabulary of {vocab_size}"
        )


def verify_round(
    logits: torch.Tensor,  # [k+1, V] the target's logits at the anchor and each draft token
    draft: Draft,  # k tokens, with their q rows where sampled
    params: SamplingParams,
    rule: str,  # SpecConfig.verify: "rejection" or "sample-match" (greedy requests verify greedily either way)
    generator: torch.Generator | None,  # the request's RNG (None when greedy)
) -> VerifyOutput:
    """Verify one request's chain draft (verify.verify_chain); an empty draft is a plain decoding step."""
    if not draft.is_chain:
        raise ValueError("verify_round verifies chain drafts only; this draft is a tree")
    return verify_chain(logits, draft.tokens, draft.probs, params, rule, generator)


def verify_batch(
    logits: torch.Tensor,  # [sum(k_b + 1), V] each request's rows (anchor, drafts) back to back, in order
    drafts: Sequence[Draft],  # [B]
    params: Sequence[SamplingParams],  # [B]
    rules: Sequence[str],  # [B] SpecConfig.verify per request
    generators: Sequence[torch.Generator | None],  # [B]
) -> list[list[int]]:
    """Committed tokens per request: greedy requests in one batched call, sampled ones each with its own RNG
    (`verify_round`)."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d.tokens) + 1
    out: list[list[int] | None] = [None] * len(drafts)
    batch = [i for i, p in enumerate(params) if p.greedy]
    if batch:
        rows = torch.cat([torch.arange(starts[i], starts[i] + len(drafts[i].tokens) + 1) for i in batch])
        res = greedy_verify(
            torch.tensor([t for i in batch for t in drafts[i].tokens], dtype=torch.long, device=logits.device),
            torch.tensor([len(drafts[i].tokens) for i in batch], device=logits.device),
            logits[rows.to(logits.device)],
        )
        for i, block in zip(batch, res.rows()):
            out[i] = block
    for i, d in enumerate(drafts):
        if out[i] is None:
            k = len(d.tokens)
            res = verify_round(logits[starts[i] : starts[i] + k + 1], d, params[i], rules[i], generators[i])
            out[i] = res.rows()[0]
    return out  # type: ignore[return-value]
