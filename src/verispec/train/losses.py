"""Block-drafter training losses (DFlash / DSpark / Spec-AUF), as pure functions of logits.

A training example is a block of B positions after an anchor; the drafter predicts all of them in one pass.
Notation: draft logits z [N, B, V] (q = softmax z), labels y [N, B] (the target's tokens), mask m [N, B]
(positions that exist and are supervised), and optionally the target's distributions p [N, B, V].

- ce:        mean CE over every masked position (full block).
- ce+decay:  position k (0-based) weighted by exp(-k / gamma) (DFlash/DSpark use gamma = 4).
- auf:       CE kept only through the drafter's first predicted failure: positions up to and including the
             first k where argmax z_k != y_k (detached), nothing after it (Spec-AUF).
- auf+decay: both.
- dspark:    0.1 CE + 0.9 L1(q, p) + 1.0 BCE(c, 1 - 1/2 |q - p|_1), all with decay weights; c are the
             confidence head's probabilities [N, B].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("ce", "ce+decay", "auf", "auf+decay", "dspark")
DSPARK_WEIGHTS = (0.1, 0.9, 1.0)  # CE, L1, BCE


def decay_weights(block: int, gamma: float, device=None) -> torch.Tensor:  # [B]
    return torch.exp(-torch.arange(block, dtype=torch.float32, device=device) / gamma)


def auf_mask(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, B] bool: the masked positions up to and including the first one the drafter's argmax gets wrong."""
    err = (logits.detach().argmax(-1) != labels) & mask
    failures_before = err.long().cumsum(-1) - err.long()
    return mask & (failures_before == 0)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(1e-12)


def block_loss(
    kind: str,
    logits: torch.Tensor,  # [N, B, V] draft logits
    labels: torch.Tensor,  # [N, B] target tokens
    mask: torch.Tensor,  # [N, B] bool
    *,
    gamma: float = 4.0,
    target_probs: torch.Tensor | None = None,  # [N, B, V], needed by dspark
    confidence: torch.Tensor | None = None,  # [N, B] in (0, 1), needed by dspark
) -> torch.Tensor:
    if kind not in LOSSES:
        raise ValueError(f"unknown loss {kind!r}; choose from {LOSSES}")
    mask = mask.bool()
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    support = auf_mask(logits, labels, mask) if kind.startswith("auf") else mask
    weights = support.float()
    if kind.endswith("decay") or kind == "dspark":
        weights = weights * decay_weights(labels.shape[1], gamma, logits.device)
    if kind != "dspark":
        return _weighted_mean(ce, weights)
    if target_probs is None or confidence is None:
        raise ValueError("the dspark loss needs target_probs and confidence")
    q = logits.float().softmax(-1)
    l1 = (q - target_probs.float()).abs().sum(-1)  # [N, B]; DSpark's code has no 1/2 here
    label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)  # per-position acceptance probability 1 - TV(q, p)
    bce = F.binary_cross_entropy(confidence.float().clamp(1e-6, 1 - 1e-6), label, reduction="none")
    a_ce, a_l1, a_bce = DSPARK_WEIGHTS
    return a_ce * _weighted_mean(ce, weights) + a_l1 * _weighted_mean(l1, weights) + a_bce * _weighted_mean(bce, weights)
