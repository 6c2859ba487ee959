"""An independent small causal LM as drafter, with its own caller-owned cache per sequence: chains by default, or
EAGLE-2 dynamic trees (`model(path=DIR, tree=auto, width=4, depth=4, nodes=16)`, drafters.tree)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.config import TreeConfig
from verispec.drafters.base import (
    EMPTY_DRAFT, Capabilities, Draft, Drafter, DraftRequest, Verified, register_drafter,
)
from verispec.drafters.tree import TREE_OPTIONS, DynamicTree, TreeCalibration, frontier_mask, node_q, tree_config
from verispec.errors import CheckpointError, ConfigError
from verispec.model.checkpoint import load_model
from verispec.model.transformer import Transformer
from verispec.sampling import probs_for, sample


class ModelDrafter(Drafter):
    """Drafts k tokens autoregressively: argmax at temperature 0 (point mass), else sampled from q. With a tree
    config on, it grows a dynamic tree instead (top-k children, point masses, at any temperature)."""

    name = "model"

    def __init__(self, model: Transformer, tree: TreeConfig = TreeConfig()) -> None:
        self.model = model
        self.tree = tree
        self.capabilities = Capabilities(trees=tree.enabled, tree_requests=True)
        self._caches: dict[int, KVCache] = {}
        self._round_start: dict[int, int] = {}  # committed length when the last draft was proposed
        self.calibration = TreeCalibration()  # learnt from every verified tree; ranks "calibrated" trees

    def start(self, seq_id: int, prompt: list[int]) -> None:
        self._caches[seq_id] = KVCache.for_model(self.model)
        self._round_start[seq_id] = len(prompt)

    def finish(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
        self._round_start.pop(seq_id, None)
        self.calibration.pending.pop(seq_id, None)

    def live_sequences(self) -> set[int]:
        return set(self._caches) | set(self._round_start) | set(self.calibration.pending)

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        cache = self._caches[seq_id]  # holds tokens it was fed; the next proposal feeds what follows them
        cache.truncate(min(cache.length, num_tokens - 1))
        self._round_start[seq_id] = min(self._round_start[seq_id], num_tokens)

    def accept(self, result: Verified) -> None:
        # The cache holds the committed tokens plus k - 1 drafted ones; drafts past the accepted prefix go.
        keep = min(self._caches[result.seq_id].length, self._round_start[result.seq_id] + result.num_accepted)
        self._caches[result.seq_id].truncate(keep)
        self.calibration.verified(result.seq_id, result.committed)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """All requests advance together: one packed forward of the draft model per draft position (per tree depth
        for trees; requests drafting chains and trees go as two groups)."""
        shapes = [r.tree or self.tree for r in requests]
        trees = [i for i, shape in enumerate(shapes) if shape.enabled]
        if not trees:
            return self._propose_chains(requests)
        chains = [i for i, shape in enumerate(shapes) if not shape.enabled]
        out: list[Draft] = [EMPTY_DRAFT] * len(requests)
        for group, drafts in ((trees, self._propose_trees([requests[i] for i in trees], [shapes[i] for i in trees])),
                              (chains, self._propose_chains([requests[i] for i in chains]) if chains else [])):
            for i, d in zip(group, drafts):
                out[i] = d
        return out

    def _propose_chains(self, requests: list[DraftRequest]) -> list[Draft]:
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


    def _propose_trees(self, requests: list[DraftRequest], shapes: list[TreeConfig]) -> list[Draft]:
        """One packed forward over every request's new committed tokens gives q at its anchor, then one per depth
        over every tree's frontier (each node attending to the committed rows, its ancestors and itself); the tree
        rows leave the cache afterwards, so it holds committed tokens only between rounds."""
        device = self.model.device
        trees: dict[int, DynamicTree] = {}
        committed: dict[int, int] = {}  # rows of committed tokens in each live cache
        rows: dict[int, dict[int, int]] = {}  # per request: tree node -> its cache row
        live, pending = [], []
        for i, r in enumerate(requests):
            cache = self._caches[r.seq_id]
            budget = max(0, min(r.budget, shapes[i].nodes, cache.max_len - len(r.tokens)))
            if budget > 0:
                self._round_start[r.seq_id] = len(r.tokens)
                calibration = self.calibration if shapes[i].rank == "calibrated" else None
                trees[i], rows[i], committed[i] = DynamicTree(shapes[i], budget, calibration), {}, len(r.tokens)
                live.append(i)
                pending.append(r.tokens[cache.length :])
        frontier: dict[int, list[int]] = {i: [-1] for i in live}
        if live:
            batch = PackedBatch.build([self._caches[requests[i].seq_id] for i in live], [len(t) for t in pending],
                                      device)
            last = torch.tensor([s.start + s.length - 1 for s in batch.segments], device=device)
            logits, _ = self.model.forward_packed(torch.tensor([t for p in pending for t in p], device=device),
                                                  batch, last)  # [len(live), V]
            for row, i in enumerate(live):
                frontier[i] = trees[i].grow([-1], node_q(logits[row : row + 1], requests[i].params))
        while live := [i for i in live if frontier[i] and self._room(requests[i], len(frontier[i]))]:
            caches = [self._caches[requests[i].seq_id] for i in live]
            shapes = [self._frontier_inputs(trees[i], frontier[i], rows[i], caches[j], committed[i], device)
                      for j, i in enumerate(live)]
            batch = PackedBatch.build(caches, [len(frontier[i]) for i in live], device, shapes)
            flat = [trees[i].nodes[n].token for i in live for n in frontier[i]]
            logits, _ = self.model.forward_packed(torch.tensor(flat, device=device), batch,
                                                  torch.arange(len(flat), device=device))  # [sum F, V]
            start = 0
            for i in live:
                f = len(frontier[i])
                frontier[i] = trees[i].grow(frontier[i], node_q(logits[start : start + f], requests[i].params))
                start += f
        for i in trees:
            self._caches[requests[i].seq_id].truncate(committed[i])  # drop the tree rows
        drafts = [trees[i].draft() if i in trees else EMPTY_DRAFT for i in range(len(requests))]
        for i, (r, d) in enumerate(zip(requests, drafts)):
            if i in trees:
                self.calibration.proposed(r.seq_id, d, trees[i].q())
        return drafts

    def _room(self, request: DraftRequest, rows: int) -> bool:
        cache = self._caches[request.seq_id]
        return cache.length + rows <= cache.max_len

    @staticmethod
    def _frontier_inputs(
        tree: DynamicTree, frontier: list[int], rows: dict[int, int], cache: KVCache, committed: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (positions [F], mask [F, cache.length + F])
        """Each frontier node sees the committed rows, its ancestors' rows (fed at earlier depths) and itself, at
        one position past its parent; records the rows the frontier's keys will take."""
        length = cache.length
        mask = frontier_mask(tree, frontier, rows, length, committed)
        base = cache.next_position - (length - committed)  # the anchor's position + 1
        positions = torch.tensor([base + tree.nodes[n].depth - 1 for n in frontier], device=device)
        return positions, mask.to(device)


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


@register_drafter("model", bench_spec=_bench_spec, structured=True)
def _build(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device,
           options: dict[str, str] | None = None) -> ModelDrafter:
    """`model:DIR` loads a checkpoint directory; plain `model` drafts with the target itself (self-draft).
    Structured: `model(path=DIR, tree=auto|off, width=W, depth=D, nodes=N, rank=calibrated|q)` (TreeConfig; no
    path = self-draft)."""
    opts = dict(options or {})
    path = opts.pop("path", None) or arg
    tree = tree_config(opts, "model")
    if opts:
        raise ConfigError(f"model takes no option {sorted(opts)[0]!r}; options: path, {', '.join(TREE_OPTIONS)}")
    if path is None:
        return ModelDrafter(target, tree)
    draft = load_model(path, dtype=dtype, device=device)
    check_vocab_compatible(getattr(target, "source_dir", None), Path(path), target, draft)
    return ModelDrafter(draft, tree)
