"""Tree verification (verispec.verify): canned-logit unit tests of the greedy and sampling rules over trees, and the
statistical losslessness of recursive rejection sampling over siblings, with negative controls that must fail.

The statistical tests follow test_verify_stats.py: a synthetic order-1 Markov target P and draft Q over V=8 tokens,
N sequences decoded speculatively with a draft tree per round, every adjacent pair of generated positions checked
against the exact joint of P (TV + chi-square, _markov.pairwise_failures). Trees are drawn two ways: SpecInfer's
(every node sampled from Q given its path, with its q row) and EAGLE-2's (each parent's children are Q's top tokens
in order, point masses).
"""

from __future__ import annotations

import pytest
import torch
from _markov import markov_logits, pairwise_failures, processed
from test_verify_stats import _one_thread  # noqa: F401  (autouse: one intra-op thread for these small ops)

from verispec import verify
from verispec.config import SamplingParams
from verispec.verify import (
    PLACEHOLDER_TOKEN_ID, greedy_tree_verify, rejection_tree_verify, verify_tree,
)

PAD = PLACEHOLDER_TOKEN_ID
VOCAB = 8
N = 30_000  # sequences per simulation, as in test_verify_stats.py
SEED = 4321

# Tree shapes (parents, topological): siblings at the anchor, siblings below it, a deep branch after a shallow one.
SHAPES = {
    "wide": (-1, -1, -1),
    "branchy": (-1, -1, 0, 0, 1),
    "deep-second": (-1, -1, 1, 2, 1),
}


