"""EAGLE-3 (`eagle:DIR`) and MTP (`mtp:DIR`) drafters: one decoder layer over the target's hidden states, drafting
autoregressively from its own output states (model.feature). Chains by default; EAGLE-2 dynamic trees with
`eagle(path=DIR, tree=auto, width=4, depth=4, nodes=16)` (drafters.tree).

Per sequence the drafter keeps its layer's cache of committed entries: entry j (feature f_j, token x_{j+1}) exists
once the target has computed h_j and x_{j+1} is committed. Hidden rows arrive from the prefill (`observe`) and from
each verified round (`accept`: the anchor's row and the accepted drafts'); they wait until the next proposal, which
knows the tokens that pair with them, and run as one forward whose last output starts the draft. Draft entries
leave the cache after the proposal, so between rounds it holds committed entries only. With a context window W the
proposal sees the latest W..2W committed entries (keys keep their positions), the range training showed the layer.

A directory may ship a draft vocabulary (`draft_vocab.json`, FR-Spec, as EAGLE-3 reduces its head): the LM head
runs over those rows only, and q is zero elsewhere, so verification stays exact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from verispec.cache import KVCache
from verispec.config import ModelConfig, TreeConfig
from verispec.drafters.base import (
    EMPTY_DRAFT, Capabilities, Draft, Drafter, DraftRequest, Verified, register_drafter,
)
from verispec.drafters.block import check_draft_vocab, load_draft_vocab
from verispec.drafters.files import (check_state, check_target, dir_options, read_drafter_meta, save_drafter_dir,
                                     zoo_spec)
from verispec.drafters.tree import DynamicTree, TreeCalibration, frontier_mask, node_q
from verispec.errors import CheckpointError, ConfigError
from verispec.kernels import native
from verispec.model.feature import FEATURE_KINDS, FeatureConfig, FeatureDraftModel
from verispec.model.fused import FusedFeature
from verispec.model.packing import PackedLinear, PackedWeight, pack
from verispec.model.transformer import Transformer
from verispec.quant.drafter import install_quantized, take_drafter_quantized
from verispec.quant.linear import QuantLinear
from verispec.sampling import sample


class FeatureDrafter(Drafter):
    name = "eagle"

    def __init__(self, model: FeatureDraftModel, target: Transformer, tree: TreeConfig = TreeConfig(),
                 draft_vocab: torch.Tensor | None = None, context_window: int | None = None) -> None:
        self.model, self.target, self.tree = model.eval(), target, tree
        self.name = model.config.kind
        self.capabilities = Capabilities(hidden_layers=model.config.target_layers, trees=tree.enabled,
                                         tree_requests=True)
        self.draft_vocab = None if draft_vocab is None else check_draft_vocab(
            draft_vocab, target.config.vocab_size).to(target.device)
        self.window = model.config.context_window if context_window is None else context_window
        if self.window < 0:
            raise ConfigError(f"context_window must be >= 0 (0: the whole context), got {self.window}")
        cpu_bf16 = model.dtype == torch.bfloat16 and target.device.type == "cpu"
        self._cache_dtype = torch.float32 if cpu_bf16 else model.dtype  # the target cache's rule (KVCache.for_model)
        self._caches: dict[int, KVCache] = {}
        self._pending: dict[int, list[torch.Tensor]] = {}  # per sequence: features [n, d] not yet entered
        self._entered: dict[int, torch.Tensor] = {}  # per sequence: features [cache.length, d] of its entries
        # (lm_head weight, its draft-vocab rows in the drafter's dtype, their packed copy)
        self._head: tuple[torch.Tensor, torch.Tensor, PackedWeight | None] | None = None
        self._fused: tuple[tuple, FusedFeature | None] | None = None  # (the _head it was made with, the step)
        self._ids = None if self.draft_vocab is None else self.draft_vocab.tolist()  # draft row -> token id
        self.calibration = TreeCalibration()  # learnt from every verified draft; "calibrated" trees and chains

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, seq_id: int, prompt: list[int]) -> None:
        cfg = self.target.config
        rows = 2 * self.window + 64 if self.window else cfg.context_limit
        self._caches[seq_id] = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, rows, dtype=self._cache_dtype,
                                       device=self.target.device)
        self._pending[seq_id] = []
        self._entered[seq_id] = torch.zeros(0, cfg.hidden_size, dtype=self.model.dtype, device=self.target.device)

    def finish(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self._entered.pop(seq_id, None)
        self.calibration.pending.pop(seq_id, None)

    def live_sequences(self) -> set[int]:
        return set(self._caches) | set(self._pending) | set(self._entered) | set(self.calibration.pending)

    def known(self, seq_id: int) -> int:
        """Positions whose target hidden state the drafter holds (entered or pending)."""
        return self._caches[seq_id].next_position + sum(p.shape[0] for p in self._pending[seq_id])

    @torch.inference_mode()
    def observe(self, seq_id: int, start: int, hidden: dict[int, torch.Tensor]) -> None:
        if start != self.known(seq_id):
            raise ValueError(f"{self.name} drafter holds {self.known(seq_id)} positions, new rows start at {start}")
        # a copy: the prompt's rows are views of a whole prefill forward's outputs
        self._pending[seq_id].append(self.model.features(hidden).clone())

    @torch.inference_mode()
    def accept(self, result: Verified) -> None:
        # The anchor's and the accepted drafts' rows: positions anchor .. anchor + accepted
        rows = {layer: h[: result.num_accepted + 1] for layer, h in result.target_hidden.items()}
        # kept as given where features() is the hidden state itself (MTP on a target of its dtype): Verified's rows
        # are never a view of a whole step's outputs
        self._pending[result.seq_id].append(self.model.features(rows))
        self.calibration.verified(result.seq_id, result.committed)

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        # Entries cover positions [0, tokens - 1): keep [0, num_tokens - 1), the last of them pending again (a
        # proposal needs its output state)
        cache, end = self._caches[seq_id], num_tokens - 1
        if end > cache.next_position:
            self._pending[seq_id] = [torch.cat(self._pending[seq_id])[: end - cache.next_position]]
            return
        keep = end - 1 - cache.position_offset
        if keep < 0:  # the window slid past it: start again from there (drafts resume after the next round)
            cache.truncate(0)
            cache.position_offset = end
            self._pending[seq_id], self._entered[seq_id] = [], self._entered[seq_id][:0]
            return
        self._pending[seq_id] = [self._entered[seq_id][keep : keep + 1]]
        self._entered[seq_id] = self._entered[seq_id][:keep]
        cache.truncate(keep)

    # ---- proposing ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """All requests' pending entries in one packed forward (each last output drafts its first token); then the
        chains advance together, one packed forward of one entry per request and drafted token, and each tree by
        depth over its frontier."""
        drafts: list[Draft] = [EMPTY_DRAFT] * len(requests)
        live, budgets, shapes = [], {}, {}
        for i, r in enumerate(requests):
            shape = r.tree or self.tree
            budget = min(r.budget, shape.nodes) if shape.enabled else r.budget
            # no row before the anchor (a one-token prompt): nothing to draft from
            if budget > 0 and (self._pending[r.seq_id] or self.known(r.seq_id) != len(r.tokens) - 1):
                live.append(i)
                budgets[i], shapes[i] = budget, shape
        if not live:
            return drafts
        g, logits = self._enter_pending([requests[i] for i in live])
        at = {i: row for row, i in enumerate(live)}
        committed = {i: self._caches[requests[i].seq_id].length for i in live}
        try:
            chains = [i for i in live if not (shapes[i].enabled and budgets[i] > 1)]
            if chains:
                rows = [at[i] for i in chains]
                for i, d in zip(chains, self._chains([requests[i] for i in chains], g[rows], logits[rows],
                                                     [budgets[i] for i in chains])):
                    drafts[i] = d
            for i in live:
                if i not in chains:
                    r = requests[i]
                    drafts[i] = self._tree(r, g[at[i]], logits[at[i] : at[i] + 1], budgets[i],
                                           self._caches[r.seq_id], shapes[i])
        finally:
            for i in live:
                self._caches[requests[i].seq_id].truncate(committed[i])  # draft entries never stay
        return drafts

    def _enter_pending(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit each request's pending entries (one packed forward); per request the output state of its anchor's
        entry (the last one), [R, d], and its draft-vocabulary logits, [R, V']."""
        feats, toks, caches = [], [], []
        for r in requests:
            cache, pending = self._caches[r.seq_id], self._pending[r.seq_id]
            anchor = len(r.tokens) - 1
            if self.known(r.seq_id) != anchor:
                raise RuntimeError(f"{self.name} drafter holds {self.known(r.seq_id)} positions, the anchor is at "
                                   f"{anchor}")
            f = torch.cat(pending) if len(pending) > 1 else pending[0]  # [n, d] for positions first .. anchor - 1
            self._pending[r.seq_id] = []
            first, entered = cache.next_position, self._entered[r.seq_id]
            if self.window and cache.length + f.shape[0] > 2 * self.window:  # slide back to the latest W entries
                keep = max(0, self.window - f.shape[0])
                entered = entered[cache.length - keep :]
                cache.drop_front(cache.length - keep)
                if f.shape[0] > self.window:  # entries before the window are never needed: skip them
                    skip = f.shape[0] - self.window
                    cache.truncate(0)
                    cache.position_offset = first + skip
                    f, first = f[skip:], first + skip
            self._entered[r.seq_id] = torch.cat([entered, f])
            feats.append(f)
            toks.extend(r.tokens[first + 1 : anchor + 1])
            caches.append(cache)
        lengths = [f.shape[0] for f in feats]
        last = torch.tensor(lengths).cumsum(0) - 1
        logits, g = self._packed_step(caches, lengths, torch.tensor(toks, device=self.target.device),
                                      torch.cat(feats), last)
        return g[last], logits

    def _packed_step(self, caches: list[KVCache], lengths: list[int], tokens: torch.Tensor, feats: torch.Tensor,
                     logit_rows: torch.Tensor, tree: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # tokens [N], feats [N, d], logit_rows [M] -> draft-vocabulary logits [M, V'] fp32, output states [N, d]
        """Entries appended to their caches (lengths[i] of them to caches[i], in order), causal after each one's
        rows, in one forward (one native call where it applies); the logits of `logit_rows` and every output state.
        tree: one cache's tree level instead, (positions [N], mask [N, length + N], seen: the leading entries every
        row sees)."""
        fused = self._native()
        if fused is not None and FusedFeature.takes(caches):
            rows = None if tree is None else [(tree[0], *native.tree_rows(tree[1], tree[2]))]
            logits, g = fused.step(tokens, feats.contiguous(), caches, lengths, logit_rows, rows)
            return logits.float(), g
        u = self.model.inputs(self.target.model.embed_tokens, tokens[None], feats[None])
        if tree is not None:
            g = self.model.step(u, tree[0], caches[0], tree[1].to(u.device))[0]
        elif len(caches) == 1:
            cache = caches[0]
            pos = torch.arange(cache.next_position, cache.next_position + lengths[0], device=tokens.device)
            g = self.model.step(u, pos, cache, None)[0]
        else:
            g = self.model.step_packed(u, caches, lengths)[0]
        return self._head_logits(g[logit_rows.to(g.device)]), g

    def _chains(self, requests: list[DraftRequest], g: torch.Tensor, logits: torch.Tensor,
                budgets: list[int]) -> list[Draft]:  # g [R, d], logits [R, V'] of the anchors' entries
        """The requests' chains, advancing together: per drafted position one packed forward of the live requests'
        next entries (reading the token just drafted and the last output state), with their head."""
        tokens: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        conf: list[list[float]] = [[] for _ in requests]
        live = list(range(len(requests)))
        for step in range(max(budgets)):
            # greedy rows read the draft vocabulary's own softmax (the full one is zero elsewhere)
            top, best = logits.softmax(dim=-1).max(dim=-1)
            top, best = top.tolist(), best.tolist()
            picked = []
            for row, i in enumerate(live):
                r = requests[i]
                if r.params.greedy:
                    x, p = self._token(best[row]), top[row]
                else:
                    q = node_q(self._full(logits[row : row + 1]), r.params)[0]
                    x = int(sample(q, r.generator))
                    p = float(q.max())  # known before x is drawn: a sampled chain's cut must not read x (policies)
                    rows[i].append(q)
                tokens[i].append(x)
                conf[i].append(p)
                picked.append(x)
            going = [row for row, i in enumerate(live) if budgets[i] > step + 1]
            if not going:
                break
            caches = [self._caches[requests[live[row]].seq_id] for row in going]
            x = torch.tensor([picked[row] for row in going], device=g.device)
            if len(going) < len(live):
                g = g[going]
            logits, g = self._packed_step(caches, [1] * len(going), x, g, torch.arange(len(going)))
            live = [live[row] for row in going]
        drafts = []
        for r, t, q, p in zip(requests, tokens, rows, conf):
            # c: the rank-0 cell's past acceptance (what the dspark rule cuts by), learnt from this chain once verified
            calibrated = (r.tree or self.tree).rank == "calibrated"
            c = [self.calibration(x, 0) for x in p] if calibrated else p
            drafts.append(Draft.chain(t, torch.stack(q) if q else None, torch.tensor(c)))
            self.calibration.proposed(r.seq_id, drafts[-1], p)
        return drafts

    def _token(self, row: int) -> int:
        return row if self._ids is None else self._ids[row]

    def _head_weights(self) -> tuple[torch.Tensor, torch.Tensor, PackedWeight | None]:
        """(the target's lm_head weight, its draft-vocabulary rows in the drafter's dtype, their pack), remade when
        the target's head is another tensor."""
        weight = self.target.head_weight()
        if self._head is None or self._head[0] is not weight:
            rows = weight if self.draft_vocab is None else weight[self.draft_vocab]
            rows = rows.to(self.model.dtype).contiguous()
            self._head = (weight, rows, pack(rows))
        return self._head

    def _native(self) -> FusedFeature | None:
        """The one-call native step (model.fused.FusedFeature) where it applies: a packed drafter on CPU."""
        head = self._head_weights()
        if self._fused is None or self._fused[0] is not head:
            cfg, w_in, mlp = self.target.config, self.model.w_in, self.model.layer.mlp
            quantized = isinstance(w_in, QuantLinear)  # an int8/int4 drafter (quant.drafter): qgemm.c's packs
            packed = head[2] is not None and (
                quantized and mlp.gate_up_quant is not None and native.qavailable()
                or isinstance(w_in, PackedLinear) and w_in.packed is not None and mlp.gate_up_packed is not None)
            fused = None
            if packed and cfg.head_dim % 8 == 0 and cfg.head_dim <= 256 and native.available():
                fused = FusedFeature(self.model, self.target.model.embed_tokens.weight, head[2], [head[0], head[1]])
            self._fused = (head, fused)
        fused = self._fused[1]
        return fused if fused is not None and fused.usable() else None

    def _head_logits(self, g: torch.Tensor) -> torch.Tensor:  # [F, d] -> [F, V'] fp32, the draft vocabulary's
        _, rows, packed = self._head_weights()
        return self.model.logits(g, rows, packed)

    def _full(self, small: torch.Tensor) -> torch.Tensor:  # [F, V'] -> [F, V], -inf outside the draft vocabulary
        if self.draft_vocab is None:
            return small
        full = small.new_full((small.shape[0], self.target.config.vocab_size), float("-inf"))
        full[:, self.draft_vocab] = small
        return full

    def _tree(self, r: DraftRequest, g: torch.Tensor, logits: torch.Tensor, budget: int, cache: KVCache,
              shape: TreeConfig) -> Draft:  # g [d], logits [1, V'] of the anchor's entry
        """EAGLE-2's dynamic tree: each depth runs the frontier's entries (node i's reads its parent's output state
        and its own token at position anchor + depth - 1) over the committed entries and its ancestors'."""
        tree = DynamicTree(shape, budget, self.calibration if shape.rank == "calibrated" else None)
        device = self.target.device
        committed, anchor = cache.length, len(r.tokens) - 1
        state: dict[int, torch.Tensor] = {-1: g}  # node -> output state of its entry (-1: the anchor's)
        row: dict[int, int] = {}  # node -> its cache row
        frontier = tree.grow([-1], node_q(self._full(logits), r.params))
        while frontier:
            nodes = [tree.nodes[n] for n in frontier]
            mask = frontier_mask(tree, frontier, row, cache.length, committed)
            feats = torch.stack([state[node.parent] for node in nodes])  # [F, d]
            toks = torch.tensor([node.token for node in nodes], device=device)
            positions = torch.tensor([anchor + node.depth - 1 for node in nodes], device=device)
            logits, out = self._packed_step([cache], [len(nodes)], toks, feats, torch.arange(len(nodes)),
                                            (positions, mask, committed))  # [F, V'], [F, d]
            for f, n in enumerate(frontier):
                state[n] = out[f]
            frontier = tree.grow(frontier, node_q(self._full(logits), r.params))
        draft = tree.draft()
        self.calibration.proposed(r.seq_id, draft, tree.q())
        return draft


# ---- checkpoints ----------------------------------------------------------------------------------------------------
def save_feature_drafter(model: FeatureDraftModel, path: Path, extra: dict | None = None) -> None:
    save_drafter_dir(path, model.config.kind, "feature", model.config.to_dict(), model, model.target_config, extra)


def read_feature_drafter(path: str | Path, target_cfg: ModelConfig, kind: str) -> FeatureDraftModel:
    """The fp32 FeatureDraftModel of kind `kind` stored in `path`, checked against the target's config; a
    CheckpointError names whatever does not fit."""
    path = Path(path)
    meta = read_drafter_meta(path, (kind,), f"{kind} drafter")
    try:
        cfg = FeatureConfig(**meta["feature"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not a {kind} drafter config: {e}") from None
    check_target(meta, target_cfg, path, f"{kind} drafter")
    if any(not 0 <= layer <= target_cfg.num_hidden_layers for layer in cfg.target_layers):
        raise CheckpointError(f"{path / 'config.json'}: target layers {cfg.target_layers} outside "
                              f"0..{target_cfg.num_hidden_layers}")
    model = FeatureDraftModel(target_cfg, cfg)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    quantized = take_drafter_quantized(meta, model, state, path)  # {} unless int8/int4 (quant.drafter)
    check_state(weights, state, {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in quantized})
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=not quantized)
    install_quantized(model, quantized)
    return model


def load_feature_drafter(path: str | Path, target: Transformer, kind: str, tree: TreeConfig = TreeConfig(),
                         draft_vocab: bool = True, context_window: int | None = None) -> FeatureDrafter:
    """A trained EAGLE-3 or MTP drafter for `target`, computing in the target's dtype except for a bf16 target on
    CPU: there in fp32 (bf16 elementwise ops are slow on CPUs; its bf16-valued weights still pack in bf16, so the
    matmuls read half the bytes). Its precision never changes the output, only which drafts are proposed."""
    model = read_feature_drafter(path, target.config, kind)
    cpu_bf16 = target.dtype == torch.bfloat16 and target.device.type == "cpu"
    model = model.to(device=target.device, dtype=torch.float32 if cpu_bf16 else target.dtype)
    model.rotary_emb = type(model.rotary_emb)(target.config).to(target.device)  # RoPE tables stay fp32
    model.prepare_inference()
    vocab = load_draft_vocab(Path(path), target.config.vocab_size) if draft_vocab else None
    return FeatureDrafter(model, target, tree, vocab, context_window)


def _factory(kind: str):
    def build(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device,
              options: dict[str, str] | None = None) -> FeatureDrafter:
        o = dir_options(kind, arg, options or {})
        return load_feature_drafter(o.path, target, kind, o.tree, draft_vocab=o.draft_vocab,
                                    context_window=o.context_window)

    build.__doc__ = (f"`{kind}:DIR` or `{kind}(path=DIR, tree=auto|off, width=W, depth=D, nodes=N, rank=calibrated|q, "
                     f"window=W, vocab=draft|full)`: a trained {kind} drafter for this target.")
    return build


for _kind in FEATURE_KINDS:
    register_drafter(_kind, bench_spec=zoo_spec(_kind), structured=True)(_factory(_kind))
