"""A ragged batch packed into one token axis: every request's new tokens back to back, each with its own cache.

The engine runs one target forward per step over all running requests. Linear layers see the packed rows as one
matrix; attention runs per segment against that segment's own `KVCache`, so a request's numerics do not depend
on what else is in the batch beyond matmul blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.cache.kv import KVCache


@dataclass(frozen=True)
class Segment:
    cache: KVCache
    start: int  # first packed row of this request
    length: int  # new tokens of this request in the packed batch


def causal_mask(start: int, seqlen: int, device: torch.device) -> torch.Tensor | None:
    """[T, start + T] bool mask for T new tokens after `start` cached ones; None when SDPA's own flags do."""
    if start == 0 or seqlen == 1:
        return None
    rows = torch.arange(seqlen, device=device)[:, None] + start
    return torch.arange(start + seqlen, device=device)[None, :] <= rows


def tree_mask(start: int, parents: list[int], device: torch.device) -> torch.Tensor:
    """[N + 1, start + N + 1] bool mask for a tree round after `start` cached entries: row 0 the anchor, row i + 1
    node i (parent parents[i], -1 = the anchor, parents before children). Each row sees the cache, the anchor,
    its ancestors and itself. A chain's mask is causal_mask's."""
    n = len(parents)
    mask = torch.zeros(n + 1, start + n + 1, dtype=torch.bool)
    mask[:, : start + 1] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]  # the parent's row (the anchor's for p = -1) sees every ancestor already
        mask[i + 1, start + i + 1] = True
    return mask.to(device)


def tree_positions(start: int, parents: list[int], device: torch.device) -> torch.Tensor:
    """[N + 1] positions of a tree round's rows: the anchor at `start`, each node one past its parent."""
    pos = [start]
    for p in parents:
        pos.append(pos[p + 1] + 1)
    return torch.tensor(pos, device=device)


@dataclass(frozen=True)
class PackedBatch:
    segments: tuple[Segment, ...]
    masks: tuple[torch.Tensor | None, ...]  # per segment, from its cache length before the forward

    @staticmethod
    def build(caches: list[KVCache], lengths: list[int], device: torch.device) -> PackedBatch:
        segments, masks, row = [], [], 0
        for cache, n in zip(caches, lengths):
            segments.append(Segment(cache, row, n))
            masks.append(causal_mask(cache.length, n, device))
            row += n
        return PackedBatch(tuple(segments), tuple(masks))

    @property
    def num_rows(self) -> int:
        last = self.segments[-1]
        return last.start + last.length

    def positions(self, device: torch.device) -> torch.Tensor:  # [N]
        return torch.cat([
            torch.arange(s.cache.next_position, s.cache.next_position + s.length, device=device)
            for s in self.segments
        ])

    def advance(self) -> None:
        for s in self.segments:
            s.cache.advance(s.length)
