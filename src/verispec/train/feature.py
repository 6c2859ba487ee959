"""Training EAGLE-3, MTP and Medusa drafters (`verispec train drafter --kind eagle|mtp|medusa`).

Data: the target's own greedy continuations of training-corpus prompts, as for the block drafters. Each step runs
the frozen target over a batch of sequences for its hidden states and next-token distributions p, and trains the
drafter on the continuation part with a soft cross-entropy to p:
- eagle: training-time test (model.feature.FeatureDraftModel.ttt_forward), S unrolled steps, step s weighted
  decay^s, each row's head restricted to the draft vocabulary where one is given (p renormalised over it, as
  EAGLE-3 trains its reduced head);
- mtp: the same layer on the target's last-layer features, one step (DeepSeek-V3's MTP loss, the target frozen);
- medusa: head k on the target's normed last hidden state at j against p at j + k, weighted decay^(k-1).
Held-out evaluation counts the greedy acceptance length tau on fixed anchors of held-out continuations: for the
feature drafters the unrolled recursion with teacher-forced tokens, which drafts exactly what inference drafts up
to the first miss (all tau counts). Resumable from its last checkpoint (safetensors state).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.model import load_model
from verispec.model.feature import FeatureConfig, FeatureDraftModel, default_layers
from verispec.model.medusa import MedusaConfig, MedusaHeads, sparse_tree
from verispec.model.transformer import Transformer
from verispec.train.block import cosine_lr
from verispec.train.checkpointing import load_state, save_state

KINDS = ("eagle", "mtp", "medusa")


@dataclass(frozen=True)
class FeatureTrainConfig:
    kind: str = "eagle"  # eagle | mtp | medusa
    ttt_steps: int = 4  # eagle: steps of the unrolled feature recursion (mtp trains one)
    num_heads: int = 4  # medusa
    batch_size: int = 8  # sequences per step
    prompt_len: int = 128  # rows predicting continuation tokens only
    lr: float = 1e-3
    warmup_steps: int = 30
    max_steps: int = 1000
    weight_decay: float = 0.01
    decay: float = 0.8  # loss weight of unrolled step s (eagle) or head k + 1 (medusa): decay ** s
    # Share of hard CE on the target's greedy token in each row's loss (the rest is the soft CE to p): a near-flat
    # p (a random test model's) carries no signal, the greedy token always does.
    hard_weight: float = 0.0
    checkpoint_every_s: float = 300.0
    seed: int = 0
    target_dtype: str = "fp32"  # the frozen target's compute dtype
    context_window: int = 128  # inference: the latest W..2W entries (training sequences are prompt_len + 128)
    draft_vocab: str | None = None  # eagle/mtp: a draft_vocab.json whose rows the head trains and drafts over

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.target_dtype not in ("fp32", "bf16"):
            raise ValueError(f"target_dtype must be fp32 or bf16, got {self.target_dtype!r}")
        if self.ttt_steps < 1 or self.num_heads < 1:
            raise ValueError("ttt_steps and num_heads must be >= 1")

    def hidden_layers(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers,) if self.kind == "medusa" else default_layers(self.kind, num_layers)

    def build(self, target_cfg) -> FeatureDraftModel | MedusaHeads:
        n = target_cfg.num_hidden_layers
        if self.kind == "medusa":
            return MedusaHeads(target_cfg, MedusaConfig(num_heads=self.num_heads, target_layer=n))
        return FeatureDraftModel(target_cfg, FeatureConfig(self.kind, default_layers(self.kind, n),
                                                           self.context_window))


def _vocab(cfg: FeatureTrainConfig, vocab_size: int) -> torch.Tensor | None:
    if cfg.draft_vocab is None or cfg.kind == "medusa":
        return None
    from verispec.drafters.block import check_draft_vocab

    return check_draft_vocab(torch.tensor(json.loads(Path(cfg.draft_vocab).read_text())["token_ids"]), vocab_size)


def _row_loss(logits: torch.Tensor, p: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
              hard: float) -> torch.Tensor:  # [N, V'], [N, V'], [N] columns, [N] bool -> []
    """(1 - hard) soft CE to p + hard CE on the label column (rows whose label lies in the vocabulary)."""
    logp = logits.log_softmax(-1)
    loss = -(p * logp).sum(-1).mean() * (1 - hard)
    if hard:
        picked = -logp.gather(1, labels[:, None])[:, 0]
        loss = loss + hard * (picked * valid).sum() / valid.sum().clamp(min=1)
    return loss


def feature_losses(
    model: FeatureDraftModel | MedusaHeads, target: Transformer, tokens: torch.Tensor, hidden: dict,
    target_logits: torch.Tensor, cfg: FeatureTrainConfig, vocab: torch.Tensor | None, steps: int,
) -> tuple[torch.Tensor, list[dict]]:
    """The weighted loss and, per step (head), {loss, accuracy} over the rows that predict continuation tokens."""
    b, t = tokens.shape
    head = target.lm_head.weight if vocab is None else target.lm_head.weight[vocab]
    p_all = (target_logits.float() if vocab is None else target_logits.float()[..., vocab]).softmax(-1)
    labels = tokens if vocab is None else torch.searchsorted(vocab, tokens)  # label columns (medusa: full vocab)
    in_vocab = torch.ones_like(tokens, dtype=torch.bool) if vocab is None else vocab[labels.clamp(
        max=len(vocab) - 1)] == tokens
    total, stats = 0.0, []
    if isinstance(model, MedusaHeads):
        x = target.model.norm(hidden[model.config.target_layer].float())  # [B, T, d]
        states = model.states(x)  # [B, T, K, d]
        for k in range(model.config.num_heads):  # head k at row j predicts x_{j+2+k}, p at position j + 1 + k
            rows = torch.arange(cfg.prompt_len - 1, t - 2 - k)
            logits = target.lm_head(states[:, rows, k]).float()  # [B, R, V]
            y = tokens[:, rows + 2 + k]
            loss = _row_loss(logits.flatten(0, 1), p_all[:, rows + 1 + k].flatten(0, 1), y.flatten(),
                             torch.ones_like(y.flatten(), dtype=torch.bool), cfg.hard_weight)
            hit = logits.argmax(-1) == y
            total = total + cfg.decay ** k * loss
            stats.append({"loss": loss.item(), "accuracy": hit.float().mean().item()})
        return total, stats
    feats = model.features({k: v.float() for k, v in hidden.items()})
    outs = model.ttt_forward(target.model.embed_tokens, tokens, feats, steps)
    for s, g in enumerate(outs):  # row j predicts x_{j+2} (p at position j + 1); its draft started after j - s
        rows = torch.arange(max(cfg.prompt_len - 2 + s, s), t - 2)
        logits = model.logits(g[:, rows], head)  # [B, R, V']
        y, ok = labels[:, rows + 2].clamp(max=logits.shape[-1] - 1), in_vocab[:, rows + 2]
        loss = _row_loss(logits.flatten(0, 1), p_all[:, rows + 1].flatten(0, 1), y.flatten(), ok.flatten(),
                         cfg.hard_weight)
        hit = (logits.argmax(-1) == y) & ok
        total = total + cfg.decay ** s * loss
        stats.append({"loss": loss.item(), "accuracy": hit.float().mean().item()})
    return total, stats


def train_feature_drafter(
    target_dir: Path, sequences: np.ndarray, out_dir: Path, cfg: FeatureTrainConfig, progress: bool = True,
    stop_at: int | None = None,
) -> FeatureDraftModel | MedusaHeads | None:
    """Train (or resume) into out_dir/state; the trained model, or None when stopped at `stop_at`."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    target = load_model(target_dir, dtype=cfg.target_dtype).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    model = cfg.build(target.config).train()
    vocab = _vocab(cfg, target.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_dir, step, elapsed, log = out_dir / "state", 0, 0.0, []
    if (state_dir / "meta.json").is_file():
        meta = load_state(state_dir, model, opt)
        step, elapsed, log = meta["step"], meta["elapsed_s"], meta["log"]
    data = torch.from_numpy(sequences.astype(np.int64))
    t_start, last_save = time.perf_counter() - elapsed, time.perf_counter()
    layers = cfg.hidden_layers(target.config.num_hidden_layers)
    steps = 1 if cfg.kind == "mtp" else cfg.ttt_steps

    def checkpoint() -> None:
        save_state(state_dir, model, opt, {"step": step, "elapsed_s": time.perf_counter() - t_start, "log": log,
                                           "config": json.loads(json.dumps(asdict(cfg)))})

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, desc=f"train {cfg.kind}")
    while step < cfg.max_steps:
        if stop_at is not None and step >= stop_at:
            checkpoint()
            return None
        rng = np.random.default_rng([cfg.seed, step, 5])
        tokens = data[torch.from_numpy(rng.integers(0, len(data), size=cfg.batch_size))]
        with torch.no_grad():
            logits_t, hidden = target(tokens, hidden_layers=layers)
        loss, stats = feature_losses(model, target, tokens, hidden, logits_t, cfg, vocab, steps)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        log.append({"step": step, "loss": loss.item(), "accuracy": [s["accuracy"] for s in stats],
                    "elapsed_s": time.perf_counter() - t_start})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=" ".join(f"{s['accuracy']:.2f}" for s in stats))
        if time.perf_counter() - last_save > cfg.checkpoint_every_s:
            checkpoint()
            last_save = time.perf_counter()
    checkpoint()
    bar.close()
    return model.eval()


