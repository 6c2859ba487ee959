"""Canned-logit unit tests of the verification rules (verispec.verify) and of verispec.sampling.

Target logits are built with +100 at one token and -100 elsewhere, so argmax is known and the processed
probabilities are exactly one-hot: then sample_match_verify and rejection_verify are deterministic and must
commit exactly what greedy_verify commits. Seeded-determinism tests use soft distributions instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from verispec import sampling
from verispec.verify import (
    PLACEHOLDER_TOKEN_ID,
    greedy_commit_rows,
    greedy_tree_verify,
    greedy_verify,
    rejection_verify,
    sample_match_verify,
)

V = 10
PAD = PLACEHOLDER_TOKEN_ID


def _peaked_logits(ids: list[int], vocab: int = V) -> torch.Tensor:
    """[len(ids), V] logits with +100 at ids[i] and -100 elsewhere."""
    logits = torch.full((len(ids), vocab), -100.0)
    logits[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.long)] = 100.0
    return logits


def _gens(n: int, base: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(base + i) for i in range(n)]


def _run(rule: str, drafts: list[int], ks: list[int], target_ids: list[int]):
    """Verify a flattened ragged batch whose target argmax rows are target_ids, with the given rule."""
    assert len(drafts) == sum(ks) and len(target_ids) == sum(ks) + len(ks)
    draft_tokens = torch.tensor(drafts, dtype=torch.long)
    num_draft = torch.tensor(ks, dtype=torch.long)
    logits = _peaked_logits(target_ids)
    probs = sampling.logits_to_probs(logits, temperature=1.0)
    gens = _gens(len(ks))
    if rule == "greedy":
        return greedy_verify(draft_tokens, num_draft, logits)
    if rule == "sample_match":
        return sample_match_verify(draft_tokens, num_draft, probs, gens)
    if rule == "rejection_point_mass":
        return rejection_verify(draft_tokens, num_draft, probs, None, gens)
    if rule == "rejection_soft_q":  # any q with q(x) > 0: p is one-hot, so accept iff p(x) = 1
        q = torch.softmax(torch.randn(len(drafts), V, generator=torch.Generator().manual_seed(7)), dim=-1)
        return rejection_verify(draft_tokens, num_draft, probs, q, gens)
    raise ValueError(rule)


RULES = ["greedy", "sample_match", "rejection_point_mass", "rejection_soft_q"]


def _assert_output(out, tokens: list[list[int]], num_accepted: list[int]):
    assert out.tokens.dtype == torch.long
    assert out.tokens.tolist() == tokens
    assert out.num_accepted.tolist() == num_accepted
    assert out.num_committed.tolist() == [a + 1 for a in num_accepted]
    assert out.rows() == [row[: a + 1] for row, a in zip(tokens, num_accepted)]


def test_one_hot_probs_are_exact():
    """Precondition of the canned tests: +/-100 logits give exactly one-hot fp32 probabilities."""
    probs = sampling.logits_to_probs(_peaked_logits([3, 0, 9]), temperature=1.0)
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor([3, 0, 9]), V).float())


# ------------------------------------------------------------------------------------------------------------
# Canned cases, identical for every rule.


@pytest.mark.parametrize("rule", RULES)
def test_all_accepted_commits_k_plus_bonus(rule):
    """A draft equal to the target argmax is fully accepted and the bonus comes from p_{k+1}."""
    out = _run(rule, [1, 2, 3], [3], [1, 2, 3, 4])
    _assert_output(out, [[1, 2, 3, 4]], [3])


@pytest.mark.parametrize("rule", RULES)
def test_first_position_mismatch(rule):
    """A wrong first draft token commits only the target token; every later slot is PLACEHOLDER."""
    out = _run(rule, [1, 2, 3], [3], [5, 2, 3, 4])
    _assert_output(out, [[5, PAD, PAD, PAD]], [0])


@pytest.mark.parametrize("rule", RULES)
def test_mismatch_in_the_middle(rule):
    """Accept up to the first mismatch, commit the target token there, ignore later (matching) drafts."""
    out = _run(rule, [1, 2, 3], [3], [1, 7, 3, 4])
    _assert_output(out, [[1, 7, PAD, PAD]], [1])


@pytest.mark.parametrize("rule", RULES)
def test_last_position_mismatch(rule):
    """A mismatch at the last draft position: k-1 accepted plus the recovered token, no bonus."""
    out = _run(rule, [1, 2, 3], [3], [1, 2, 8, 4])
    _assert_output(out, [[1, 2, 8, PAD]], [2])


@pytest.mark.parametrize("rule", RULES)
def test_ragged_batch_with_empty_draft(rule):
    """Requests with k = 2, 0, 3, 1 in one flattened batch: each uses only its own rows, padded to K+1."""
    ks = [2, 0, 3, 1]
    drafts = [4, 5] + [] + [1, 2, 3] + [6]
    targets = [4, 5, 9] + [7] + [1, 0, 3, 2] + [8, 1]
    out = _run(rule, drafts, ks, targets)
    _assert_output(
        out,
        [
            [4, 5, 9, PAD],  # all accepted + bonus
            [7, PAD, PAD, PAD],  # k = 0: just the target token
            [1, 0, PAD, PAD],  # mismatch at position 2
            [8, PAD, PAD, PAD],  # first-position mismatch
        ],
        [2, 0, 1, 0],
    )


@pytest.mark.parametrize("rule", RULES)
def test_batch_of_only_empty_drafts(rule):
    """All k = 0 (no draft tokens at all): one token per request from its single target row."""
    out = _run(rule, [], [0, 0, 0], [3, 0, 9])
    _assert_output(out, [[3], [0], [9]], [0, 0, 0])


@pytest.mark.parametrize("rule", RULES)
def test_single_request_single_draft(rule):
    """k = 1, accepted and rejected."""
    _assert_output(_run(rule, [2], [1], [2, 6]), [[2, 6]], [1])
    _assert_output(_run(rule, [2], [1], [3, 6]), [[3, PAD]], [0])


def test_placeholder_is_negative():
    """PLACEHOLDER_TOKEN_ID can never be confused with a real token id."""
    assert PLACEHOLDER_TOKEN_ID < 0


# ------------------------------------------------------------------------------------------------------------
# Greedy tie-breaking (reliability.md A4).


def test_greedy_exact_top2_tie_picks_lowest_id():
    """Exact top-2 ties in draft and bonus positions resolve to the lowest id, like sampling.greedy."""
    logits = torch.zeros(3, V)
    logits[0, [3, 6]] = 5.0  # tie 3/6 at position 1: draft 3 must be accepted
    logits[1, [2, 8]] = 5.0  # tie 2/8 at position 2: draft 8 must be rejected in favour of 2
    logits[2, [1, 4]] = 5.0
    assert sampling.greedy(logits).tolist() == [3, 2, 1]
    out = greedy_verify(torch.tensor([3, 8]), torch.tensor([2]), logits)
    _assert_output(out, [[3, 2, PAD]], [1])
    bonus = greedy_verify(torch.tensor([3, 2]), torch.tensor([2]), logits)
    _assert_output(bonus, [[3, 2, 1]], [2])


def _draft_positions(ks: list[int]) -> torch.Tensor:
    """Target rows p_1..p_k of every request (the rows that score the draft tokens), flattened."""
    return torch.tensor([sum(ks[:b]) + b + j for b, k in enumerate(ks) for j in range(k)], dtype=torch.long)


def test_greedy_verify_matches_plain_greedy_decode_with_ties():
    """Random ragged batches of tie-heavy integer logits: greedy_verify == plain argmax decoding."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ks = torch.randint(0, 5, (6,), generator=g).tolist()
        logits = torch.randint(0, 3, (sum(ks) + len(ks), 6), generator=g).float()  # many exact ties
        plain = sampling.greedy(logits)
        # Draft = the plain greedy token at that position 70% of the time, else a random token.
        drafts = torch.where(torch.rand(sum(ks), generator=g) < 0.7, plain[_draft_positions(ks)],
                             torch.randint(0, 6, (sum(ks),), generator=g))
        out = greedy_verify(drafts, torch.tensor(ks), logits)
        starts = [sum(ks[:b]) for b in range(len(ks) + 1)]
        lists = [drafts[starts[b] : starts[b + 1]].tolist() for b in range(len(ks))]
        host = greedy_commit_rows(lists, logits)  # the engine's host-list form of the same rule
        expected, d, t = [], 0, 0
        for k in ks:
            row = []
            for j in range(k + 1):
                row.append(int(plain[t + j]))
                if j == k or int(drafts[d + j]) != row[-1]:
                    break
            expected.append(row)
            d, t = d + k, t + k + 1
        assert out.rows() == expected
        assert host == expected


