"""Speculation statistics, named as vLLM names them so dashboards carry over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    num_drafts: int = 0  # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # accepted draft tokens that were also emitted (none after a stop)
    accepted_per_pos: list[int] = field(default_factory=list)  # [j] = rounds whose position (a tree's depth) j+1
    # was accepted
    num_rounds: int = 0  # target forwards after the prefill, drafted or not
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    elapsed_s: float = 0.0
    draft_s: float = 0.0  # of elapsed_s, time inside the drafter (propose, observe, accept): the rest is the target
    prefill_s: float = 0.0  # of elapsed_s, the target's forward over the prompt (the same with or without a drafter)

    @property
    def decode_s(self) -> float:
        """elapsed_s after the target's prefill: what speculation can speed up (drafter's prompt pass included)."""
        return self.elapsed_s - self.prefill_s

    def record_round(self, num_draft: int, num_accepted: int, num_emitted: int, depth: int | None = None) -> None:
        """One verification round: `num_emitted` tokens were kept after stop checks (<= num_accepted + 1). A tree
        draft of `num_draft` nodes has `depth` positions (a chain: num_draft); its accepted path counts per depth."""
        self.num_rounds += 1
        self.num_output_tokens += num_emitted
        if num_draft == 0:
            return
        counted = min(num_accepted, num_emitted)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += counted
        positions = num_draft if depth is None else depth
        if len(self.accepted_per_pos) < positions:
            self.accepted_per_pos.extend([0] * (positions - len(self.accepted_per_pos)))
        for j in range(counted):
            self.accepted_per_pos[j] += 1

    def add(self, other: SpecStats) -> None:
        """Sum another generation's counters and times into these (per-position counts aligned; ttft_s kept)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_output_tokens += other.num_output_tokens
        self.num_rounds += other.num_rounds
        self.elapsed_s += other.elapsed_s
        self.draft_s += other.draft_s
        self.prefill_s += other.prefill_s
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for j, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[j] += a

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per drafted round, bonus/recovered token included."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2:
            return 0.0
        return (self.elapsed_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "tokens_per_s": self.tokens_per_s,
            "num_rounds": self.num_rounds,
            "num_output_tokens": self.num_output_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "elapsed_s": self.elapsed_s,
            "draft_s": self.draft_s,
        }
