"""A ragged batch packed into one token axis: every request's new tokens back to back, each with its own cache.

The engine runs one target forward per step over all running requests. Linear layers see the packed rows as one
matrix; attention runs per segment against that segment's own `KVCache`, so a request's numerics do not depend
on what else is in the batch beyond matmul blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    # per segment: its own positions [T] where its mask is not causal (a draft tree's), else None
    own_positions: tuple[torch.Tensor | None, ...] = ()

    @staticmethod
    def build(
        caches: list[KVCache], lengths: list[int], device: torch.device,
        trees: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> PackedBatch:
        """Segments of `lengths` new tokens after each cache's rows, causal unless `trees[i]` gives segment i's
        (positions [T], mask [T, cache.length + T]) (a draft tree's, round.tree_inputs)."""
        segments, masks, positions, row = [], [], [], 0
        for i, (cache, n) in enumerate(zip(caches, lengths)):
            tree = trees[i] if trees is not None else None
            segments.append(Segment(cache, row, n))
            masks.append(causal_mask(cache.length, n, device) if tree is None else tree[1])
            positions.append(None if tree is None else tree[0])
            row += n
        return PackedBatch(tuple(segments), tuple(masks), tuple(positions) if trees is not None else ())

    @property
    def causal(self) -> tuple[bool, ...]:
        """Per segment: whether its mask is causal (False: a tree's, which only the torch attention honours)."""
        return tuple(p is None for p in self.own_positions) or (True,) * len(self.segments)

    @property
    def num_rows(self) -> int:
        last = self.segments[-1]
        return last.start + last.length

    def positions(self, device: torch.device) -> torch.Tensor:  # [N]
        own = self.own_positions or (None,) * len(self.segments)
        return torch.cat([
            torch.arange(s.cache.next_position, s.cache.next_position + s.length, device=device) if p is None
            else p.to(device)
            for s, p in zip(self.segments, own)
        ])

    def advance(self) -> None:
        for s in self.segments:
            s.cache.advance(s.length)
