"""Medusa heads as a drafter (`medusa:DIR`; `medusa(path=DIR, tree=auto, nodes=N)` for its static sparse tree).

The heads read the target's last hidden state at the position before the anchor, which the verify forward (or the
prefill) computed: `accept` and `observe` keep that row, and a proposal is K head rows over it. A chain drafts the
heads' choices (argmax at temperature 0, else a sample of each head's q: the heads are independent of the path, so
each q is exact for its token); a tree takes the checkpoint's rank paths (model.medusa.sparse_tree) as point masses.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from verispec.config import ModelConfig, TreeConfig
from verispec.drafters.base import (
    EMPTY_DRAFT, Capabilities, Draft, Drafter, DraftRequest, Verified, register_drafter,
)
from verispec.drafters.files import check_state, check_target, read_drafter_meta, save_drafter_dir, zoo_spec
from verispec.drafters.tree import TREE_OPTIONS, TreeCalibration, node_q, tree_config
from verispec.errors import CheckpointError, ConfigError
from verispec.model.medusa import MedusaConfig, MedusaHeads
from verispec.model.packing import PackedLinear
from verispec.model.transformer import Transformer
from verispec.sampling import sample

HISTORY = 256  # last-layer rows kept per sequence: how far a composed drafter's rollback may reach


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, model: MedusaHeads, target: Transformer, tree: TreeConfig = TreeConfig()) -> None:
        self.model, self.target, self.tree = model.eval(), target, tree
        self.capabilities = Capabilities(hidden_layers=(model.config.target_layer,), trees=tree.enabled,
                                         tree_requests=True)
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # seq -> (position of the first row, rows [n, d])
        self.calibration = TreeCalibration()  # learnt from every verified draft: the confidences the dspark rule reads

    def start(self, seq_id: int, prompt: list[int]) -> None:
        self._rows[seq_id] = (0, self.target.model.norm.weight.new_zeros(0, self.target.config.hidden_size))

    def finish(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        self.calibration.pending.pop(seq_id, None)

    def live_sequences(self) -> set[int]:
        return set(self._rows) | set(self.calibration.pending)

    def _append(self, seq_id: int, start: int, h: torch.Tensor) -> None:
        first, rows = self._rows[seq_id]
        if start != first + rows.shape[0]:
            raise ValueError(f"medusa holds rows up to position {first + rows.shape[0]}, new rows start at {start}")
        rows = torch.cat([rows, h])
        drop = max(0, rows.shape[0] - HISTORY)
        self._rows[seq_id] = (first + drop, rows[drop:])

    @torch.inference_mode()
    def observe(self, seq_id: int, start: int, hidden: dict[int, torch.Tensor]) -> None:
        self._append(seq_id, start, hidden[self.model.config.target_layer])

    @torch.inference_mode()
    def accept(self, result: Verified) -> None:
        first, rows = self._rows[result.seq_id]
        self._append(result.seq_id, first + rows.shape[0],
                     result.target_hidden[self.model.config.target_layer][: result.num_accepted + 1])
        self.calibration.verified(result.seq_id, result.committed)

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        first, rows = self._rows[seq_id]  # rows cover positions [first, tokens - 1): keep those before num_tokens - 1
        keep = num_tokens - 1 - first
        if keep < 1 and first > 0:
            raise RuntimeError(f"medusa rolled back to {num_tokens} tokens, before the {HISTORY} rows it keeps")
        self._rows[seq_id] = (first, rows[: max(0, keep)])

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One pass of the heads over every request's last row."""
        k = self.model.config.num_heads
        live = [i for i, r in enumerate(requests) if r.budget > 0]
        drafts = [EMPTY_DRAFT] * len(requests)
        if not live:
            return drafts
        last = []
        for i in list(live):
            r = requests[i]
            first, rows = self._rows[r.seq_id]
            if rows.shape[0] == 0 and first == len(r.tokens) - 1:  # no row before the anchor: a one-token prompt
                live.remove(i)
                continue
            if first + rows.shape[0] != len(r.tokens) - 1:
                raise RuntimeError(f"medusa holds rows up to position {first + rows.shape[0]}, the anchor is at "
                                   f"{len(r.tokens) - 1}")
            last.append(rows[-1])
        if not live:
            return drafts
        x = self.target.model.norm(torch.stack(last))  # [R, d]
        logits = self.target.lm_head(self.model.states(x.to(self.model.heads[0].weight.dtype)).to(x.dtype)).float()
        for row, i in enumerate(live):  # logits[row]: [K, V]
            r = requests[i]
            tree = r.tree or self.tree
            if tree.enabled and r.budget > 1:
                drafts[i] = self._tree(logits[row], r, tree)
                continue
            n = min(r.budget, k)
            q = node_q(logits[row, :n], r.params)  # [n, V]
            tokens = logits[row, :n].argmax(-1) if r.params.greedy else sample(q, r.generator)
            # p: q's top probability, known before the token is drawn (a sampled chain's cut must not read the token
            # it cuts, policies.py); c: the rank-0 cell's past acceptance where calibrated (raw p understates the
            # heads' acceptance: the dspark rule cut chains of 5 to τ 2.0 from 4.1, reports/trees)
            p = q.max(dim=-1).values.tolist()
            c = [self.calibration(x, 0) for x in p] if tree.rank == "calibrated" else p
            drafts[i] = Draft.chain(tokens.tolist(), None if r.params.greedy else q, torch.tensor(c))
            self.calibration.proposed(r.seq_id, drafts[i], p)
        return drafts

    def paths(self, shape: TreeConfig) -> list[tuple[int, ...]]:
        """The static tree's paths within a tree shape: ranks below its width, at most its depth."""
        return [p for p in self.model.config.tree if len(p) <= shape.depth and max(p) < shape.width] or [(0,)]

    def _tree(self, logits: torch.Tensor, r: DraftRequest, shape: TreeConfig) -> Draft:  # logits [K, V]
        """The static tree's first paths that fit the budget, each node head depth's rank-th choice (point
        masses; the heads' q ranks at any temperature, the request's processed q when it samples)."""
        q = node_q(logits, r.params)
        paths = self.paths(shape)
        width = max(max(p) for p in paths) + 1
        top_p, top_x = q.topk(min(width, q.shape[-1]), dim=-1)  # [K, width]
        index: dict[tuple[int, ...], int] = {}
        tokens, parents, conf, ranks = [], [], [], []
        for path in paths:
            if len(tokens) == min(r.budget, shape.nodes):
                break
            depth, rank = len(path) - 1, path[-1]
            if rank >= top_x.shape[1] or float(top_p[depth, rank]) <= 0:
                continue  # a token q rules out is never worth verifying
            if len(path) > 1 and path[:-1] not in index:
                continue
            index[path] = len(tokens)
            tokens.append(int(top_x[depth, rank]))
            ranks.append(rank)
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
            conf.append(float(top_p[depth, rank]))
        # the static paths rank nothing; the confidences are what the dspark rule cuts the tree by
        c = [self.calibration(x, rank) for x, rank in zip(conf, ranks)] if shape.rank == "calibrated" else conf
        draft = Draft(tokens, confidence=torch.tensor(c), parents=tuple(parents))
        self.calibration.proposed(r.seq_id, draft, conf)
        return draft


