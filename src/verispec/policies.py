"""Verification policies: how many of each request's draft tokens the target verifies this step.

- off: none (plain decoding). fixed: the request's k. batch-table: k looked up by the number of running
  requests (vLLM's and TensorRT-LLM's static schedule).
- dspark: DSpark's Algorithm 1. Every (request, position) is ranked by its prefix-survival probability
  a_j = prod_{i<=j} c_i and admitted in that order while the expected throughput tau * SPS(B) still grows; the
  first admission that does not raise it stops the search. That early stop is what keeps sampling lossless: a
  position's admission never depends on its own token (see algorithms.md §1.5, DSpark appendix A).

Survival c_j must never depend on the drafted token x_j itself, only on what precedes it: the drafter's confidence
head (if it has one) estimates acceptance before x_j is drawn, and the online estimate below uses past rounds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from verispec.drafters.base import Draft


def survival(conditional: Sequence[float]) -> list[float]:
    """a_j = prod_{i<=j} c_i: the probability that positions 1..j are all accepted."""
    out, acc = [], 1.0
    for c in conditional:
        acc *= min(max(float(c), 0.0), 1.0)
        out.append(acc)
    return out


def dspark_lengths(
    survivals: Sequence[Sequence[float]],  # per request, a_1..a_k (non-increasing)
    base_tokens: int,  # rows the step verifies anyway: every request's anchor, other requests' drafts, prefill
    base_tau: float,  # tokens the step commits anyway (one per decoding request, plus others' expected accepts)
    step_time: Callable[[int], float],  # seconds for a step that verifies B tokens, its drafting included
) -> list[int]:
    """Algorithm 1 with the early stop: returns the number of draft tokens to verify per request."""
    items = sorted(
        ((a, j, r) for r, surv in enumerate(survivals) for j, a in enumerate(surv, start=1) if a > 0),
        key=lambda t: (-t[0], t[1]),
    )
    lengths = [0] * len(survivals)
    best_lengths = list(lengths)
    tokens, tau = base_tokens, base_tau
    best = tau / step_time(tokens)
    for a, j, r in items:
        lengths[r] = j  # a is non-increasing in j, so position j - 1 of r was admitted before
        tokens += 1
        tau += a
        theta = tau / step_time(tokens)
        if theta <= best:
            break
        best, best_lengths = theta, list(lengths)
    return best_lengths


def dspark_cut(
    scheduled: Sequence[Sequence[float]],  # per request the rule cuts, c_1..c_k (conditional, see `conditional`)
    fixed: Sequence[tuple[int, Sequence[float]]],  # per other decoding request: (k, c_1..c_k), verified whole
    prefill_tokens: int,  # prompt rows the step runs besides
    step_time: Callable[[int], float],  # seconds for a step that verifies B tokens, its drafting included
) -> list[int]:
    """The dspark policy for one step, shared by the reference loop (one request, nothing fixed) and the engine:
    the number of draft tokens of each scheduled request to verify (`dspark_lengths` over their survivals, with
    every anchor, the fixed requests' drafts and the prefill rows verified anyway)."""
    base_tokens = prefill_tokens + sum(k + 1 for k, _ in fixed) + len(scheduled)
    base_tau = sum(1 + sum(survival(c)) for _, c in fixed) + len(scheduled)
    return dspark_lengths([survival(c) for c in scheduled], base_tokens, base_tau, step_time)


class AcceptanceEstimator:
    """Online P(position j accepted | positions before it accepted), per drafter and per request.

    A request's estimate shrinks toward its drafter's (engine-wide) estimate, which shrinks toward `prior`.
    """

    def __init__(self, max_k: int, prior: float = 0.5, strength: float = 4.0) -> None:
        self.max_k = max(max_k, 1)
        self.prior, self.strength = prior, strength
        self._global: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # drafter -> (reached, accepted) [k]
        self._local: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # request id -> same

    def _counts(self, table: dict, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in table:
            table[key] = (torch.zeros(self.max_k, dtype=torch.float64), torch.zeros(self.max_k, dtype=torch.float64))
        return table[key]

    def update(self, drafter: str, request_id: str, num_draft: int, num_accepted: int) -> None:
        """One verified round: positions 1..num_accepted+1 were reached (at most num_draft), 1..num_accepted passed."""
        reached_to = min(num_accepted + 1, num_draft, self.max_k)
        passed_to = min(num_accepted, self.max_k)
        for reached, accepted in (self._counts(self._global, drafter), self._counts(self._local, request_id)):
            reached[:reached_to] += 1
            accepted[:passed_to] += 1

    def conditional(self, drafter: str, request_id: str, k: int) -> list[float]:
        g_reached, g_acc = self._counts(self._global, drafter)
        g = (g_acc + self.strength * self.prior) / (g_reached + self.strength)
        if request_id in self._local:
            r_reached, r_acc = self._local[request_id]
            g = (r_acc + self.strength * g) / (r_reached + self.strength)
        out = g.tolist()
        return (out + [out[-1]] * k)[:k]

    def forget(self, request_id: str) -> None:
        self._local.pop(request_id, None)

    def tracked(self) -> list[str]:
        """Request ids with a per-request estimate (forgotten when the request finishes)."""
        return list(self._local)


def learn_from_proposals(
    estimator: AcceptanceEstimator, drafter: str, request_id: str,
    shadow: deque[tuple[int, list[int]]],  # (index in tokens where the proposal starts, the whole proposal)
    tokens: list[int],  # the request's committed tokens
) -> None:
    """Score each whole proposal, cut or not, once the target's own continuation covers it: position j counts as
    accepted while the draft matches what the target committed. That is greedy verification's verdict exactly
    (and sample-match's), so positions a policy did not verify still teach the estimator; without that, an
    estimate that once fell below the cost of verifying could never recover."""
    while shadow:
        start, proposed = shadow[0]
        actual = tokens[start : start + len(proposed)]
        if len(actual) < len(proposed):
            return
        shadow.popleft()
        matched = next((j for j, (x, y) in enumerate(zip(proposed, actual)) if x != y), len(proposed))
        estimator.update(drafter, request_id, len(proposed), matched)


def conditional(draft: Draft, estimator: AcceptanceEstimator, drafter: str, request_id: str) -> list[float]:
    """c_1..c_k for a draft: the drafter's confidences where it gives them, else the estimator's past acceptance."""
    k = len(draft.tokens)
    if draft.confidence is not None:
        return draft.confidence.float().tolist()[:k]
    return estimator.conditional(drafter, request_id, k)