def test_greedy_commit_rows_refuses_rows_that_do_not_match_the_drafts():
    logits = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="4 target rows for drafts needing 3"):
        greedy_commit_rows([[1], []], logits)


# ------------------------------------------------------------------------------------------------------------
# Seeded determinism and request independence (reliability.md A6), with soft distributions.


def _soft_batch(ks: list[int], seed: int = 0):
    """Random soft target probs, draft probs and draft tokens sampled from them, for a ragged batch."""
    g = torch.Generator().manual_seed(seed)
    n, b = sum(ks), len(ks)
    target = sampling.logits_to_probs(torch.randn(n + b, V, generator=g) * 2, temperature=1.0)
    draft_probs = sampling.logits_to_probs(torch.randn(n, V, generator=g) * 2, temperature=1.0)
    drafts = sampling.sample(draft_probs, g) if n else torch.zeros(0, dtype=torch.long)
    return drafts, torch.tensor(ks, dtype=torch.long), target, draft_probs


def _request(ks, drafts, target, draft_probs, b):
    """Request b of a flattened batch as a batch of one."""
    d0, t0, k = sum(ks[:b]), sum(ks[:b]) + b, ks[b]
    return drafts[d0 : d0 + k], torch.tensor([k]), target[t0 : t0 + k + 1], draft_probs[d0 : d0 + k]