def _peaked(ids: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.full((len(ids), vocab), -100.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 100.0
    return logits


# ------------------------------------------------------------------------------------------------------------
# Canned logits


def test_greedy_tree_verify_takes_the_deepest_accepted_path():
    # argmax: anchor 5; node 0 (7) rejected; node 1 (5) accepted, argmax after it 9; node 2 (9) accepted, then 4
    out, path = greedy_tree_verify(torch.tensor([7, 5, 9]), torch.tensor([-1, -1, 1]), _peaked([5, 3, 9, 4]))
    assert path.tolist() == [1, 2] and out.rows() == [[5, 9, 4]] and int(out.num_accepted[0]) == 2


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_tree_verify_with_one_hot_p_follows_the_only_possible_path(with_q):
    """p one-hot: a node is accepted iff it is p's token (any q with q(x) > 0), and the recovered token after every
    sibling failed is p's token."""
    tokens, parents = torch.tensor([7, 5, 2, 9, 1]), torch.tensor([-1, -1, 1, 1, 3])
    p = torch.softmax(_peaked([5, 0, 9, 0, 1, 6]), -1)  # anchor -> 5 (node 1) -> 9 (node 3) -> 1 (node 4) -> 6
    q = torch.softmax(torch.randn(5, 10, generator=torch.Generator().manual_seed(0)), -1) if with_q else None
    out, path = rejection_tree_verify(tokens, parents, torch.tensor([5]), p, q, [torch.Generator().manual_seed(1)])
    assert path[0].tolist() == [1, 3, 4, PAD, PAD] and out.rows() == [[5, 9, 1, 6]]
    p = torch.softmax(_peaked([3, 0, 9, 0, 1, 6]), -1)  # no child of the anchor is p's token: recover 3
    out, path = rejection_tree_verify(tokens, parents, torch.tensor([5]), p, q, [torch.Generator().manual_seed(1)])
    assert path[0].tolist() == [PAD] * 5 and out.rows() == [[3]]


def test_rejection_tree_verify_batches_ragged_trees_as_each_alone():
    """A request's draws come from its own generator only: batching ragged trees changes nothing."""
    g = torch.Generator().manual_seed(3)
    trees = [((-1, -1, 0), 3), ((-1,), 1), ((-1, 0, -1, 2), 4)]
    tokens = [torch.randint(0, 10, (k,), generator=g) for _, k in trees]
    p = [torch.softmax(torch.randn(k + 1, 10, generator=g), -1) for _, k in trees]
    q = [torch.softmax(torch.randn(k, 10, generator=g), -1) for _, k in trees]
    batched, paths = rejection_tree_verify(
        torch.cat(tokens), torch.tensor([x for par, _ in trees for x in par]), torch.tensor([k for _, k in trees]),
        torch.cat(p), torch.cat(q), [torch.Generator().manual_seed(10 + b) for b in range(3)])
    for b, (par, k) in enumerate(trees):
        alone, path = rejection_tree_verify(tokens[b], torch.tensor(par), torch.tensor([k]), p[b], q[b],
                                            [torch.Generator().manual_seed(10 + b)])
        assert alone.rows()[0] == batched.rows()[b]
        assert path[0, : int(alone.num_accepted[0])].tolist() == paths[b, : int(alone.num_accepted[0])].tolist()


def test_verify_tree_is_greedy_at_temperature_zero_and_seeded_otherwise():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    best = int(logits[0].argmax())
    out, path = verify_tree(logits, [best, (best + 1) % 10, 3], (-1, -1, 0), None, SamplingParams(), None)
    assert path == [0] and out.rows()[0] == [best, int(logits[1].argmax())]
    params = SamplingParams(temperature=0.9, seed=1)
    runs = [verify_tree(logits, [1, 2, 3], (-1, -1, 0), None, params, torch.Generator().manual_seed(9))
            for _ in range(2)]
    assert runs[0][0].rows() == runs[1][0].rows() and runs[0][1] == runs[1][1]


# ------------------------------------------------------------------------------------------------------------
# Statistical losslessness over trees


def _draw_tree(parents, prev, Q, mode, gen):
    """Every sequence's tree for this round: tokens [B, n] and q rows [B, n, V] (each node's Q given its parent)."""
    batch, n = prev.shape[0], len(parents)
    tokens = torch.empty(batch, n, dtype=torch.long)
    rows = torch.empty(batch, n, Q.shape[1])
    rank = [sum(1 for j in range(i) if parents[j] == parents[i]) for i in range(n)]  # earlier siblings
    for i, par in enumerate(parents):
        ctx = prev if par < 0 else tokens[:, par]
        q = Q[ctx]
        if mode == "sampled":  # inverse CDF on (0, total]: never a zero-probability token
            cdf = q.double().cumsum(-1)
            u = (1.0 - torch.rand(batch, 1, generator=gen, dtype=torch.float64)) * cdf[:, -1:]
            tokens[:, i] = (cdf < u).sum(-1).clamp(max=Q.shape[1] - 1)
        else:  # EAGLE-2's children: Q's top tokens in order
            tokens[:, i] = q.argsort(dim=-1, descending=True, stable=True)[:, rank[i]]
        rows[:, i] = q
    return tokens, rows


def _simulate_trees(P, Q, parents, mode: str, pass_q: bool, length: int, n: int = N, seed: int = SEED):
    """n sequences of `length` tokens, a draft tree per round verified by rejection_tree_verify (as simulate in
    _markov.py does for chains); the output's structure is checked every round."""
    vocab = P.shape[1]
    k = len(parents)
    draft_gen = torch.Generator().manual_seed(seed)
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + 1 + i) for i in range(n)]
    out = torch.full((n, length), PAD, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), vocab, dtype=torch.long)  # the start state
    active = torch.arange(n)
    j = torch.arange(k + 1)
    while active.numel():
        batch = active.numel()
        prev = last[active]
        tokens, rows = _draw_tree(parents, prev, Q, mode, draft_gen)
        contexts = torch.cat([prev[:, None], tokens], dim=1)  # [B, k+1]: p after the anchor and after each node
        result, path = rejection_tree_verify(
            tokens.reshape(-1), torch.tensor(parents).repeat(batch), torch.full((batch,), k),
            P[contexts].reshape(batch * (k + 1), vocab), rows.reshape(batch * k, vocab) if pass_q else None,
            [generators[i] for i in active.tolist()])
        committed = result.num_committed
        along = path.clamp(min=0)
        on_path = j[None, :k] < result.num_accepted[:, None]
        assert bool((result.tokens[:, :k][on_path] == tokens.gather(1, along)[on_path]).all())
        assert bool((result.tokens[j[None] >= committed[:, None]] == PAD).all())
        pos = count[active][:, None] + j[None]
        write = (j[None] < committed[:, None]) & (pos < length)
        out[active[:, None].expand(-1, k + 1)[write], pos[write]] = result.tokens[write]
        last[active] = result.tokens.gather(1, (committed - 1)[:, None]).squeeze(1)
        count[active] += committed
        active = active[count[active] < length]
    return out


