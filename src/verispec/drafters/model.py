"""An independent small causal LM as drafter, with its own caller-owned cache per sequence."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftRequest, Verified, register_drafter
from verispec.errors import CheckpointError
from verispec.model.checkpoint import load_model
from verispec.model.transformer import Transformer
from verispec.sampling import probs_for, sample


class ModelDrafter(Drafter):
    """Drafts k tokens autoregressively: argmax at temperature 0 (point mass), else sampled from q."""

    name = "model"

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._caches: dict[int, KVCache] = {}
        self._round_start: dict[int, int] = {}  # committed length when the last draft was proposed

    def start(self, seq_id: int, prompt: list[int]) -> None:
        self._caches[seq_id] = KVCache.for_model(self.model)
        self._round_start[seq_id] = len(prompt)

    def finish(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
        self._round_start.pop(seq_id, None)

    def live_sequences(self) -> set[int]:
        return set(self._caches) | set(self._round_start)

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        cache = self._caches[seq_id]  # holds tokens it was fed; the next proposal feeds what follows them
        cache.truncate(min(cache.length, num_tokens - 1))
        self._round_start[seq_id] = min(self._round_start[seq_id], num_tokens)

    def accept(self, result: Verified) -> None:
        # The cache holds the committed tokens plus k - 1 drafted ones; drafts past the accepted prefix go.
        keep = min(self._caches[result.seq_id].length, self._round_start[result.seq_id] + result.num_accepted)
        self._caches[result.seq_id].truncate(keep)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """All requests advance together: one packed forward of the draft model per draft position."""
        budgets, pending = [], []
        for r in requests:
            cache = self._caches[r.seq_id]
            budgets.append(max(0, min(r.budget, cache.max_len - len(r.tokens))))
            pending.append(r.tokens[cache.length :])  # committed tokens the draft model has not seen yet
            if budgets[-1] > 0:
                self._round_start[r.seq_id] = len(r.tokens)
        tokens: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        device = self.model.device
        for step in range(max(budgets, default=0)):
            live = [i for i, b in enumerate(budgets) if b > step]
            batch = PackedBatch.build([self._caches[requests[i].seq_id] for i in live],
                                      [len(pending[i]) for i in live], device)
            flat = [t for i in live for t in pending[i]]
            last = torch.tensor([s.start + s.length - 1 for s in batch.segments], device=device)
            logits, _ = self.model.forward_packed(torch.tensor(flat, device=device), batch, last)  # [len(live), V]
            for row, i in enumerate(live):
                r = requests[i]
                if r.params.greedy:
                    tok = int(logits[row].argmax())
                else:
                    q = probs_for(logits[row], r.params)
                    tok = int(sample(q, r.generator))
                    rows[i].append(q)
                tokens[i].append(tok)
                pending[i] = [tok]
        return [
            Draft.chain(t, torch.stack(q) if q else None) if t else EMPTY_DRAFT
            for t, q in zip(tokens, rows)
        ]


def check_vocab_compatible(target_dir: Path | None, draft_dir: Path, target: Transformer, draft: Transformer) -> None:
    if draft.config.vocab_size != target.config.vocab_size:
        raise CheckpointError(
            f"drafter vocabulary ({draft.config.vocab_size}) does not match the target's ({target.config.vocab_size})"
        )
    if target_dir is None:
        return
    t_tok, d_tok = Path(target_dir) / "tokenizer.json", draft_dir / "tokenizer.json"
    if t_tok.is_file() and d_tok.is_file():
        if json.loads(t_tok.read_text()).get("model", {}).get("vocab") != json.loads(d_tok.read_text()).get(
            "model", {}
        ).get("vocab"):
            raise CheckpointError(f"drafter tokenizer in {draft_dir} differs from the target's tokenizer")


def _bench_spec(zoo: Path) -> str | None:
    return f"model:{zoo / 'drafter'}" if (zoo / "drafter" / "config.json").is_file() else None


@register_drafter("model", bench_spec=_bench_spec)
def _build(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device) -> ModelDrafter:
    """`model:DIR` loads a checkpoint directory; plain `model` drafts with the target itself (self-draft)."""
    if arg is None:
        return ModelDrafter(target)
    draft = load_model(arg, dtype=dtype, device=device)
    check_vocab_compatible(getattr(target, "source_dir", None), Path(arg), target, draft)
    return ModelDrafter(draft)
