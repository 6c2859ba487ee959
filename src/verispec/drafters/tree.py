"""EAGLE-2's dynamic draft tree (arXiv 2406.16858; code `eagle/model/cnets.py::topK_genrate`), for any drafter
that can give the draft distribution q of the next token at a node (a draft model, EAGLE, MTP, Medusa heads).

Each node's value is the product of q along its path (EAGLE-2's V, its stand-in for the probability the node is
accepted), or of calibrated q (TreeCalibration: how often nodes like it were accepted once their parent was), which
a drafter whose q is under-confident needs for its tree to reach the depth its chain does. The tree grows one depth
at a time: the `width` new nodes of highest value are expanded with their `width` most probable children each;
after `depth` levels every node is reranked by value and the best `nodes` are verified. A value never exceeds its
parent's, so that best set is a connected tree (ties go to the shallower, then the earlier node, so a parent always
ranks before its children).

Children are chosen, not sampled: the draft carries point masses (q = None), which recursive rejection sampling
verifies losslessly (verify.rejection_tree_verify), and each node's q(x) as its confidence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.config import SamplingParams, TreeConfig
from verispec.drafters.base import Draft
from verispec.errors import ConfigError
from verispec.sampling import probs_for


def node_q(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [F, V] -> [F, V] fp32
    """The draft distribution at a node, which ranks its children (and is the q a sampled chain draws from): the
    request's processed q, or the plain softmax at temperature 0."""
    return logits.float().softmax(dim=-1) if params.greedy else probs_for(logits, params)


class TreeCalibration:
    """Online P(a node is accepted | its parent was), by the node's q and its rank among its siblings, learnt from
    verified trees and chains (a chain's node is its parent's only, rank-0 child): EAGLE-2's values multiply q, which
    for the zoo's EAGLE-3, MTP and Medusa drafters is far below their top-1 tokens' acceptance (their chains of 8 commit
    6.9-7.25 tokens a round), so the deep nodes of the likely path lost to siblings near the root and the trees
    stayed shallow, and the dspark rule, reading raw q as a chain's c, cut chains it should have kept
    (reports/trees). Ranking and cutting only: which nodes are drafted never changes what verification accepts."""

    def __init__(self, bins: int = 10, ranks: int = 3, strength: float = 4.0) -> None:
        self.bins, self.ranks, self.strength = bins, ranks, strength
        # [rank][bin] counts as Python floats: read for every node a tree grows (a tensor element read cost 7.8 us)
        self.reached = [[0.0] * bins for _ in range(ranks)]
        self.accepted = [[0.0] * bins for _ in range(ranks)]
        # per sequence: its last draft and each node's q, until its round is verified
        self.pending: dict[int, tuple[Draft, list[float]]] = {}

    def proposed(self, seq_id: int, draft: Draft, q: list[float]) -> None:
        """A drafter's draft for a sequence and each node's draft probability, to learn from once verified."""
        self.pending[seq_id] = (draft, q)

    def verified(self, seq_id: int, committed: list[int]) -> None:
        """The tokens the sequence's round committed: learn from its last tree, if it drafted one."""
        pending = self.pending.pop(seq_id, None)
        if pending is not None:
            self.learn(*pending, committed)

    def _cell(self, q: float, rank: int) -> tuple[int, int]:
        return min(rank, self.ranks - 1), min(int(q * self.bins), self.bins - 1)

    def __call__(self, q: float, rank: int) -> float:
        """Calibrated acceptance of a node with draft probability q, the rank-th most probable of its siblings:
        the past acceptance of its cell, shrunk toward q while the cell has few observations."""
        r, b = self._cell(q, rank)
        return (self.accepted[r][b] + self.strength * q) / (self.reached[r][b] + self.strength)

    def learn(self, draft: Draft, q: list[float], committed: list[int]) -> None:
        """One verified draft (q: each node's draft probability): from the anchor down the accepted path, every
        child of a reached node was reached, and the one whose token the target committed was accepted."""
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(draft.node_parents):
            children.setdefault(parent, []).append(i)
        node = -1
        for token in committed:
            kids = sorted(children.get(node, []), key=lambda i: -q[i])
            match = None
            for rank, i in enumerate(kids):
                r, b = self._cell(q[i], rank)
                self.reached[r][b] += 1
                if draft.tokens[i] == token and match is None:
                    self.accepted[r][b] += 1
                    match = i
            if match is None:
                return
            node = match


@dataclass(frozen=True)
class TreeNode:
    token: int
    parent: int  # index in DynamicTree.nodes, -1 = the anchor
    depth: int  # 1 for a child of the anchor
    value: float  # product of c along the path, the node included
    prob: float  # q(token | its path)
    c: float  # its estimated P(accepted | parent accepted): calibrated q where calibrating, else q


