"""Medusa heads (arXiv 2401.10774): K residual heads on the target's last hidden state, head k predicting the token
k + 1 places after the one the target's own head predicts.

    x_j = norm_target(h^L_j)                     (what the target's LM head reads at position j)
    q_k(x_{j+1+k}) = softmax(lm_head(x_j + SiLU(W_k x_j + b_k)))     k = 1..K

The heads share the target's LM head (Medusa-1 gives each head a copy of it; sharing keeps a head at d^2 + d
parameters and is what a CPU can afford). The target's verify forward already computes h^L at the last accepted
position, so drafting costs K small matmuls and K head rows, and needs no cache of its own.

The static tree (`MedusaConfig.tree`) is Medusa's sparse tree: paths of per-head ranks, (0,) the first head's
best token, (0, 1) the second head's second best after it, ranked by the product of the heads' measured top-rank
accuracies (training's held-out set) and kept while they fit the node budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.errors import ConfigError


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4
    target_layer: int = 8  # the last decoder layer's output (HF `hidden_states` index)
    tree: tuple[tuple[int, ...], ...] = ()  # static tree paths, best first (parents before children)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", tuple(tuple(int(r) for r in p) for p in self.tree))
        if self.num_heads < 1:
            raise ConfigError(f"medusa needs at least one head, got {self.num_heads}")
        seen: set[tuple[int, ...]] = set()
        for path in self.tree:
            if not path or len(path) > self.num_heads or min(path) < 0:
                raise ConfigError(f"medusa tree path {path}: 1..{self.num_heads} ranks >= 0")
            if len(path) > 1 and path[:-1] not in seen:
                raise ConfigError(f"medusa tree path {path} comes before its parent {path[:-1]}")
            seen.add(path)

    def to_dict(self) -> dict:
        return {"num_heads": self.num_heads, "target_layer": self.target_layer, "tree": [list(p) for p in self.tree]}


class MedusaHeads(nn.Module):
    def __init__(self, target_cfg: ModelConfig, cfg: MedusaConfig) -> None:
        super().__init__()
        self.config, self.target_config = cfg, target_cfg
        d = target_cfg.hidden_size
        self.heads = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.num_heads))
        for head in self.heads:  # each starts as the identity: q_k = the target's next-token distribution
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def states(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] normed -> [..., K, d]
        """Every head's state x + SiLU(W_k x + b_k)."""
        return torch.stack([x + F.silu(head(x)) for head in self.heads], dim=-2)


def sparse_tree(accuracy: list[list[float]], nodes: int) -> tuple[tuple[int, ...], ...]:
    """Medusa's sparse tree: the `nodes` rank paths of highest expected acceptance, the product of
    accuracy[k][r] (head k's top-r rate, r-th best alone) along the path, parents before children."""
    import heapq

    out: list[tuple[int, ...]] = []
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    while heap and len(out) < nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < len(accuracy):  # children can only be worth less: they enter the heap after their parent
            for r, a in enumerate(accuracy[len(path)]):
                heapq.heappush(heap, (neg * a, (*path, r)))
    return tuple(out)
