"""One round of verification, shared by the reference loop (`decode.py`) and the engine: check a drafter's
proposal, shape the target's forward over it (a tree's positions and attention mask), verify it against the
target's logits with the request's rule (verify.py's pure functions), and keep the accepted rows of the cache.

A draft is a chain or a tree (`Draft.is_chain`); both commit an accepted path plus one token (`Verdict`). A chain
rolls the cache back by truncation, a tree keeps its accepted path's rows (`KVCache.compact`).

The reference loop verifies one request per round (`verify_round`); the engine verifies every request of a step
(`verify_batch`): greedy chains in one batched call, sampled trees in one per kind of q, sampled chains and greedy
trees one by one; each request draws from its own generator what it would draw alone, so the engine's output
equals the reference loop's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.cache import KVCache, tree_mask, tree_positions
from verispec.config import SamplingParams
from verispec.drafters.base import Draft, Drafter
from verispec.sampling import probs_for
from verispec.verify import greedy_commit_rows, rejection_tree_verify, verify_chain, verify_tree


@dataclass(frozen=True)
class Verdict:
    """What verification decided for one request's draft in one round."""

    tokens: list[int]  # committed: the accepted path's tokens, then the recovered or bonus token
    path: tuple[int, ...]  # the accepted nodes, root to leaf (a chain's: 0..a-1)

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def lend_cache(drafter: Drafter, seq_id: int, cache: KVCache) -> None:
    """Lend the target's cache for a sequence to a drafter that reads it (self-speculation), once, before the
    prefill; the caller keeps owning it."""
    if drafter.capabilities.reads_target_kv:
        drafter.attach_cache(seq_id, cache)


def check_draft(draft: Draft, budget: int, vocab_size: int, drafter: Drafter) -> None:
    """Raise ValueError for a proposal with more nodes than its budget, with a token outside the vocabulary, or
    shaped as a tree by a drafter whose capabilities do not declare trees."""
    if not draft.is_chain and not (drafter.capabilities.trees or drafter.capabilities.tree_requests):
        raise ValueError(f"drafter {type(drafter).__name__} proposed a tree draft (parents {draft.parents}) without "
                         f"declaring trees in its capabilities (Capabilities.trees)")
    if len(draft.tokens) > budget or any(not 0 <= t < vocab_size for t in draft.tokens):
        raise ValueError(
            f"drafter {type(drafter).__name__} proposed {draft.tokens} for a budget of {budget} tokens "
            f"in a vocabulary of {vocab_size}"
        )


