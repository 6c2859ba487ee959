"""Block drafters (`block`: parallel, DFlash-style; `dspark`: with DSpark's sequential head, Markov or RNN, and the
confidence head).

Per sequence the drafter keeps a cache of context keys/values built from the target's hidden states of every
committed position before the anchor: the prompt's come from the prefill (`observe`), later ones from the rows
each verification round verified and kept (`accept`: the anchor and the accepted drafts). So a round costs one
block forward of the drafter plus an O(gamma) head loop; the target forward that verifies a round also yields the
next round's context. Prompt and accepted rows wait (`_pending`) for the next proposal, whose block forward
projects them with the block in one pass per layer (a one-request proposal; batched ones append them first). A
one-request proposal runs each draft layer in one native call where the kernels build (model.block,
kernels/blocklayer.c).

The context is a sliding window when the drafter has one (`BlockConfig.context_window` W, or `:window=N` in the
spec): a proposal sees the latest W..2W positions. The prefill keeps its last W rows (earlier ones are never
projected); once accepted rows grow the cache past 2W it drops back to the latest W. Keys keep their RoPE
positions, so only which positions are visible changes, never their relative distances.

A drafter directory may ship a draft vocabulary (`draft_vocab.json`, FR-Spec; `verispec train draft-vocab`): the
most frequent tokens of the training text. The LM head and the Markov bias then run over those rows only, the
costliest per-round ops after the block forward; `block:DIR:full-vocab` / `dspark:DIR:full-vocab` ignore it.

Trees (`dspark(path=DIR, tree=auto, width=W, depth=D, nodes=N)`, or a request's tree): the block forward is the
chain's; a node at depth j with token x has as children the top W tokens of U_{j+1} plus the Markov bias from x
(the parallel head: U_{j+1} alone), grown and kept as EAGLE-2's dynamic trees are (drafters.tree), at most the
block's G deep. Each level costs one small matmul of the head, not a forward. The RNN head's state follows a path,
so it drafts chains only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verispec.cache import KVCache
from verispec.config import ModelConfig, TreeConfig
from verispec.drafters.base import (
    EMPTY_DRAFT, Capabilities, Draft, Drafter, DraftRequest, Verified, register_drafter,
)
from verispec.drafters.files import check_state, check_target, dir_options, save_drafter_dir, zoo_spec
from verispec.drafters.tree import DynamicTree, TreeCalibration, node_q
from verispec.errors import CheckpointError, ConfigError
from verispec.kernels import native
from verispec.model.block import BlockConfig, BlockDraftModel
from verispec.model.checkpoint import DRAFTER_KIND_KEY
from verispec.model.packing import linear, pack, weight_version
from verispec.model.transformer import Transformer
from verispec.quant.drafter import install_quantized, take_drafter_quantized
from verispec.sampling import probs_for, sample

KIND_KEY = DRAFTER_KIND_KEY


class BlockDrafter(Drafter):
    name = "block"

    def __init__(self, model: BlockDraftModel, target: Transformer, temperatures: list[float] | None = None,
                 draft_vocab: torch.Tensor | None = None, context_window: int | None = None,
                 tree: TreeConfig = TreeConfig()) -> None:
        self.model, self.target = model.eval(), target
        # FR-Spec: the token ids the drafter may propose, ascending (None: all). Block logits and the Markov bias
        # are computed for these columns only; q is zero elsewhere, so rejection sampling stays exact.
        self.draft_vocab = None if draft_vocab is None else check_draft_vocab(
            draft_vocab, target.config.vocab_size).to(target.device)
        self.window = model.config.context_window if context_window is None else context_window
        if self.window < 0:
            raise ValueError(f"context_window must be >= 0 (0: the whole context), got {self.window}")
        # A windowed context sees recent positions only: it may restart after a gap (`observe`).
        trees = model.config.head != "rnn"  # an RNN head's state follows one path
        if tree.enabled and not trees:
            raise ConfigError("a block drafter with the RNN head drafts chains only (tree=off)")
        self.tree = tree
        self.capabilities = Capabilities(hidden_layers=tuple(model.config.target_layers), context_gaps=self.window > 0,
                                         trees=tree.enabled, tree_requests=trees, one_pass=True)
        self.calibration = TreeCalibration()  # learnt from every verified tree; ranks "calibrated" trees
        # STS: per-position temperatures for the confidence logits (1.0 = uncalibrated)
        self.temperatures = list(temperatures or [])
        self._ctx: dict[int, KVCache] = {}
        self._ctx_start: dict[int, int] = {}  # the position of each context cache's first entry
        # Accepted rows not yet in the context cache, oldest first: {layer: [n, d]} each (see accept)
        self._pending: dict[int, list[dict[int, torch.Tensor]]] = {}
        # Context keys/values (and so the drafter's attention) in fp32 unless the drafter runs in bf16 off the CPU,
        # the target cache's rule.
        dtype = next(model.parameters()).dtype
        cpu = self.target.device.type == "cpu"
        self._ctx_dtype = torch.float32 if dtype == torch.bfloat16 and cpu else dtype
        self._cache: dict[str, tuple[tuple, object]] = {}  # see _derived

    def start(self, seq_id: int, prompt: list[int]) -> None:
        # a restarted sequence keeps nothing of its previous run; its context cache comes with its first rows
        self._ctx.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self._ctx_start[seq_id] = 0

    def _context(self, seq_id: int) -> KVCache:
        """The sequence's context cache, made when first written (a request the draft gate keeps plain never
        needs it: megabytes zeroed per request otherwise)."""
        if seq_id not in self._ctx:
            cfg, g = self.target.config, self.model.config.block_size
            # A window holds 2W entries between slides, plus a block; rows pending from several lookup rounds grow
            # the cache on demand (KVCache.reserve). Without a window, room for the whole context.
            rows = 2 * self.window + 2 * g if self.window else cfg.context_limit + g
            self._ctx[seq_id] = KVCache(self.model.config.num_layers, cfg.num_key_value_heads, cfg.head_dim, rows,
                                        dtype=self._ctx_dtype, device=self.target.device)
        return self._ctx[seq_id]

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        # The context covers positions [0, tokens - 1): cut it back to [0, num_tokens - 1).
        self._flush(seq_id)
        cache, end = self._context(seq_id), num_tokens - 1
        if end < self._ctx_start[seq_id]:  # the window slid past it: start again from there
            cache.truncate(0)
            self._ctx_start[seq_id] = end
        else:
            cache.truncate(min(cache.length, end - self._ctx_start[seq_id]))

    def finish(self, seq_id: int) -> None:
        self._ctx.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self._ctx_start.pop(seq_id, None)
        self.calibration.pending.pop(seq_id, None)

    def live_sequences(self) -> set[int]:
        return set(self._ctx) | set(self._pending) | set(self._ctx_start) | set(self.calibration.pending)

    def observe(self, seq_id: int, start: int, hidden: dict[int, torch.Tensor]) -> None:
        known = self.context_length(seq_id)
        if start != known and not (start > known and self.capabilities.context_gaps):
            raise ValueError(f"context cache holds {known} positions, new rows start at {start}")
        if start > known:  # a gap (the engine skipped rows while drafting did not pay): the context restarts here
            self._ctx.pop(seq_id, None)
            self._pending.pop(seq_id, None)
            self._ctx_start[seq_id] = start
        rows, w = next(iter(hidden.values())).shape[0], self.window
        if w and rows >= w:  # nothing before this chunk's last w rows stays visible: never project them
            self._ctx.pop(seq_id, None)
            self._pending.pop(seq_id, None)
            self._ctx_start[seq_id] = start + rows - w
            hidden = {layer: h[rows - w :] for layer, h in hidden.items()}
        # Projected by the next proposal, like accepted rows: a request the draft gate keeps plain never pays it.
        self._pending.setdefault(seq_id, []).append({layer: h.clone() for layer, h in hidden.items()})

    def _keep_latest(self, seq_id: int, rows: int) -> None:
        """Slide the context window: keep the latest `rows` entries of the cache (0: keep everything)."""
        cache = self._context(seq_id)
        if rows and cache.length > rows:
            self._ctx_start[seq_id] += cache.length - rows
            cache.drop_front(cache.length - rows)

    def accept(self, result: Verified) -> None:
        # Rows of the anchor and the accepted drafts: context for positions anchor_pos .. anchor_pos + accepted,
        # projected by the next proposal (several rounds' rows if prompt lookup drafted in between).
        # Kept as given (Verified: never a view of a whole step's outputs; the engine gathers them compactly).
        keep = {layer: h[: result.num_accepted + 1] for layer, h in result.target_hidden.items()}
        self._pending.setdefault(result.seq_id, []).append(keep)
        self.calibration.verified(result.seq_id, result.committed)

    def context_length(self, seq_id: int) -> int:
        """Positions of this sequence's context known to the drafter (in its cache or waiting for it)."""
        rows = sum(next(iter(p.values())).shape[0] for p in self._pending.get(seq_id, []))
        held = self._ctx[seq_id].length if seq_id in self._ctx else 0
        return self._ctx_start[seq_id] + held + rows

    def _take_pending(self, seq_ids: list[int]) -> tuple[torch.Tensor | None, list[int]]:
        """Every sequence's pending rows as context features, projected in one pass: [sum(ns), d] (None when
        there are none) and each sequence's count, in the order of seq_ids."""
        layers = self.model.config.target_layers
        per_seq = [self._pending.pop(sid, None) or [] for sid in seq_ids]
        ns = [sum(c[layers[0]].shape[0] for c in cs) for cs in per_seq]
        chunks = [c for cs in per_seq for c in cs]
        if not chunks:
            return None, ns
        hidden = {k: chunks[0][k] if len(chunks) == 1 else torch.cat([c[k] for c in chunks]) for k in layers}
        return self.model.context_features(hidden), ns

    @torch.inference_mode()
    def _flush(self, *seq_ids: int) -> None:
        """Append these sequences' pending rows to their context caches, projected together (one pass per layer
        for a batch, not one per sequence)."""
        todo = [(sid, self._pending.pop(sid)) for sid in seq_ids if self._pending.get(sid)]
        if not todo:
            return
        layers = self.model.config.target_layers
        rows = [sum(c[layers[0]].shape[0] for c in chunks) for _, chunks in todo]
        hidden = {k: torch.cat([c[k] for _, chunks in todo for c in chunks]) for k in layers}  # [sum(rows), d]
        caches = [self._context(sid) for sid, _ in todo]
        starts = [self._ctx_start[sid] for sid, _ in todo]
        self.model.append_contexts(caches, self.model.context_features(hidden)[None],
                                   [s + c.length for s, c in zip(starts, caches)], rows, starts)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One block forward for all requests (contexts padded to the longest and masked), then the head loop."""
        cfg = self.model.config
        shapes = [(r.tree or self.tree) if self.capabilities.tree_requests else self.tree for r in requests]
        trees = [s.enabled and r.budget > 1 for s, r in zip(shapes, requests)]
        # a chain's positions, or a tree's nodes (its depth, the block positions it reads, at most G)
        budgets = [min(r.budget, s.nodes) if t else min(r.budget, cfg.block_size)
                   for r, s, t in zip(requests, shapes, trees)]
        spans = [min(s.depth, cfg.block_size) if t else b for s, t, b in zip(shapes, trees, budgets)]
        live = [i for i, b in enumerate(budgets) if b > 0]
        drafts = [EMPTY_DRAFT] * len(requests)
        if not live:
            return drafts
        device = self.target.device
        pos = [len(requests[i].tokens) - 1 for i in live]  # anchor positions
        for i, p in zip(live, pos):
            if self.context_length(requests[i].seq_id) != p:
                raise RuntimeError(f"block drafter context holds {self.context_length(requests[i].seq_id)} "
                                   f"positions, the anchor is at {p}")
        if self.window:  # past 2W positions (cache and pending rows), drop back to the latest W
            for i, p in zip(live, pos):
                sid = requests[i].seq_id
                if p - self._ctx_start[sid] > 2 * self.window:
                    self._flush(sid)
                    self._keep_latest(sid, self.window)
        seq_ids = [requests[i].seq_id for i in live]
        caches = [self._context(sid) for sid in seq_ids]
        anchor_pos = torch.tensor(pos, device=device)
        anchors = torch.tensor([requests[i].tokens[-1] for i in live], device=device)
        embed = self.target.model.embed_tokens
        if len(live) == 1:  # its cache as is (pending rows, then the block's keys/values after its entries), no mask
            feats, _ = self._take_pending(seq_ids)
            new_ctx = None if feats is None else feats[None]
            h = self.model.block_hidden(embed, anchors, anchor_pos, caches[0], None, new_ctx,
                                        self._ctx_start[seq_ids[0]])  # [1, G, d]
        elif (layers := self.model.native_batch(caches)) is not None:
            # each over its own cache, pending rows riding along: one native call a layer
            feats, ns = self._take_pending(seq_ids)
            h = self.model.block_hidden_batch(embed, anchors, anchor_pos, caches, feats, ns,
                                              [self._ctx_start[sid] for sid in seq_ids], layers)  # [R, G, d]
        else:  # per layer [R, Hkv, width, D], contexts padded to the longest and masked
            self._flush(*seq_ids)
            lengths = torch.tensor([c.length for c in caches], device=device)
            width = int(lengths.max())
            ctx = [(torch.cat([c.k[layer, :, :, :width] for c in caches]),
                    torch.cat([c.v[layer, :, :, :width] for c in caches])) for layer in range(cfg.num_layers)]
            mask = (torch.arange(width, device=device)[None] < lengths[:, None])[:, None, None, :]
            h = self.model.block_hidden(embed, anchors, anchor_pos, ctx, mask)  # [R, G, d]
        # The LM head is the costliest op of a round (V x d per position): only for the positions some request drafts.
        span = max(spans[i] for i in live)
        base = self._block_logits(h[:, :span].to(self.target.dtype))  # [R, span, V'] the block logits U
        ids = self.draft_vocab  # column -> token id (None: the identity)
        if cfg.confidence:  # c_j = sigmoid((h_j . w_h + t[x_{j-1}]) / T_j) (model.confidence_terms): one matmul for
            # every position's state term; the token term and the sigmoids as Python floats, not a tensor op each
            head = self.model.confidence_head
            w_state, table = self._derived("conf", (self.model.markov_in.weight, head.weight, head.bias),
                                           self._confidence_terms)
            conf_h = (h[:, :span] @ w_state).tolist()  # [R][span]
        anchor_ids = anchors.tolist()
        tokens: list[list[int]] = [[] for _ in live]
        probs: list[torch.Tensor | None] = [None] * len(live)
        looped = []  # rows drafted by the torch head loop below: sampled ones, or greedy without the native kernel
        fast = self._native_markov() if cfg.head == "markov" else None
        for row, i in enumerate(live):
            if trees[i]:
                drafts[i] = self._tree(requests[i], base[row, : spans[i]], anchor_ids[row], budgets[i], shapes[i])
            elif not requests[i].params.greedy:
                looped.append(row)
            elif cfg.head == "none":  # parallel: every position is independent
                best = base[row, : budgets[i]].argmax(-1)
                tokens[row] = (best if ids is None else ids[best]).tolist()
            elif fast is not None:
                tokens[row] = native.markov_greedy(base[row, : budgets[i]], *fast, anchor_ids[row], vocab=ids)
            else:
                looped.append(row)
        if looped:
            self._head_loop([requests[live[row]] for row in looped], [budgets[live[row]] for row in looped],
                            base[looped], h[looped, :span], anchors[looped], [tokens[row] for row in looped], probs,
                            looped)
        for row, i in enumerate(live):
            if trees[i]:
                continue
            conf = None
            if cfg.confidence:  # c_j from h_j and x_{j-1} only: never from the token about to be drawn
                prev = [anchor_ids[row], *tokens[row][:-1]]
                conf = torch.tensor([_sigmoid((conf_h[row][j] + table[x]) / self._temperature(j))
                                     for j, x in enumerate(prev)], device=device)
            drafts[i] = Draft.chain(tokens[row], probs[row], conf)
        return drafts

    def _tree(self, r: DraftRequest, base: torch.Tensor, anchor: int, budget: int, shape: TreeConfig) -> Draft:
        """A dynamic tree from the block logits base [depth, V'] of one request: each level's frontier nodes get
        their next-token distribution from U_{j+1} and the head's bias from their own token, in one matmul."""
        tree = DynamicTree(shape, budget, self.calibration if shape.rank == "calibrated" else None)
        ids, vocab = self.draft_vocab, self.target.config.vocab_size
        markov = self.model.config.head == "markov"
        w2 = self.model.markov_out.weight if markov else None
        if markov and ids is not None:
            w2 = self._derived("w2_vocab", (w2,), lambda: self.model.markov_out.weight[ids].contiguous())

        def q(prev: list[int], depth: int) -> torch.Tensor:  # the nodes' tokens -> [F, V] q of their children
            logits = base[depth].expand(len(prev), -1)
            if markov:
                x = torch.tensor(prev, device=base.device)
                logits = logits + F.linear(self.model.markov_in(x), w2).float()
            small = node_q(logits, r.params)
            return small if ids is None else small.new_zeros(len(prev), vocab).index_copy_(1, ids, small)

        frontier = tree.grow([-1], q([anchor], 0))
        while frontier:
            depth = tree.nodes[frontier[0]].depth  # a frontier is one level
            if depth >= base.shape[0]:
                break
            frontier = tree.grow(frontier, q([tree.nodes[n].token for n in frontier], depth))
        draft = tree.draft()
        self.calibration.proposed(r.seq_id, draft, tree.q())
        return draft

    def _head_loop(self, requests, budgets, base, states, prev, tokens, probs, rows) -> None:
        """Draft left to right in torch, all given requests together: x_j from U_j plus the sequential head's bias
        (markov: from x_{j-1}; rnn: from its state over the block states `states` [R, span, d] and x_1..x_{j-1}),
        argmax or sampled from q_j = probs_for(logits) with each request's own generator.
        Appends to tokens[n]; sets probs[rows[n]] to the [budget, V] draft distribution of sampled requests."""
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        ids, vocab_size = self.draft_vocab, self.target.config.vocab_size
        head, state = self.model.config.head, None
        if head != "none":
            w2 = self.model.markov_out.weight
            if ids is not None:  # W2's rows for the draft vocabulary
                w2 = self._derived("w2_vocab", (w2,), lambda: self.model.markov_out.weight[ids].contiguous())
        for j in range(max(budgets)):
            logits = base[:, j]
            if head == "markov":
                logits = logits + F.linear(self.model.markov_in(prev), w2).float()
            elif head == "rnn":
                u, state = self.model.rnn_step(state, states[:, j], prev)
                logits = logits + F.linear(u, w2).float()
            nxt = prev.clone()
            for n, r in enumerate(requests):
                if j >= budgets[n]:
                    continue
                if r.params.greedy:
                    col = int(logits[n].argmax())
                else:
                    q = probs_for(logits[n], r.params)
                    col = int(sample(q, r.generator))
                    if ids is not None:  # q over the full vocabulary: zero outside the draft vocabulary
                        q = q.new_zeros(vocab_size).index_copy_(0, ids, q)
                    qs[n].append(q)
                tok = col if ids is None else int(ids[col])
                tokens[n].append(tok)
                nxt[n] = tok
            prev = nxt
        for n, row in enumerate(rows):
            if qs[n]:
                probs[row] = torch.stack(qs[n])

    def _block_logits(self, h: torch.Tensor) -> torch.Tensor:  # [R, span, d] -> fp32 [R, span, V']
        """The target's LM head on the block states: every token, or the draft vocabulary's rows only."""
        head = self.target.lm_head
        if self.draft_vocab is None:
            return head(h).float()
        ids = self.draft_vocab

        weight = self.target.head_weight()

        def rows():
            w = weight.detach()[ids].contiguous()
            return w, pack(w)

        w, packed = self._derived("head_vocab", (weight,), rows)
        return linear(h, w, None, packed).float()

    def _native_markov(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W1, W2^T) for the native greedy head loop, W2^T cut to the draft vocabulary's columns; None where the
        kernel is unavailable or the drafter is not fp32 on the CPU."""
        w1, w2 = self.model.markov_in.weight, self.model.markov_out.weight
        if w1.device.type != "cpu" or w1.dtype != torch.float32 or w2.dtype != torch.float32:
            return None
        if not native.available():
            return None
        ids = self.draft_vocab

        def make():
            w2t = w2.detach() if ids is None else w2.detach()[ids]
            return w1.detach().contiguous(), w2t.t().contiguous()

        return self._derived("markov", (w1, w2), make)

    def _derived(self, name: str, sources: tuple[torch.Tensor, ...], make):
        """make(), computed once from the drafter's frozen weights and remade if any of `sources` changes."""
        key = tuple((t.data_ptr(), weight_version(t)) for t in sources)
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = self._cache[name] = (key, make())
        return hit[1]

    def _confidence_terms(self) -> tuple[torch.Tensor, list[float]]:
        """model.confidence_terms() for the head loop: the state weights contiguous, the token table as floats."""
        w_h, table = self.model.confidence_terms()
        return w_h.detach().contiguous(), table.detach().tolist()

    def _temperature(self, j: int) -> float:
        return self.temperatures[j] if j < len(self.temperatures) else 1.0


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary as the drafter uses it: int64, 1-D, ascending, distinct, within the vocabulary."""
    ids = torch.as_tensor(ids).long().flatten().contiguous()
    if ids.numel() == 0 or (ids.numel() > 1 and bool((ids[1:] <= ids[:-1]).any())):
        raise ValueError("a draft vocabulary needs at least one token id, ascending and without repeats")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
    return ids


# ---- checkpoints ------------------------------------------------------------------------------------------------

def save_block_drafter(model: BlockDraftModel, path: Path, extra: dict | None = None) -> None:
    save_drafter_dir(path, "block" if model.config.head == "none" else "dspark", "block", model.config.to_dict(), model,
                     model.target_config, extra)


def read_block_drafter(path: str | Path, target_cfg: ModelConfig) -> BlockDraftModel:
    """The fp32 BlockDraftModel stored in `path` (config.json + model.safetensors), checked against the target's
    config; a CheckpointError names whatever does not fit."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not a block drafter checkpoint (needs config.json and model.safetensors)")
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not a block drafter config: {e}") from None
    if isinstance(meta, dict) and KIND_KEY not in meta and "model_type" in meta:
        raise ConfigError(f"{path} holds a {meta['model_type']} model checkpoint, not a block drafter; "
                          f"use it as the drafter model:{path}")
    if not weights.is_file():
        raise CheckpointError(f"{path} is not a block drafter checkpoint (needs config.json and model.safetensors)")
    try:
        cfg = BlockConfig(**meta["block"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_file} is not a block drafter config: {e}") from None
    check_target(meta, target_cfg, path, "block drafter")
    model = BlockDraftModel(target_cfg, cfg)
    state = load_file(str(weights))
    quantized = take_drafter_quantized(meta, model, state, path)  # {} unless int8/int4 (quant.drafter)
    check_state(weights, state, {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in quantized})
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=not quantized)
    install_quantized(model, quantized)
    return model