VERIFIERS = {
    "sample_match": lambda d, n, p, q, g: sample_match_verify(d, n, p, g),
    "rejection_soft_q": lambda d, n, p, q, g: rejection_verify(d, n, p, q, g),
    "rejection_point_mass": lambda d, n, p, q, g: rejection_verify(d, n, p, None, g),
}
KS = [3, 0, 2, 5, 1, 4]


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_same_seeds_give_identical_outputs(name):
    """Same per-request seeds => bit-identical tokens and acceptance counts over 20 repetitions."""
    verify = VERIFIERS[name]
    drafts, num_draft, target, q = _soft_batch(KS)
    first = verify(drafts, num_draft, target, q, _gens(len(KS), base=100))
    distinct = set()
    for rep in range(20):
        out = verify(drafts, num_draft, target, q, _gens(len(KS), base=100))
        assert torch.equal(out.tokens, first.tokens) and torch.equal(out.num_accepted, first.num_accepted)
        other_seeds = verify(drafts, num_draft, target, q, _gens(len(KS), base=1000 * rep))
        distinct.add(tuple(other_seeds.tokens.flatten().tolist()))
    assert len(distinct) > 1, "different seeds should give different outputs (the soft case is random)"


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_request_output_independent_of_other_requests(name):
    """A seeded request's tokens do not depend on the other rows' seeds, on unseeded neighbours (None
    generators drawing from the global RNG) or on the batch at all (same result as a batch of one)."""
    verify = VERIFIERS[name]
    drafts, num_draft, target, q = _soft_batch(KS, seed=1)
    reference = verify(drafts, num_draft, target, q, _gens(len(KS), base=50)).rows()
    for trial in range(5):
        gens: list[torch.Generator | None] = _gens(len(KS), base=50)
        for b in range(len(KS)):  # re-seed or un-seed every other row
            if (b + trial) % 2:
                gens[b] = None if trial % 2 else torch.Generator().manual_seed(10_000 + 31 * trial + b)
        torch.manual_seed(trial)
        rows = verify(drafts, num_draft, target, q, gens).rows()
        for b in range(len(KS)):
            if (b + trial) % 2 == 0:
                assert rows[b] == reference[b], (trial, b)
    for b in range(len(KS)):
        alone = verify(*_request(KS, drafts, target, q, b), [torch.Generator().manual_seed(50 + b)])
        assert alone.rows()[0] == reference[b]


