"""Verification rules: pure, batched tensor functions with no model calls.

Vocabulary (Leviathan et al.): p is the target distribution, q the draft distribution. For each request the
drafter proposed k draft tokens x_1..x_k and the target scored k + 1 positions in one forward pass (the anchor
and every draft token), giving p_1..p_{k+1}. Verification returns the committed tokens of each request:

- accepted: the leading draft tokens that survive;
- recovered: at the first rejection, a token drawn from the residual norm(max(0, p_j - q_j)) (greedy: argmax p_j);
- bonus: after a fully accepted draft, a token drawn from p_{k+1}.

So a request always commits num_accepted + 1 tokens. Ragged batches are flattened: request b owns k_b draft
rows and k_b + 1 target rows, stored back to back in request order. Outputs are padded with
PLACEHOLDER_TOKEN_ID.

Trees: a draft may also be a tree of N nodes (node i continues its parent's path, -1 = the anchor; parents before
children), scored in one forward with a tree attention mask: target row 0 is the anchor, row i + 1 node i. Each
node's q row is the distribution it was drawn from given its path (None: point masses, as for chains). A tree
commits the tokens of its accepted path (node indices root to leaf) plus one recovered or bonus token:
- greedy_tree_verify: the deepest path of nodes equal to the argmax at their parent (one request);
- rejection_tree_verify: recursive rejection sampling over siblings (SpecInfer's multi-step speculative sampling;
  EAGLE's evaluate_posterior for point masses), batched over ragged trees like the chain rules.

Three rules:
- greedy_verify: accept while x_j == argmax p_j (temperature 0).
- sample_match_verify: draw y_j ~ p_j, accept while x_j == y_j; needs no q, lossless, lower acceptance at T > 0.
- rejection_verify: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)). q=None means a point-mass draft
  (n-gram, argmax drafters): q_j is one-hot at x_j, so acceptance is p_j(x_j) and the residual is p_j with x_j
  removed. Lossless for any q as long as q is exactly the distribution x_j was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.config import SamplingParams
from verispec.sampling import greedy, greedy_ids, probs_for, sample

PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class VerifyOutput:
    tokens: torch.Tensor  # [B, K+1] committed tokens, PLACEHOLDER_TOKEN_ID after the last one
    num_accepted: torch.Tensor  # [B] accepted draft tokens per request, 0..k_b

    @property
    def num_committed(self) -> torch.Tensor:  # [B]
        return self.num_accepted + 1

    def rows(self) -> list[list[int]]:
        """Committed token ids per request (one host transfer)."""
        counts = self.num_committed.tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), counts)]


@dataclass(frozen=True)
class _Layout:
    """Index maps from the flattened ragged layout to a padded [B, K(+1)] layout."""

    target_index: torch.Tensor  # [B, K+1] rows of the target tensor (clamped where invalid)
    target_valid: torch.Tensor  # [B, K+1] j <= k_b
    draft_index: torch.Tensor  # [B, K] rows of the draft tensor (clamped where invalid)
    draft_valid: torch.Tensor  # [B, K] j < k_b

    @staticmethod
    def build(num_draft: torch.Tensor, num_target_rows: int) -> _Layout:
        num_draft = num_draft.long()
        max_k = int(num_draft.max()) if num_draft.numel() else 0
        j = torch.arange(max_k + 1, device=num_draft.device)
        target_start = torch.cumsum(num_draft + 1, 0) - (num_draft + 1)
        draft_start = torch.cumsum(num_draft, 0) - num_draft
        target_index = (target_start[:, None] + j[None]).clamp(max=max(num_target_rows - 1, 0))
        num_draft_rows = int(num_draft.sum())
        draft_index = (draft_start[:, None] + j[None, :max_k]).clamp(max=max(num_draft_rows - 1, 0))
        return _Layout(
            target_index=target_index,
            target_valid=j[None] <= num_draft[:, None],
            draft_index=draft_index,
            draft_valid=j[None, :max_k] < num_draft[:, None],
        )


def _padded_drafts(draft_tokens: torch.Tensor, layout: _Layout) -> torch.Tensor:  # [B, K]
    if draft_tokens.numel() == 0:
        return torch.full(layout.draft_valid.shape, PLACEHOLDER_TOKEN_ID, dtype=torch.long,
                          device=layout.draft_valid.device)
    d = draft_tokens.long()[layout.draft_index]
    return d.masked_fill(~layout.draft_valid, PLACEHOLDER_TOKEN_ID)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] count of leading True
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    return mask.long().cumprod(dim=1).sum(dim=1)


def _commit(accepted_prefix: torch.Tensor, final: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Rows of [x_1..x_a, final, PLACEHOLDER...]. accepted_prefix: [B, K]; final, num_accepted: [B]."""
    batch, max_k = accepted_prefix.shape
    j = torch.arange(max_k + 1, device=final.device)[None]
    padded = torch.cat([accepted_prefix, accepted_prefix.new_zeros(batch, 1)], dim=1)
    out = torch.where(j < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    return torch.where(j == num_accepted[:, None], final[:, None], out)


def greedy_commit_rows(
    drafts: Sequence[Sequence[int]],  # [B] each request's draft tokens
    target_logits: torch.Tensor,  # [sum(k_b + 1), V] each request's rows (anchor, drafts) back to back
) -> list[list[int]]:  # [B] committed tokens: the accepted drafts, then the target's token after them
    """greedy_verify's rule on host lists, for callers that want lists: one argmax over every row and one host
    transfer, where the padded tensor layout costs more than the comparisons (the plain engine at one request ran
    at 0.93-0.95x the library's speed through the layout, 0.99-1.00x through this, Zen 5)."""
    best = greedy_ids(target_logits)
    out, at = [], 0
    for draft in drafts:
        k = len(draft)
        a = next((j for j in range(k) if draft[j] != best[at + j]), k)
        out.append([*draft[:a], best[at + a]])
        at += k + 1
    if at != len(best):
        raise ValueError(f"greedy verification: {len(best)} target rows for drafts needing {at}")
    return out


def greedy_verify(
    draft_tokens: torch.Tensor,  # [N] all requests' draft tokens, flattened
    num_draft: torch.Tensor,  # [B] k_b per request, sum = N
    target_logits: torch.Tensor,  # [N + B, V]
) -> VerifyOutput:
    if num_draft.numel() == 1:  # one request (a reference-loop round): the same rule on host lists, where a
        # handful of small tensor ops cost more than the comparison (a round's verify, 8 drafts: 0.22 -> 0.17 ms)
        drafts = draft_tokens.tolist()  # [k]
        k = len(drafts)
        row = greedy_commit_rows([drafts], target_logits)[0]
        a = len(row) - 1
        device = target_logits.device
        return VerifyOutput(torch.tensor([row + [PLACEHOLDER_TOKEN_ID] * (k - a)], device=device),
                            torch.tensor([a], device=device))
    layout = _Layout.build(num_draft, target_logits.shape[0])
    target_argmax = greedy(target_logits)[layout.target_index]  # [B, K+1]
    drafts = _padded_drafts(draft_tokens, layout)
    num_accepted = _leading_true((drafts == target_argmax[:, :-1]) & layout.draft_valid)
    final = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyOutput(_commit(drafts, final, num_accepted), num_accepted)


def _per_row(generators: Sequence[torch.Generator | None], batch: int) -> Sequence[torch.Generator | None]:
    if len(generators) != batch:
        raise ValueError(f"need one generator per request: got {len(generators)} for a batch of {batch}")
    return generators


def sample_match_verify(
    draft_tokens: torch.Tensor,  # [N]
    num_draft: torch.Tensor,  # [B]
    target_probs: torch.Tensor,  # [N + B, V] processed target distributions
    generators: Sequence[torch.Generator | None],  # [B]
) -> VerifyOutput:
    layout = _Layout.build(num_draft, target_probs.shape[0])
    batch, width = layout.target_index.shape
    ks = num_draft.tolist()
    samples = torch.zeros(batch, width, dtype=torch.long, device=target_probs.device)
    for b, g in enumerate(_per_row(generators, batch)):
        # Each request draws exactly (k_b + 1) x V noise: its tokens never depend on the rest of the batch.
        samples[b, : ks[b] + 1] = sample(target_probs[layout.target_index[b, : ks[b] + 1]], g)
    drafts = _padded_drafts(draft_tokens, layout)
    num_accepted = _leading_true((drafts == samples[:, :-1]) & layout.draft_valid)
    final = samples.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyOutput(_commit(drafts, final, num_accepted), num_accepted)


def rejection_verify(
    draft_tokens: torch.Tensor,  # [N]
    num_draft: torch.Tensor,  # [B]
    target_probs: torch.Tensor,  # [N + B, V] processed target distributions p
    draft_probs: torch.Tensor | None,  # [N, V] the q each draft token was drawn from; None = point mass
    generators: Sequence[torch.Generator | None],  # [B]
) -> VerifyOutput:
    layout = _Layout.build(num_draft, target_probs.shape[0])
    batch, width = layout.target_index.shape
    vocab = target_probs.shape[-1]
    drafts = _padded_drafts(draft_tokens, layout)  # [B, K]
    safe_drafts = drafts.clamp(min=0)
    p = target_probs.float()[layout.target_index]  # [B, K+1, V]
    if draft_probs is None:
        q = torch.nn.functional.one_hot(safe_drafts, vocab).float()  # [B, K, V]
    elif draft_probs.shape[0] == 0:
        q = p.new_zeros(batch, width - 1, vocab)
    else:
        q = draft_probs.float()[layout.draft_index]
    p_x = p[:, :-1].gather(2, safe_drafts[..., None]).squeeze(2)  # [B, K]
    q_x = q.gather(2, safe_drafts[..., None]).squeeze(2)
    accept_prob = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.zeros_like(p_x)).clamp(max=1.0)

    ks = num_draft.tolist()
    uniforms = torch.ones(batch, width - 1, device=p.device)  # 1.0 never accepts (u < accept_prob <= 1)
    for b, g in enumerate(_per_row(generators, batch)):
        uniforms[b, : ks[b]] = torch.rand(ks[b], generator=g, device=p.device)
    num_accepted = _leading_true((uniforms < accept_prob) & layout.draft_valid)

    # Final token: from the residual at the first rejection, or the bonus from p_{k+1}.
    rows = torch.arange(batch, device=p.device)
    p_final = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft.to(p.device)
    q_final = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)[rows, num_accepted]
    residual = (p_final - q_final).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A zero residual only happens through rounding when p == q; p itself is then the right distribution.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_final)
    final_probs = torch.where(rejected[:, None], residual, p_final)
    final = torch.stack([sample(final_probs[b : b + 1], g)[0] for b, g in enumerate(generators)])
    return VerifyOutput(_commit(drafts, final, num_accepted), num_accepted)