def load_block_drafter(path: str | Path, target: Transformer, draft_vocab: bool = True,
                       context_window: int | None = None, tree: TreeConfig = TreeConfig()) -> BlockDrafter:
    """A trained block drafter for `target`; `draft_vocab=False` ignores the directory's draft vocabulary,
    `context_window` overrides the checkpoint's (0: the whole context), `tree` drafts trees by default."""
    path = Path(path)
    t = target.config
    model = read_block_drafter(path, t)
    # The drafter computes in the target's dtype, except for a bf16 target on CPU: there it computes in fp32, so that
    # each proposal runs its layers in one native call (kernels/blocklayer.c, fp32 activations over its bf16-valued
    # weights packed in bf16) and its greedy head loop in another (kernels/markov.c), where bf16 would leave both to
    # dozens of small torch ops. Its precision never changes the output, only which drafts are proposed.
    calibration = path / "calibration.json"
    temps = json.loads(calibration.read_text()).get("sts_temperatures") if calibration.is_file() else None
    vocab = load_draft_vocab(path, t.vocab_size) if draft_vocab else None
    dtype = target.dtype
    if dtype == torch.bfloat16 and target.device.type == "cpu":
        dtype = torch.float32
        model.bf16_matmuls = True
    model = model.to(device=target.device, dtype=dtype)
    model.rotary_emb = type(model.rotary_emb)(t).to(target.device)  # RoPE tables stay fp32 (cast per call)
    return BlockDrafter(model.prepare_inference(), target, temps, vocab, context_window, tree)