def tree_inputs(
    draft: Draft, cache: KVCache, pending: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (positions [P + N], mask [P + N, cache.length + P + N]) or None
    """The positions and attention mask of a forward that feeds `pending` committed tokens (the last one the
    anchor) and then a tree draft after `cache`'s rows: the committed rows are causal, each node sees the cache,
    those rows, its ancestors and itself, one position past its parent. None for a chain (the causal forward)."""
    if draft.is_chain:
        return None
    start, first = cache.length, cache.next_position  # rows before the forward; the first new token's position
    parents = list(draft.parents)
    mask = tree_mask(start + pending - 1, parents, device)  # [N + 1, start + P + N]: the anchor and the nodes
    positions = tree_positions(first + pending - 1, parents, device)
    if pending > 1:
        cols = torch.arange(mask.shape[1], device=device)[None]
        head = cols <= torch.arange(start, start + pending - 1, device=device)[:, None]  # [P - 1, start + P + N]
        mask = torch.cat([head, mask])
        positions = torch.cat([torch.arange(first, first + pending - 1, device=device), positions])
    return positions, mask


def keep_accepted(cache: KVCache, draft: Draft, verdict: Verdict, num_committed: int) -> None:
    """After a round's forward, roll `cache` back to the committed tokens but the new anchor: a chain truncates,
    a tree keeps its accepted path's rows, moved to follow the anchor (KVCache.compact). `num_committed`: the
    committed tokens before the round (the forward fed those the cache lacked, the anchor last, then the draft)."""
    if draft.is_chain:
        cache.truncate(num_committed + verdict.num_accepted)
        return
    pending = num_committed - cache.round_start  # rows this forward fed up to and including the anchor
    cache.compact([*range(pending), *(pending + i for i in verdict.path)])


def accepted_rows(verdict: Verdict) -> list[int]:
    """The rows of a round's forward (0 the anchor, i + 1 draft node i) on the path it committed, chain or tree:
    the anchor and the accepted nodes, in order."""
    return [0, *(i + 1 for i in verdict.path)]


def path_rows(
    hidden: dict[int, torch.Tensor], draft: Draft, verdict: Verdict  # {layer: [k+1, d]} the round's rows
) -> dict[int, torch.Tensor]:  # {layer: [k+1, d]} for a chain, [a+1, d] for a tree
    """The target hidden states a drafter hears about after a round: a chain's every verified row (as ever), a
    tree's anchor and accepted path, which is the chain the round committed."""
    if draft.is_chain or not hidden:
        return hidden
    rows = accepted_rows(verdict)
    return {layer: h[rows] for layer, h in hidden.items()}


def verify_round(
    logits: torch.Tensor,  # [k+1, V] the target's logits at the anchor and each draft node
    draft: Draft,  # k nodes, with their q rows where sampled
    params: SamplingParams,
    rule: str,  # SpecConfig.verify: "rejection" or "sample-match" (greedy requests verify greedily either way)
    generator: torch.Generator | None,  # the request's RNG (None when greedy)
) -> Verdict:
    """Verify one request's draft: a chain with its rule (verify.verify_chain; an empty draft is a plain decoding
    step), a tree greedily or by recursive rejection sampling (verify.verify_tree)."""
    if draft.is_chain and params.greedy:  # verify_chain's greedy rule on host lists: no tensors to build and read back
        row = greedy_commit_rows([draft.tokens], logits)[0]
        return Verdict(row, tuple(range(len(row) - 1)))
    if draft.is_chain:
        out = verify_chain(logits, draft.tokens, draft.probs, params, rule, generator)
        return Verdict(out.rows()[0], tuple(range(int(out.num_accepted[0]))))
    out, path = verify_tree(logits, draft.tokens, draft.parents, draft.probs, params, generator)
    return Verdict(out.rows()[0], tuple(path))


def verify_batch(
    logits: torch.Tensor,  # [sum(k_b + 1), V] each request's rows (anchor, drafts) back to back, in order
    drafts: Sequence[Draft],  # [B]
    params: Sequence[SamplingParams],  # [B]
    rules: Sequence[str],  # [B] SpecConfig.verify per request
    generators: Sequence[torch.Generator | None],  # [B]
) -> list[Verdict]:
    """Verdicts per request: greedy chains in one batched call, sampled trees in one call per kind of q (soft or
    point masses), sampled chains and greedy trees one by one (`verify_round`); each with its own RNG."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d.tokens) + 1
    out: list[Verdict | None] = [None] * len(drafts)
    batch = [i for i, p in enumerate(params) if p.greedy and drafts[i].is_chain]
    if batch:
        rows = logits  # every request greedy with a chain, and no other rows: all the rows, in order
        if len(batch) < len(drafts) or logits.shape[0] != row:
            index = torch.cat([torch.arange(starts[i], starts[i] + len(drafts[i].tokens) + 1) for i in batch])
            rows = logits[index.to(logits.device)]
        for i, block in zip(batch, greedy_commit_rows([drafts[i].tokens for i in batch], rows)):
            out[i] = Verdict(block, tuple(range(len(block) - 1)))
    trees = [i for i, p in enumerate(params) if not p.greedy and not drafts[i].is_chain]
    for soft in (False, True):
        group = [i for i in trees if (drafts[i].probs is not None) == soft]
        if group:
            for i, verdict in zip(group, _sample_trees(logits, starts, drafts, params, generators, group)):
                out[i] = verdict
    for i, d in enumerate(drafts):
        if out[i] is None:
            k = len(d.tokens)
            out[i] = verify_round(logits[starts[i] : starts[i] + k + 1], d, params[i], rules[i], generators[i])
    return out  # type: ignore[return-value]


def _sample_trees(
    logits: torch.Tensor,  # [sum(k_b + 1), V] as verify_batch's
    starts: list[int], drafts: Sequence[Draft], params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None], group: list[int],  # requests whose trees all have q, or none
) -> list[Verdict]:
    """The sampled tree drafts of `group` in one call of verify.rejection_tree_verify (each tree draws from its
    own generator exactly what it draws alone)."""
    device = logits.device
    p = torch.cat([probs_for(logits[starts[i] : starts[i] + len(drafts[i].tokens) + 1], params[i]) for i in group])
    q = None if drafts[group[0]].probs is None else torch.cat([drafts[i].probs for i in group])  # [N, V]
    res, paths = rejection_tree_verify(
        torch.tensor([t for i in group for t in drafts[i].tokens], dtype=torch.long, device=device),
        torch.tensor([x for i in group for x in drafts[i].parents], dtype=torch.long, device=device),
        torch.tensor([len(drafts[i].tokens) for i in group], device=device), p, q, [generators[i] for i in group])
    return [Verdict(row, tuple(path[: len(row) - 1])) for row, path in zip(res.rows(), paths.tolist())]