def greedy_tree_verify(
    draft_tokens: torch.Tensor,  # [N] one request's draft tree, nodes in topological order
    parents: torch.Tensor,  # [N] each node's parent index, -1 for a child of the anchor
    target_logits: torch.Tensor,  # [N + 1, V] row 0 the anchor, row i + 1 node i (given its root path)
) -> tuple[VerifyOutput, torch.Tensor]:  # (committed tokens [1, D + 1], accepted path: node indices [a])
    """Greedy verification of one tree: node i is accepted when its parent is and x_i == argmax p at the parent.
    Commits the deepest accepted path (the first such node in order on a tie) plus the argmax after its last node.
    D is the tree's depth; VerifyOutput pads the row with PLACEHOLDER_TOKEN_ID as for chains.

    Example: parents [-1, -1, 1], tokens [7, 5, 9], argmax at the anchor 5 and at node 1 9: nodes 1 and 2 are
    accepted (node 0 is not), so the path is [1, 2] and the commit [5, 9, argmax at node 2].
    """
    best, tokens, par = greedy(target_logits).tolist(), draft_tokens.tolist(), parents.tolist()
    depth = [0] * len(tokens)  # accepted depth of each node, 0 = rejected
    for i, (x, p) in enumerate(zip(tokens, par)):
        if (p < 0 or depth[p]) and x == best[p + 1]:
            depth[i] = 1 + (depth[p] if p >= 0 else 0)
    path: list[int] = []
    node = max(range(len(tokens)), key=lambda i: (depth[i], -i), default=-1)
    while node >= 0 and depth[node]:
        path.append(node)
        node = par[node]
    path.reverse()
    final = best[path[-1] + 1 if path else 0]
    row = [tokens[i] for i in path] + [final] + [PLACEHOLDER_TOKEN_ID] * (_tree_depth(par) - len(path))
    device = target_logits.device
    return (VerifyOutput(torch.tensor([row], device=device), torch.tensor([len(path)], device=device)),
            torch.tensor(path, dtype=torch.long, device=device))