def test_point_mass_q_none_equals_explicit_one_hot_q():
    """draft_probs=None is exactly a one-hot q at the draft token: identical outputs for identical seeds."""
    for seed in range(10):
        drafts, num_draft, target, _ = _soft_batch(KS, seed=seed)
        one_hot = torch.nn.functional.one_hot(drafts, V).float()
        a = rejection_verify(drafts, num_draft, target, None, _gens(len(KS), base=seed))
        b = rejection_verify(drafts, num_draft, target, one_hot, _gens(len(KS), base=seed))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_rejection_accepts_everything_when_q_equals_p():
    """p == q (self-drafting) gives acceptance probability 1 at every position: all k accepted."""
    drafts, num_draft, target, _ = _soft_batch(KS, seed=3)
    t = _draft_positions(KS)
    drafts = sampling.sample(target[t], torch.Generator().manual_seed(0))
    for rep in range(20):
        out = rejection_verify(drafts, num_draft, target, target[t], _gens(len(KS), base=rep))
        assert out.num_accepted.tolist() == KS


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_k0_request_samples_like_plain_decode(name):
    """With k = 0 the committed token is exactly sampling.sample(p, generator) for the same seed."""
    probs = sampling.logits_to_probs(torch.randn(4, V, generator=torch.Generator().manual_seed(9)), 1.0)
    no_drafts = torch.zeros(0, dtype=torch.long)
    out = VERIFIERS[name](no_drafts, torch.zeros(4, dtype=torch.long), probs, torch.zeros(0, V), _gens(4, 77))
    plain = [int(sampling.sample(probs[b : b + 1], g)[0]) for b, g in enumerate(_gens(4, 77))]
    assert out.tokens[:, 0].tolist() == plain


def test_wrong_number_of_generators_is_rejected():
    """One generator per request is required."""
    drafts, num_draft, target, q = _soft_batch([1, 2])
    with pytest.raises(ValueError):
        rejection_verify(drafts, num_draft, target, q, _gens(1))
    with pytest.raises(ValueError):
        sample_match_verify(drafts, num_draft, target, _gens(3))


# ------------------------------------------------------------------------------------------------------------
# sampling.logits_to_probs and sampling.sample.


def test_temperature_scaling():
    """logits_to_probs(l, T) == softmax(l / T), rows sum to 1, and T <= 0 (or not finite) is refused."""
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0)) * 3
    for temperature in (0.3, 0.7, 1.0, 1.3, 2.5):
        probs = sampling.logits_to_probs(logits, temperature)
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs, torch.softmax(logits.double() / temperature, -1).float())
        torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    sharp, flat = sampling.logits_to_probs(logits, 0.5), sampling.logits_to_probs(logits, 2.0)
    assert bool((sharp.max(-1).values > flat.max(-1).values).all())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            sampling.logits_to_probs(logits, bad)


@pytest.mark.parametrize("top_k", [1, 3, 17, 49])
def test_top_k_keeps_exactly_k_tokens(top_k):
    """top-k keeps exactly the k largest logits, renormalised (softmax over the kept logits)."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(top_k)) * 2  # distinct values
    probs = sampling.logits_to_probs(logits, 0.8, top_k=top_k)
    kept = probs > 0
    assert kept.sum(-1).tolist() == [top_k] * 8
    top = torch.topk(logits, top_k, dim=-1).indices
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, top, True))
    expected = torch.softmax((logits / 0.8).masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("top_k", [0, 50, 100])
def test_top_k_disabled(top_k):
    """top_k = 0 or >= V leaves the distribution unchanged."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sampling.logits_to_probs(logits, 1.0, top_k=top_k), torch.softmax(logits, -1))