class DynamicTree:
    """One request's tree under construction. The drafter alternates `grow` (given the next-token distributions of
    the last frontier, -1 = the anchor) with running its model over the frontier `grow` returns, then calls
    `draft()`."""

    def __init__(self, config: TreeConfig, max_nodes: int, calibration: TreeCalibration | None = None) -> None:
        self.width, self.max_depth, self.max_nodes = config.width, config.depth, max_nodes
        self.calibration = calibration  # values multiply calibrated q where given (see TreeCalibration)
        self.nodes: list[TreeNode] = []

    def grow(
        self,
        frontier: list[int],  # [F] nodes the distributions belong to (-1 = the anchor), as the last grow returned
        probs: torch.Tensor,  # [F, V] q of the token after each of them
    ) -> list[int]:  # the next frontier: new nodes to run the drafter over (empty once the tree is deep enough)
        """Add the top-`width` children of every frontier node; return the `width` best new nodes, leaving out any
        that cannot make the final `max_nodes` (its value is already below that many others')."""
        top_p, top_x = probs.float().topk(min(self.width, probs.shape[-1]), dim=-1)
        new, depth = [], 0
        for parent, ps, xs in zip(frontier, top_p.tolist(), top_x.tolist()):
            base, depth = (1.0, 1) if parent < 0 else (self.nodes[parent].value, self.nodes[parent].depth + 1)
            for rank, (p, x) in enumerate(zip(ps, xs)):
                if p > 0:  # a token q rules out is never worth verifying
                    c = p if self.calibration is None else self.calibration(p, rank)
                    self.nodes.append(TreeNode(x, parent, depth, base * c, p, c))
                    new.append(len(self.nodes) - 1)
        if depth >= self.max_depth or not new:
            return []
        place = {i: r for r, i in enumerate(sorted(range(len(self.nodes)), key=self._rank))}
        return [i for i in sorted(new, key=self._rank)[: self.width] if place[i] < self.max_nodes]

    def _rank(self, i: int) -> tuple[float, int, int]:
        node = self.nodes[i]
        return (-node.value, node.depth, i)

    def path(self, i: int) -> list[int]:
        """Node i's ancestors and itself, root first."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def _kept(self) -> list[int]:
        """The best `max_nodes` nodes by value (a connected tree), in the order they were added (parents first;
        siblings by falling q, the order rejection sampling tries them in)."""
        chosen: set[int] = set()
        for i in sorted(range(len(self.nodes)), key=self._rank):
            if len(chosen) == self.max_nodes:
                break
            if self.nodes[i].parent < 0 or self.nodes[i].parent in chosen:
                chosen.add(i)
        return sorted(chosen)

    def draft(self) -> Draft:
        """The kept nodes as a draft of point masses; each node's confidence is its c (what the dspark rule
        multiplies along paths)."""
        keep = self._kept()
        index = {i: j for j, i in enumerate(keep)}
        nodes = [self.nodes[i] for i in keep]
        return Draft(
            [n.token for n in nodes],
            confidence=torch.tensor([n.c for n in nodes]),
            parents=tuple(-1 if n.parent < 0 else index[n.parent] for n in nodes),
        )

    def q(self) -> list[float]:
        """The draft probability of each node `draft()` keeps, in its order (TreeCalibration learns by it)."""
        return [self.nodes[i].prob for i in self._kept()]


def frontier_mask(
    tree: DynamicTree, frontier: list[int], rows: dict[int, int], length: int, committed: int,
) -> torch.Tensor:  # [F, length + F] bool
    """The attention mask of a frontier's entries written after `length` cache rows, the first `committed` of them
    committed tokens: each node sees those, its ancestors' rows (fed at earlier depths) and itself. Records in
    `rows` the row each frontier node's key takes."""
    mask = torch.zeros(len(frontier), length + len(frontier), dtype=torch.bool)
    mask[:, :committed] = True
    for f, node in enumerate(frontier):
        for a in tree.path(node)[:-1]:
            mask[f, rows[a]] = True
        mask[f, length + f] = True
        rows[node] = length + f
    return mask


TREE_OPTIONS = ("tree", "width", "depth", "nodes", "rank")


def tree_config(options: dict[str, str], who: str) -> TreeConfig:
    """A TreeConfig from a structured spec's tree options (popped from `options`), TreeConfig's defaults filling
    the rest."""
    values: dict[str, object] = {}
    if "tree" in options:
        values["mode"] = options.pop("tree")
    if "rank" in options:
        values["rank"] = options.pop("rank")
    for key in ("width", "depth", "nodes"):
        if key in options:
            try:
                values[key] = int(options.pop(key))
            except ValueError:
                raise ConfigError(f"{who} option {key}: expected an integer") from None
    return TreeConfig(**values)