def _tree_depth(parents: list[int]) -> int:
    depth: list[int] = []
    for p in parents:
        depth.append(1 + (depth[p] if p >= 0 else 0))
    return max(depth, default=0)


def _sibling_residual(
    p: torch.Tensor,  # [B, V] the distribution node x was just tested against
    q: torch.Tensor | None,  # [B, V] the q x was drawn from; None = a point mass at x
    x: torch.Tensor,  # [B] the rejected tokens
) -> torch.Tensor:  # [B, V]
    """What x's next sibling (or, after the last one, the recovered token) is tested against once x was rejected:
    the residual norm(max(0, p - q)). For a point mass that is p with x removed. Where the residual has no mass
    (p == q up to rounding), p itself, as the chain rule does."""
    if q is None:
        residual = p.scatter(1, x[:, None], 0.0)
    else:
        residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def rejection_tree_verify(
    draft_tokens: torch.Tensor,  # [N] every request's tree nodes, flattened, each tree in topological order
    parents: torch.Tensor,  # [N] each node's parent index within its tree, -1 = the anchor
    num_draft: torch.Tensor,  # [B] nodes per tree, sum = N
    target_probs: torch.Tensor,  # [N + B, V] processed p per tree: its anchor's row, then node i's at i + 1
    draft_probs: torch.Tensor | None,  # [N, V] the q each node was drawn from given its path; None = point masses
    generators: Sequence[torch.Generator | None],  # [B]
) -> tuple[VerifyOutput, torch.Tensor]:  # (committed [B, K+1], accepted path: node indices [B, K], padded)
    """Lossless sampling over draft trees: SpecInfer's multi-step speculative sampling (Miao et al., "SpecInfer:
    Accelerating Large Language Model Serving with Tree-based Speculative Inference and Verification", ASPLOS 2024,
    arXiv 2305.09781: token tree verification), which EAGLE's `evaluate_posterior` runs for point masses.

    From the anchor, with p = p(anchor): try the current node's children in index order, child x with probability
    min(1, p(x) / q(x)). On acceptance move to x and restart from p = p(x); on rejection set p <- norm(max(0, p - q))
    and try the next sibling. When no child is left, draw the last token from p: the residual after the rejected
    siblings (recovered), or p at an accepted leaf (bonus). Lossless when each node's q is the distribution it was
    drawn from independently of its earlier siblings (i.i.d. samples from q), or for any choice of tokens made
    before verification when q is None (point masses: EAGLE-2's top-k children). Distinct siblings are not
    required: a repeated point mass has p(x) = 0 once rejected.

    Each tree draws k_b uniforms (one per node, used or not) and then its final token from its own generator, so
    its tokens never depend on the rest of the batch. Scanning nodes in index order visits the children of the
    current node in order: every child of a node comes after it.
    """
    layout = _Layout.build(num_draft, target_probs.shape[0])
    batch, width = layout.target_index.shape
    device = target_probs.device
    drafts = _padded_drafts(draft_tokens, layout)  # [B, K]
    safe = drafts.clamp(min=0)
    par = parents.long().to(device)[layout.draft_index] if parents.numel() else torch.zeros_like(drafts)
    p_all = target_probs.float()[layout.target_index]  # [B, K+1, V]
    q_all = None if draft_probs is None or draft_probs.shape[0] == 0 else draft_probs.float()[layout.draft_index]
    ks = num_draft.tolist()
    uniforms = torch.ones(batch, width - 1, device=device)  # 1.0 never accepts (u < ratio <= 1)
    for b, g in enumerate(_per_row(generators, batch)):
        uniforms[b, : ks[b]] = torch.rand(ks[b], generator=g, device=device)

    rows = torch.arange(batch, device=device)
    p = p_all[:, 0]  # [B, V] what the current node's next child is tested against
    cur = torch.full((batch,), -1, dtype=torch.long, device=device)  # the deepest accepted node, -1 = the anchor
    depth = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, width - 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    for i in range(width - 1):
        x = safe[:, i]
        q = None if q_all is None else q_all[:, i]  # [B, V]
        p_x = p.gather(1, x[:, None]).squeeze(1)
        q_x = torch.ones_like(p_x) if q is None else q.gather(1, x[:, None]).squeeze(1)
        ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-30), torch.zeros_like(p_x)).clamp(max=1.0)
        tried = layout.draft_valid[:, i] & (par[:, i] == cur)
        accept = tried & (uniforms[:, i] < ratio)
        p = torch.where((tried & ~accept)[:, None], _sibling_residual(p, q, x), p)
        p = torch.where(accept[:, None], p_all[:, i + 1], p)
        path[rows[accept], depth[accept]] = i
        depth = depth + accept.long()
        cur = torch.where(accept, i, cur)
    final = torch.stack([sample(p[b : b + 1], g)[0] for b, g in enumerate(generators)])
    accepted = drafts.gather(1, path.clamp(min=0)) if width > 1 else drafts  # [B, K] tokens along the path
    return VerifyOutput(_commit(accepted, final, depth), depth), path


