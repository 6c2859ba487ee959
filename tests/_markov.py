"""Synthetic order-1 Markov target/draft, a batched speculative-decoding simulator, the losslessness checker.

Used by test_verify_stats.py (reliability.md §3.6 and checklist item A5). The model has V tokens plus a start
state (row V of the transition matrices): P[s] is the processed target distribution of the next token after s,
Q[s] the processed draft distribution. A correct speculative sampler must produce sequences distributed
exactly as the Markov chain P, so every adjacent pair (x_t, x_{t+1}) must follow the exact joint
m_t(a) * P[a, b], where m_t is the marginal of x_t.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy import stats

from verispec.sampling import logits_to_probs
from verispec.verify import PLACEHOLDER_TOKEN_ID, VerifyOutput

# verify(draft_tokens, num_draft, target_probs, draft_probs, generators) -> VerifyOutput, as rejection_verify.
Verifier = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", Sequence["torch.Generator | None"]],
    VerifyOutput,
]


def markov_logits(vocab: int = 8, seed: int = 0, target_scale: float = 1.5, draft_noise: float = 1.0):
    """Seeded random transition logits [V+1, V] for the target and a correlated (but different) draft."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab + 1, vocab, generator=g) * target_scale
    draft = target + torch.randn(vocab + 1, vocab, generator=g) * draft_noise
    return target, draft


def processed(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """The processed distribution (what the output must follow), via the library's logits_to_probs."""
    return logits_to_probs(logits, temperature, top_k, top_p)


def simulate(
    verify: Verifier,
    P: torch.Tensor,  # [V+1, V] processed target transitions, row V = start state
    Q: torch.Tensor,  # [V+1, V] processed draft transitions
    k: int,
    length: int,
    n: int,
    seed: int,
    drafter: str = "sample",  # "sample": x_j ~ Q[x_{j-1}]; "argmax": x_j = argmax Q[x_{j-1}] (point mass)
    pass_q: bool = True,  # give the verifier the soft Q rows (else draft_probs=None)
) -> torch.Tensor:  # [n, length] generated tokens
    """Run n independent sequences as one batch per round until each has `length` committed tokens.

    Each round every unfinished request drafts k tokens, the verifier sees the k + 1 target rows
    P[prev], P[x_1], ..., P[x_k] and the k draft rows Q[prev], ..., Q[x_{k-1}], and the committed tokens
    (truncated at `length`) are appended. Every request keeps its own seeded generator across rounds.
    The structural contract of VerifyOutput is checked on every round.
    """
    vocab = P.shape[1]
    start = vocab
    draft_gen = torch.Generator().manual_seed(seed)
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + 1 + i) for i in range(n)]
    out = torch.full((n, length), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), start, dtype=torch.long)
    active = torch.arange(n)
    j = torch.arange(k + 1)
    while active.numel():
        batch = active.numel()
        prev = last[active]
        drafts = torch.empty(batch, k, dtype=torch.long)
        q_rows = torch.empty(batch, k, vocab)
        ctx = prev
        for i in range(k):
            q_i = Q[ctx]
            if drafter == "sample":  # inverse CDF, u in (0, total]: never lands on a zero-probability token
                cdf = q_i.double().cumsum(dim=-1)
                u = (1.0 - torch.rand(batch, 1, generator=draft_gen, dtype=torch.float64)) * cdf[:, -1:]
                x = (cdf < u).sum(dim=-1)
            elif drafter == "argmax":
                x = q_i.argmax(dim=-1)
            else:
                raise ValueError(drafter)
            drafts[:, i], q_rows[:, i], ctx = x, q_i, x
        contexts = torch.cat([prev[:, None], drafts], dim=1)  # [B, k+1]
        result = verify(
            drafts.reshape(-1),
            torch.full((batch,), k, dtype=torch.long),
            P[contexts].reshape(batch * (k + 1), vocab),
            q_rows.reshape(batch * k, vocab) if pass_q else None,
            [generators[i] for i in active.tolist()],
        )
        tokens, committed = result.tokens, result.num_committed
        # Contract: shape [B, k+1]; 1..k+1 committed; accepted prefix == drafts; placeholders afterwards.
        assert tokens.shape == (batch, k + 1)
        assert bool(((committed >= 1) & (committed <= k + 1)).all())
        accepted = j[None, :k] < result.num_accepted[:, None]
        assert bool((tokens[:, :k][accepted] == drafts[accepted]).all())
        assert bool((tokens[j[None] >= committed[:, None]] == PLACEHOLDER_TOKEN_ID).all())
        pos = count[active][:, None] + j[None]
        write = (j[None] < committed[:, None]) & (pos < length)
        rows = active[:, None].expand(-1, k + 1)
        out[rows[write], pos[write]] = tokens[write]
        last[active] = tokens.gather(1, (committed - 1)[:, None]).squeeze(1)
        count[active] += committed
        active = active[count[active] < length]
    return out


def exact_pair_joints(P: torch.Tensor, length: int) -> list[np.ndarray]:
    """Exact joint of (x_t, x_{t+1}) for t = 0..length-2 under the Markov chain P (float64)."""
    p = P.double().numpy()
    vocab = p.shape[1]
    marginal = p[vocab]
    joints = []
    for _ in range(length - 1):
        joints.append(marginal[:, None] * p[:vocab])
        marginal = marginal @ p[:vocab]
    return joints


def tv_limit(cells: int, n: int) -> float:
    """Pass threshold 2 * sqrt(C / (2 pi N)) for TV(empirical, exact) (reliability.md §3.6)."""
    return 2.0 * math.sqrt(cells / (2.0 * math.pi * n))


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value; cells with expected count < 5 are pooled into one bin."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.asarray(obs, dtype=float), np.asarray(exp, dtype=float)
    exp_a *= obs_a.sum() / exp_a.sum()
    if obs_a.size < 2:
        return 1.0
    return float(stats.chisquare(obs_a, exp_a).pvalue)


def pairwise_failures(seqs: torch.Tensor, P: torch.Tensor) -> list[str]:
    """The losslessness check. Empty list = pass.

    For every adjacent pair (t, t+1): TV(empirical joint, exact joint) < 2 sqrt(C / (2 pi N)) with C = V^2,
    chi-square p > 1e-3 / (L - 1), and no pair the exact chain gives probability 0.
    """
    vocab = P.shape[1]
    n, length = seqs.shape
    s = seqs.numpy()
    if ((s < 0) | (s >= vocab)).any():
        return [f"{int(((s < 0) | (s >= vocab)).sum())} tokens outside [0, {vocab})"]
    limit = tv_limit(vocab * vocab, n)
    alpha = 1e-3 / (length - 1)
    failures = []
    for t, joint in enumerate(exact_pair_joints(P, length)):
        probs = joint.ravel()
        counts = np.bincount(s[:, t] * vocab + s[:, t + 1], minlength=vocab * vocab)
        tv = 0.5 * np.abs(counts / n - probs).sum()
        impossible = int(counts[probs == 0].sum())
        pval = chi_square_p(counts[probs > 0], probs[probs > 0])
        if tv >= limit or pval <= alpha or impossible:
            failures.append(
                f"pair ({t},{t + 1}): TV={tv:.4f} (limit {limit:.4f}), chi2 p={pval:.2e} "
                f"(limit {alpha:.1e}), impossible pairs={impossible}"
            )
    return failures
