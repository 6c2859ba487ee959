"""One request's state inside the engine, and what the engine emits for it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from verispec.cache import KVCache
from verispec.config import SamplingParams, TreeConfig
from verispec.decode import GenerationResult
from verispec.metrics import SpecStats
from verispec.stopping import StopChecker


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    token_ids: list[int]  # committed this step (after stop trimming)
    text: str  # text delta
    result: GenerationResult | None = None  # set when the request finished (finish_reason "abort" if aborted)

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class Request:
    request_id: str
    seq_id: int  # the drafters' key for this sequence
    prompt: list[int]
    params: SamplingParams
    drafter: str | None  # drafter spec, None = no drafting
    policy: str
    k: int
    verify: str
    max_positions: int  # the most KV positions its cache can need (prompt + max_tokens + a draft round)
    arrival: float
    stopper: StopChecker
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # committed: prompt + output
    cache: KVCache | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    last_verified: int = 1 << 30  # draft tokens the dspark policy verified last round (unbounded at first)
    # its drafter was asked to propose in its last step: that drafter's context is current, so a proposal now costs
    # what a steady round's does (the draft gate measures only such steps)
    drafted_last: bool = False
    shadow: deque[tuple[int, list[int], str | None]] = field(default_factory=deque)  # (start, whole proposal, kind)
    tree: TreeConfig | None = None  # its draft-tree shape (RequestSpec.tree); None: the drafter's own
    preemptions: int = 0  # times its cache was freed to make room; each time it is recomputed on readmission
    # the prompt rows' hidden states its drafter read, (first position, {layer: [n, d]}) per forward, kept for the
    # prefix cache until its first round stores the prompt's blocks
    prompt_hidden: list[tuple[int, dict[int, torch.Tensor]]] = field(default_factory=list)
    # while the draft gate keeps it plain and its drafter takes context gaps: its latest anchors' rows, oldest first
    # (Engine.RESUME_ROWS at most), observed if drafting resumes: (position, a step's {layer: [n, d]}, its row there)
    resume_rows: list[tuple[int, dict[int, torch.Tensor], int]] = field(default_factory=list)

    @property
    def recomputing(self) -> bool:
        """Preempted and readmitted, its committed tokens not all back in the cache yet."""
        return self.preemptions > 0 and self.stats.num_rounds > 0 and len(self.pending) > 1

    @property
    def pending(self) -> list[int]:
        """Committed tokens the target's cache does not hold yet (the prompt before prefill, then the anchor)."""
        return self.tokens[self.cache.length :] if self.cache is not None else self.tokens
