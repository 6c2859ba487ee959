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
            torch.arange(s.cache.length, s.cache.length + s.length, device=device) for s in self.segments
        ])

    def advance(self) -> None:
        for s in self.segments:
            s.cache.advance(s.length)