# ---- checkpoints ----------------------------------------------------------------------------------------------------
def save_medusa(model: MedusaHeads, path: Path, extra: dict | None = None) -> None:
    save_drafter_dir(path, "medusa", "medusa", model.config.to_dict(), model, model.target_config, extra)


def read_medusa(path: str | Path, target_cfg: ModelConfig) -> MedusaHeads:
    path = Path(path)
    meta = read_drafter_meta(path, ("medusa",), "medusa drafter")
    try:
        cfg = MedusaConfig(**meta["medusa"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not a medusa config: {e}") from None
    check_target(meta, target_cfg, path, "medusa heads")
    if not 0 <= cfg.target_layer <= target_cfg.num_hidden_layers:
        raise CheckpointError(f"{path / 'config.json'}: target layer {cfg.target_layer} outside "
                              f"0..{target_cfg.num_hidden_layers}")
    model = MedusaHeads(target_cfg, cfg)
    state = load_file(str(path / "model.safetensors"))
    check_state(path / "model.safetensors", state, model.state_dict())
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model


def load_medusa(path: str | Path, target: Transformer, tree: TreeConfig = TreeConfig()) -> MedusaDrafter:
    """Trained heads for `target`, in its dtype except for a bf16 target on CPU (fp32 there, as the feature drafters
    run), their matmuls on packed weights."""
    cpu_bf16 = target.dtype == torch.bfloat16 and target.device.type == "cpu"
    model = read_medusa(path, target.config).to(device=target.device, dtype=torch.float32 if cpu_bf16 else target.dtype)
    model.heads = torch.nn.ModuleList(PackedLinear(h) for h in model.heads)
    return MedusaDrafter(model, target, tree)


@register_drafter("medusa", bench_spec=zoo_spec("medusa"), structured=True)
def _build(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device,
           options: dict[str, str] | None = None) -> MedusaDrafter:
    """`medusa:DIR` or `medusa(path=DIR, tree=auto|off, width=W, depth=D, nodes=N)`: trained Medusa heads; a tree
    takes the checkpoint's static paths whose ranks are below W and depths at most D, the first N of them."""
    opts = dict(options or {})
    path = opts.pop("path", None) or arg
    tree = tree_config(opts, "medusa")
    if opts:
        raise ConfigError(f"medusa takes no option {sorted(opts)[0]!r}; options: path, {', '.join(TREE_OPTIONS)}")
    if path is None:
        raise CheckpointError("the medusa drafter needs a checkpoint: medusa:DIR")
    return load_medusa(path, target, tree)