def _depth(parents) -> int:
    depth: list[int] = []
    for p in parents:
        depth.append(1 + (depth[p] if p >= 0 else 0))
    return max(depth)


def _check(shape: str, mode: str, pass_q: bool, processing: dict | None = None, n: int = N) -> list[str]:
    target, draft = markov_logits(VOCAB, seed=0)
    P, Q = (processed(x, **(processing or {"temperature": 1.0})) for x in (target, draft))
    parents = SHAPES[shape]
    seqs = _simulate_trees(P, Q, parents, mode, pass_q, length=_depth(parents) + 3, n=n)
    return pairwise_failures(seqs, P)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["sampled", "top"])
def test_rejection_tree_verify_is_lossless(shape, mode):
    """SpecInfer's trees (sampled nodes, soft q) and EAGLE-2's (top children, point masses) both reproduce P."""
    failures = _check(shape, mode, pass_q=mode == "sampled")
    assert not failures, failures


@pytest.mark.parametrize("processing", [dict(temperature=0.7), dict(temperature=1.0, top_k=3)], ids=str)
def test_rejection_tree_verify_is_lossless_after_processing(processing):
    failures = _check("branchy", "sampled", pass_q=True, processing=processing)
    assert not failures, failures


def test_point_masses_are_lossless_for_sampled_trees_too():
    """q = None is lossless for any tokens chosen before verification, sampled ones included."""
    failures = _check("branchy", "sampled", pass_q=False)
    assert not failures, failures


# Negative controls: the checker must see each bug. Each is off by TV > 0.2 at N = 30k, so a sixth of N (TV limit
# 0.09) keeps ample power at a sixth of the time.
NEGATIVE_N = 5_000


def _residual_after_the_last_sibling_only(parents):
    """A mutation of verify._sibling_residual for trees of this one shape (it is called once per node, in index
    order): a rejected node with a later sibling leaves p as it was, and only the last sibling's rejection takes
    the residual, so every sibling is tested against the parent's p and the recovered token comes from
    norm(max(0, p - q_last))."""
    real, calls = verify._sibling_residual, [0]
    last = [all(parents[j] != par for j in range(i + 1, len(parents))) for i, par in enumerate(parents)]

    def mutated(p, q, x):
        i = calls[0] % len(parents)
        calls[0] += 1
        return real(p, q, x) if last[i] else p

    return mutated


@pytest.mark.parametrize("mutation", ["none-at-all", "after-the-last-sibling-only"])
@pytest.mark.parametrize("shape", ["wide", "branchy"])
@pytest.mark.parametrize("mode", ["sampled", "top"])
def test_negative_control_skipping_the_residual_between_siblings_is_detected(mutation, shape, mode, monkeypatch):
    """Mutations of the library's rule that skip the residual update between siblings: with none at all a rejected
    sibling leaves p as it was (EAGLE's evaluate_posterior without `gtp[xi] = 0`), so the next sibling and the
    recovered token are drawn against p; with the residual taken after the last sibling only, each sibling is
    tried against the parent's p."""
    mutated = (lambda p, q, x: p) if mutation == "none-at-all" else _residual_after_the_last_sibling_only(SHAPES[shape])
    monkeypatch.setattr(verify, "_sibling_residual", mutated)
    assert _check(shape, mode, pass_q=mode == "sampled", n=NEGATIVE_N)


def test_negative_control_soft_q_for_top_children_is_detected():
    """Passing Q's rows for children that are Q's top tokens (not samples from Q) is lossy: detected."""
    assert _check("branchy", "top", pass_q=True, n=NEGATIVE_N)