def _reference_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Smallest prefix (by descending probability) whose mass reaches top_p, computed in float64."""
    probs = torch.softmax(logits.double() / temperature, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    cum = sorted_probs.cumsum(-1)
    assert bool(((cum - top_p).abs() > 1e-5).all()), "test data too close to the top_p boundary"
    keep_sorted = (cum - sorted_probs) < top_p  # keep while the mass before the token has not reached top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    out = probs.masked_fill(~keep, 0.0)
    return out / out.sum(-1, keepdim=True)


def test_top_p_hand_example():
    """probs [0.5, 0.25, 0.15, 0.1]: top_p 0.45 -> 1 token, 0.6 -> 2, 0.85 -> 3, 0.95 -> 4."""
    logits = torch.tensor([[0.25, 0.5, 0.1, 0.15]]).log()
    for top_p, kept in [(0.45, [1]), (0.6, [0, 1]), (0.85, [0, 1, 3]), (0.95, [0, 1, 2, 3])]:
        probs = sampling.logits_to_probs(logits, 1.0, top_p=top_p)[0]
        assert torch.nonzero(probs).flatten().tolist() == kept, top_p
        base = torch.tensor([0.25, 0.5, 0.1, 0.15])[kept]
        torch.testing.assert_close(probs[kept], base / base.sum())


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_top_p_keeps_smallest_prefix_reaching_p(temperature, top_p):
    """top-p keeps the smallest set of most likely tokens whose (tempered) mass reaches p, renormalised."""
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(int(top_p * 100))) * 2
    probs = sampling.logits_to_probs(logits, temperature, top_p=top_p)
    expected = _reference_top_p(logits, temperature, top_p)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(16))


def test_top_k_then_top_p():
    """top-k and top-p compose: top-p is taken over the renormalised top-k distribution."""
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(5)) * 2
    both = sampling.logits_to_probs(logits, 1.0, top_k=10, top_p=0.7)
    kth = torch.topk(logits, 10, -1).values[:, -1:]
    expected = _reference_top_p(logits.masked_fill(logits < kth, float("-inf")), 1.0, 0.7)
    assert torch.equal(both > 0, expected > 0)
    assert bool(((both > 0).sum(-1) <= 10).all())


def test_greedy_tie_lowest_id():
    """sampling.greedy resolves exact ties to the lowest token id."""
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    assert sampling.greedy(logits).tolist() == [1, 0, 0]


def test_sample_is_exact():
    """sampling.sample is exact: chi-square on 200k draws; zero-mass tokens are never drawn."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])
    n = 200_000
    draws = sampling.sample(p.expand(n, -1), torch.Generator().manual_seed(0))
    counts = np.bincount(draws.numpy(), minlength=8)
    assert counts[6:].sum() == 0
    assert stats.chisquare(counts[:6], p[:6].double().numpy() * n).pvalue > 1e-3


def test_sample_single_row_calls_are_exact():
    """Per-row calls (how the verifiers use the race) are exact too: chi-square on 20k single-row draws."""
    p = torch.tensor([[0.05, 0.0, 0.5, 0.2, 0.25]])
    g = torch.Generator().manual_seed(1)
    counts = np.bincount([int(sampling.sample(p, g)[0]) for _ in range(20_000)], minlength=5)
    assert counts[1] == 0
    expected = p[0, [0, 2, 3, 4]].double().numpy() * 20_000
    assert stats.chisquare(counts[[0, 2, 3, 4]], expected).pvalue > 1e-3


def test_sample_seeded_and_shaped():
    """sample keeps leading dims and is reproducible for the same generator seed."""
    probs = torch.softmax(torch.randn(2, 3, V), -1)
    a = sampling.sample(probs, torch.Generator().manual_seed(4))
    b = sampling.sample(probs, torch.Generator().manual_seed(4))
    assert a.shape == (2, 3) and torch.equal(a, b)
    g = sampling.make_generator(123)
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(123).get_state())