VOCAB_FILE = "draft_vocab.json"


def load_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The drafter directory's FR-Spec draft vocabulary (`draft_vocab.json`, see train.draft_vocab), if any."""
    f = path / VOCAB_FILE
    if not f.is_file():
        return None
    try:
        ids = json.loads(f.read_text())["token_ids"]
        return check_draft_vocab(torch.tensor(ids, dtype=torch.long), vocab_size)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{f} is not a draft vocabulary: {e}") from None


def _load_spec(arg: str | None, target: Transformer, kind: str, options: dict[str, str] | None) -> BlockDrafter:
    """`kind:DIR` followed by options, each after a colon: `full-vocab` (ignore the directory's draft vocabulary)
    and `window=N` (see only the latest N..2N context positions; 0: all of them); or structured,
    `kind(path=DIR, window=N, vocab=draft|full, tree=auto|off, width=W, depth=D, nodes=N, rank=calibrated|q)`."""
    if options:  # a structured spec (the `kind:DIR` form has none)
        o = dir_options(kind, arg, options)
        return load_block_drafter(o.path, target, draft_vocab=o.draft_vocab, context_window=o.context_window,
                                  tree=o.tree)
    if arg is None:
        raise CheckpointError(f"the {kind} drafter needs a checkpoint: {kind}:DIR")
    path, full, window = arg, False, None
    while True:
        head, sep, option = path.rpartition(":")
        if not sep or not (option == "full-vocab" or option.startswith("window=")):
            break
        if option == "full-vocab":
            full = True
        else:
            value = option.removeprefix("window=")
            if not value.isdigit():
                raise ConfigError(f"block drafter option {option!r}: window=N needs a whole number N >= 0")
            window = int(value)
        path = head
    return load_block_drafter(path, target, draft_vocab=not full, context_window=window)