@torch.no_grad()
def evaluate(model, target_dir: Path, sequences: np.ndarray, cfg: FeatureTrainConfig, depth: int = 8,
             anchors: int = 16, width: int = 8) -> dict:
    """Held-out greedy tau (1 + leading correct drafts, at most `depth`) and per-position survival on fixed
    anchors in the continuations; for Medusa also each head's top-r hit rates (the sparse tree's input)."""
    target = load_model(target_dir, dtype=cfg.target_dtype).eval()
    vocab = _vocab(cfg, target.config.vocab_size)
    layers = cfg.hidden_layers(target.config.num_hidden_layers)
    data = torch.from_numpy(sequences.astype(np.int64))
    rng = np.random.default_rng([cfg.seed, 99])
    runs, ranks = [], []
    for i in range(0, len(data), cfg.batch_size):
        tokens = data[i : i + cfg.batch_size]
        b, t = tokens.shape
        _, hidden = target(tokens, hidden_layers=layers, num_logits=0)
        # anchor a (a committed token at position a): drafts for positions a + 1 .. a + depth
        pos = torch.from_numpy(rng.integers(cfg.prompt_len - 1, t - 1 - depth, size=(b, anchors)))
        labels = tokens[torch.arange(b)[:, None, None], pos[..., None] + 1 + torch.arange(depth)]  # [b, A, depth]
        if isinstance(model, MedusaHeads):
            x = target.model.norm(hidden[model.config.target_layer].float())
            states = model.states(x[torch.arange(b)[:, None], pos - 1])  # [b, A, K, d], row a - 1 reads h
            logits = target.lm_head(states).float()  # [b, A, K, V]
            n = min(depth, model.config.num_heads)
            preds = logits[:, :, :n].argmax(-1)
            top = logits.topk(width, dim=-1).indices  # [b, A, K, width]
            ranks.append((top == labels[:, :, : model.config.num_heads, None]).float().flatten(0, 1))
            hits = preds == labels[:, :, :n]
        else:
            feats = model.features({k: v.float() for k, v in hidden.items()})
            outs = model.ttt_forward(target.model.embed_tokens, tokens, feats, depth)
            head = target.lm_head.weight if vocab is None else target.lm_head.weight[vocab]
            hits = []
            for s, g in enumerate(outs):  # the draft after anchor a starts at row a - 1; step s sits at a - 1 + s
                pred = model.logits(g[torch.arange(b)[:, None], pos - 1 + s], head).argmax(-1)
                hits.append((pred if vocab is None else vocab[pred]) == labels[:, :, s])
            hits = torch.stack(hits, dim=-1)
        runs.append(hits.long().cumprod(-1).flatten(0, 1))
    runs = torch.cat(runs).float()  # [N, depth']
    out = {"tau": 1.0 + runs.sum(-1).mean().item(), "per_pos": runs.mean(0).tolist(), "anchors": len(runs)}
    if ranks:
        out["head_rank_accuracy"] = torch.cat(ranks).mean(0).tolist()  # [K, width]
    return out


def finish_medusa(model: MedusaHeads, held_out: dict, nodes: int = 64) -> MedusaHeads:
    """The heads with their sparse tree from the held-out rank accuracies."""
    from dataclasses import replace

    model.config = replace(model.config, tree=sparse_tree(held_out["head_rank_accuracy"], nodes))
    return model