def test_greedy_single_request_equals_the_batched_rule():
    """greedy_verify's one-request shortcut (no ragged layout) commits what the batched rule commits for that
    request, with tie-heavy logits, every draft length including 0, and the same output shapes and dtypes."""
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        for _ in range(40):
            drafts = torch.randint(0, 4, (k,), generator=g)
            logits = torch.randint(0, 3, (k + 1, 4), generator=g).float()
            other = torch.randint(0, 3, (3, 4), generator=g).float()  # a second request, k = 2
            alone = greedy_verify(drafts, torch.tensor([k]), logits)
            batched = greedy_verify(torch.cat([drafts, torch.tensor([1, 2])]), torch.tensor([k, 2]),
                                    torch.cat([logits, other]))
            assert alone.tokens.dtype == alone.num_accepted.dtype == torch.long
            assert alone.tokens.tolist() == batched.tokens[:1, : k + 1].tolist()
            assert alone.num_accepted.tolist() == batched.num_accepted[:1].tolist()


def test_greedy_tree_verify_on_a_chain_is_greedy_verify():
    """A chain is the tree whose parents are -1, 0, ..., k-2: greedy_tree_verify commits what greedy_verify does,
    with tie-heavy logits and every draft length including 0, and its path is 0..a-1."""
    g = torch.Generator().manual_seed(2)
    for k in range(6):
        for _ in range(40):
            drafts = torch.randint(0, 4, (k,), generator=g)
            logits = torch.randint(0, 3, (k + 1, 4), generator=g).float()
            chain = greedy_verify(drafts, torch.tensor([k]), logits)
            tree, path = greedy_tree_verify(drafts, torch.arange(-1, k - 1), logits)
            assert tree.tokens.tolist() == chain.tokens.tolist()
            assert tree.num_accepted.tolist() == chain.num_accepted.tolist()
            assert path.tolist() == list(range(int(chain.num_accepted[0])))


def test_greedy_tree_verify_takes_the_deepest_accepted_path():
    # anchor -> 0 (rejected) -> 3 (matches, but its parent was rejected); anchor -> 1 -> 2 (accepted) -> 4 (rejected)
    parents = torch.tensor([-1, -1, 1, 0, 2])
    tokens = torch.tensor([7, 5, 9, 8, 1])
    best = [5, 8, 9, 2, 6, 3]  # argmax at the anchor, then at nodes 0..4
    out, path = greedy_tree_verify(tokens, parents, _peaked_logits(best))
    assert path.tolist() == [1, 2] and out.num_accepted.tolist() == [2]
    assert out.tokens.tolist() == [[5, 9, best[3], PAD]]  # depth 3: one placeholder
    nothing, empty = greedy_tree_verify(tokens, parents, _peaked_logits([6] * 6))
    assert empty.tolist() == [] and nothing.tokens.tolist() == [[6, PAD, PAD, PAD]]


def test_greedy_tree_verify_matches_brute_force_on_random_trees():
    """Every root-to-node path whose nodes all match the argmax at their parent, the deepest (first on a tie):
    enumerated from scratch on random trees with tie-heavy logits and duplicate sibling tokens."""
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        n = int(torch.randint(0, 9, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
        tokens = torch.randint(0, 3, (n,), generator=g)
        logits = torch.randint(0, 2, (n + 1, 3), generator=g).float()
        best = sampling.greedy(logits).tolist()

        def root_path(i):
            return [] if i < 0 else root_path(parents[i]) + [i]

        accepted = [p for p in (root_path(i) for i in range(n))
                    if all(int(tokens[j]) == best[(parents[j]) + 1] for j in p)]
        want = max(accepted, key=lambda p: (len(p), -p[-1]), default=[])
        out, path = greedy_tree_verify(tokens, torch.tensor(parents, dtype=torch.long), logits)
        assert path.tolist() == want
        committed = out.tokens[0, : len(want) + 1].tolist()
        assert committed == [int(tokens[j]) for j in want] + [best[want[-1] + 1 if want else 0]]