@register_drafter("block", bench_spec=zoo_spec("block"), structured=True)
def _build_block(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device,
                 options: dict[str, str] | None = None) -> BlockDrafter:
    """`block:DIR[:full-vocab][:window=N]`: a trained parallel (or DSpark) block drafter for this target; with
    `:full-vocab` it drafts from every token even where DIR ships a draft vocabulary, `:window=N` overrides the
    checkpoint's context window (0: the whole context). Structured: `block(path=DIR, window=N, vocab=draft|full,
    tree=auto|off, width=W, depth=D, nodes=N, rank=calibrated|q)`."""
    return _load_spec(arg, target, "block", options)


@register_drafter("dspark", bench_spec=zoo_spec("dspark"), structured=True)
def _build_dspark(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device,
                  options: dict[str, str] | None = None) -> BlockDrafter:
    """`dspark:DIR[:full-vocab][:window=N]`: a block drafter with DSpark's sequential head (Markov or RNN, as its
    checkpoint says) and confidence head; structured as `block(...)`, trees from its head (a Markov one)."""
    drafter = _load_spec(arg, target, "dspark", options)
    if drafter.model.config.head == "none":
        raise CheckpointError(f"{arg or (options or {}).get('path')} is a parallel block drafter; load it as block")
    return drafter
