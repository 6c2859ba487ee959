"""Verification policies: how many of each request's draft tokens the target verifies this step.

- off: none (plain decoding). fixed: the request's k. batch-table: k looked up by the number of running
  requests (vLLM's and TensorRT-LLM's static schedule).
- dspark: DSpark's Algorithm 1. Every (request, position) is ranked by its prefix-survival probability
  a_j = prod_{i<=j} c_i and admitted in that order while the expected throughput tau * SPS(B) still grows; the
  first admission that does not raise it stops the search. That early stop is what keeps sampling lossless: a
  position's admission never depends on its own token (see algorithms.md §1.5, DSpark appendix A). A draft tree's
  nodes are ranked the same way by their path survival (c of the node and of each ancestor), so each request
  verifies a subtree: nodes admitted parents first, per node budgets over every request in the step.

The c of a node drawn from q (a draft with q rows) must never depend on that node's own token, only on what precedes
it: the drafter's confidence head (if it has one) estimates acceptance before x_j is drawn, the feature and Medusa
drafters report q's top probability, and the online estimate below uses past rounds. A node's admission never reads
its own descendants (they rank after it), so c may depend on its ancestors' and siblings' tokens. Point-mass nodes
(no q rows: a greedy draft, a tree's top-k children) are chosen from the drafter's state alone, so which of them are
verified may depend on anything the drafter computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from verispec.drafters.base import Draft


def survival(conditional: Sequence[float], parents: Sequence[int] | None = None) -> list[float]:
    """a_n = c_n * a_parent(n): the probability that node n and every node on its path are accepted (a chain,
    parents None: a_j = prod_{i<=j} c_i)."""
    out: list[float] = []
    for n, c in enumerate(conditional):
        parent = n - 1 if parents is None else parents[n]
        out.append(min(max(float(c), 0.0), 1.0) * (out[parent] if parent >= 0 else 1.0))
    return out


def expected_tokens(draft: Draft, conditional: Sequence[float]) -> float:
    """The tokens a round verifying `draft` commits on average: its accepted nodes' survivals, plus the token the
    target adds after them."""
    return 1 + sum(survival(conditional, draft.parents))


def dspark_nodes(
    survivals: Sequence[Sequence[float]],  # per request, a per node (never above its parent's)
    depths: Sequence[Sequence[int]],  # per request, each node's depth (1: a child of the anchor)
    base_tokens: int,  # rows the step verifies anyway: every request's anchor, other requests' drafts, prefill
    base_tau: float,  # tokens the step commits anyway (one per decoding request, plus others' expected accepts)
    step_time: Callable[[int], float],  # seconds for a step that verifies B tokens, its drafting included
) -> list[list[int]]:
    """Algorithm 1 with the early stop over draft nodes: per request the nodes to verify, ascending. Nodes are
    admitted by falling survival, shallower first on ties, so a node's parent always comes before it (a chain's
    admitted nodes are a prefix)."""
    items = sorted(
        ((a, depth, n, r) for r, (surv, dep) in enumerate(zip(survivals, depths))
         for n, (a, depth) in enumerate(zip(surv, dep)) if a > 0),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    admitted: list[list[int]] = [[] for _ in survivals]
    best_count = [0] * len(survivals)
    tokens, tau = base_tokens, base_tau
    best = tau / step_time(tokens)
    for a, _, n, r in items:
        admitted[r].append(n)
        tokens += 1
        tau += a
        theta = tau / step_time(tokens)
        if theta <= best:
            break
        best, best_count = theta, [len(x) for x in admitted]
    return [sorted(x[:c]) for x, c in zip(admitted, best_count)]


def dspark_lengths(
    survivals: Sequence[Sequence[float]],  # per request, a_1..a_k (non-increasing)
    base_tokens: int,
    base_tau: float,
    step_time: Callable[[int], float],
) -> list[int]:
    """dspark_nodes over chains: the number of draft tokens to verify per request."""
    depths = [range(1, len(s) + 1) for s in survivals]
    return [len(x) for x in dspark_nodes(survivals, depths, base_tokens, base_tau, step_time)]


def dspark_cut(
    scheduled: Sequence[Draft],  # the drafts the rule cuts
    scheduled_c: Sequence[Sequence[float]],  # their c per node (conditional, see `conditional`)
    fixed: Sequence[tuple[Draft, Sequence[float]]],  # every other decoding request's draft and c, verified whole
    prefill_tokens: int,  # prompt rows the step runs besides
    step_time: Callable[[int], float],  # seconds for a step that verifies B tokens, its drafting included
) -> list[Draft]:
    """The dspark policy for one step, shared by the reference loop (one request, nothing fixed) and the engine:
    each scheduled draft cut to the nodes Algorithm 1 verifies (`dspark_nodes` over their survivals, with every
    anchor, the fixed requests' drafts and the prefill rows verified anyway): a chain to a prefix, a tree to a
    subtree."""
    base_tokens = prefill_tokens + sum(len(d.tokens) + 1 for d, _ in fixed) + len(scheduled)
    base_tau = sum(expected_tokens(d, c) for d, c in fixed) + len(scheduled)
    nodes = dspark_nodes([survival(c, d.parents) for d, c in zip(scheduled, scheduled_c)],
                         [d.node_depths for d in scheduled], base_tokens, base_tau, step_time)
    return [d.keep(n) for d, n in zip(scheduled, nodes)]


class AcceptanceEstimator:
    """Online P(position j accepted | positions before it accepted), per drafter and draft kind (`Draft.kind`), and
    per request.

    A request's estimate shrinks toward its drafter's (engine-wide) estimate for the same kind, which shrinks toward
    `prior`.
    """

    def __init__(self, max_k: int, prior: float = 0.5, strength: float = 4.0) -> None:
        self.max_k = max(max_k, 1)
        self.prior, self.strength = prior, strength
        # host lists, not tensors: a round's update and estimate are a few dozen additions (tensors cost ~35 us)
        self._global: dict[tuple[str, str | None], tuple[list[float], list[float]]] = {}  # (drafter, kind) -> [k] x2
        self._local: dict[str, dict[str | None, tuple[list[float], list[float]]]] = {}  # request id -> kind -> same

    def _counts(self, table: dict, key) -> tuple[list[float], list[float]]:
        if key not in table:
            table[key] = ([0.0] * self.max_k, [0.0] * self.max_k)
        return table[key]

    def update(self, drafter: str, request_id: str, num_draft: int, num_accepted: int, kind: str | None = None) -> None:
        """One verified round: positions 1..num_accepted+1 were reached (at most num_draft), 1..num_accepted passed."""
        reached_to = min(num_accepted + 1, num_draft, self.max_k)
        passed_to = min(num_accepted, self.max_k)
        local = self._local.setdefault(request_id, {})
        for reached, accepted in (self._counts(self._global, (drafter, kind)), self._counts(local, kind)):
            for j in range(reached_to):
                reached[j] += 1.0
            for j in range(passed_to):
                accepted[j] += 1.0

    def conditional(self, drafter: str, request_id: str, k: int, kind: str | None = None) -> list[float]:
        g_reached, g_acc = self._counts(self._global, (drafter, kind))
        pseudo = self.strength * self.prior
        out = [(a + pseudo) / (r + self.strength) for r, a in zip(g_reached, g_acc)]
        local = self._local.get(request_id)
        if local is not None and kind in local:
            r_reached, r_acc = local[kind]
            out = [(a + self.strength * g) / (r + self.strength) for r, a, g in zip(r_reached, r_acc, out)]
        return (out + [out[-1]] * k)[:k]

    def forget(self, request_id: str) -> None:
        self._local.pop(request_id, None)

    def tracked(self) -> list[str]:
        """Request ids with a per-request estimate (forgotten when the request finishes)."""
        return list(self._local)


def learn_from_proposals(
    estimator: AcceptanceEstimator, drafter: str, request_id: str,
    shadow: deque[tuple[int, list[int], str | None]],  # (index in tokens where it starts, whole proposal, its kind)
    tokens: list[int],  # the request's committed tokens
) -> None:
    """Score each whole proposal, cut or not, once the target's own continuation covers it: position j counts as
    accepted while the draft matches what the target committed. That is greedy verification's verdict exactly
    (and sample-match's), so positions a policy did not verify still teach the estimator; without that, an
    estimate that once fell below the cost of verifying could never recover."""
    while shadow:
        start, proposed, kind = shadow[0]
        actual = tokens[start : start + len(proposed)]
        if len(actual) < len(proposed):
            return
        shadow.popleft()
        matched = next((j for j, (x, y) in enumerate(zip(proposed, actual)) if x != y), len(proposed))
        estimator.update(drafter, request_id, len(proposed), matched, kind)


def conditional(draft: Draft, estimator: AcceptanceEstimator, drafter: str, request_id: str) -> list[float]:
    """c per node of a draft: the drafter's confidences where it gives them, else the estimator's past acceptance
    at the node's depth, for drafts of the same kind."""
    k = len(draft.tokens)
    if draft.confidence is not None:
        return draft.confidence.float().tolist()[:k]
    if draft.is_chain:
        return estimator.conditional(drafter, request_id, k, draft.kind)
    by_depth = estimator.conditional(drafter, request_id, draft.depth, draft.kind)
    return [by_depth[d - 1] for d in draft.node_depths]