def verify_tree(
    logits: torch.Tensor,  # [N+1, V] the verifier's logits at the anchor and each node (tree attention)
    tokens: list[int],  # [N] the nodes' tokens, topological order
    parents: Sequence[int],  # [N] each node's parent, -1 = the anchor
    probs: torch.Tensor | None,  # [N, V] the q each node was drawn from; None = point masses
    params: SamplingParams,
    generator: torch.Generator | None,  # the request's RNG (None when greedy)
) -> tuple[VerifyOutput, list[int]]:  # (committed [1, *], accepted path: node indices root to leaf)
    """Verify one request's draft tree: greedily at temperature 0, else by recursive rejection sampling (the rule
    for trees whatever SpecConfig.verify says: with point masses it accepts x exactly as sample-match would,
    with probability p(x), and it is lossless for soft q too)."""
    device = logits.device
    par = torch.tensor(list(parents), dtype=torch.long, device=device)
    draft = torch.tensor(tokens, dtype=torch.long, device=device)
    if params.greedy:
        out, path = greedy_tree_verify(draft, par, logits)
        return out, path.tolist()
    num_draft = torch.tensor([len(tokens)], device=device)
    out, path = rejection_tree_verify(draft, par, num_draft, probs_for(logits, params), probs, [generator])
    return out, path[0, : int(out.num_accepted[0])].tolist()


def verify_chain(
    logits: torch.Tensor,  # [k+1, V] the verifier's logits at the anchor and each draft token
    tokens: list[int],  # [k] the draft
    probs: torch.Tensor | None,  # [k, V] the q each token was drawn from; None = point masses
    params: SamplingParams,
    rule: str,  # "rejection" or "sample-match" (greedy requests verify greedily either way)
    generator: torch.Generator | None,  # the request's RNG (None when greedy)
) -> VerifyOutput:
    """Verify one request's chain draft with its rule; an empty draft is a plain decoding step (the same draw)."""
    if not tokens:
        token = greedy(logits[0]) if params.greedy else sample(probs_for(logits[0], params), generator)
        return VerifyOutput(token.view(1, 1), torch.zeros(1, dtype=torch.long))
    draft = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    num_draft = torch.tensor([len(tokens)], device=logits.device)
    if params.greedy:
        return greedy_verify(draft, num_draft, logits)
    p = probs_for(logits, params)
    if rule == "sample-match":
        return sample_match_verify(draft, num_draft, p, [generator])
    return rejection_verify(draft, num_draft, p, probs, [generator])
