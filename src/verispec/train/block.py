"""Training block drafters (`verispec train drafter --kind block|dspark --loss ...`).

Data: the target's own greedy continuations of training-corpus prompts (as DSpark and DFlash train). Each step
runs the frozen target over a batch of sequences for its hidden states (the drafter's context) and its
next-token distributions (the dspark loss's p), picks random anchors in the continuation part, and trains the
drafter to predict the `block_size` tokens after each anchor from [anchor, MASK ...] and the context before the
anchor. Resumable from its last checkpoint (safetensors state), like the target's loop.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from verispec.config import ModelConfig
from verispec.model import load_model
from verispec.model.block import SEQUENTIAL_HEADS, BlockConfig, BlockDraftModel
from verispec.model.transformer import Transformer
from verispec.train.checkpointing import load_state, save_state
from verispec.train.losses import LOSSES, block_loss


@dataclass(frozen=True)
class BlockTrainConfig:
    kind: str = "dspark"  # block (parallel) | dspark (sequential head + confidence head)
    head: str = "markov"  # dspark's sequential head: markov | rnn
    loss: str = "dspark"  # ce | ce+decay | auf | auf+decay | dspark
    block_size: int = 8
    num_layers: int = 2
    target_layers: tuple[int, ...] = (2, 4, 6)  # of the zoo target's 8 layers; never the last
    markov_rank: int = 64
    batch_size: int = 8  # sequences per step
    anchors: int = 8  # anchors per sequence
    prompt_len: int = 128  # anchors are drawn after this many prompt tokens
    lr: float = 1e-3
    warmup_steps: int = 30
    max_steps: int = 300
    weight_decay: float = 0.01
    gamma: float = 4.0  # decay-weight length scale (DFlash/DSpark)
    checkpoint_every_s: float = 300.0
    seed: int = 0
    # The frozen target's compute dtype. bf16 matches serving; fp32 is the fast choice on CPUs without native
    # bf16 matmuls (several times faster there), at the cost of rare near-tie differences in the continuations.
    target_dtype: str = "bf16"
    # Warm start: a shipped drafter directory whose weights (same architecture) the first step starts from, with a
    # fresh optimizer and schedule; a resumed run continues from its own state instead.
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.target_dtype not in ("fp32", "bf16"):
            raise ValueError(f"target_dtype must be fp32 or bf16, got {self.target_dtype!r}")
        if self.kind not in ("block", "dspark"):
            raise ValueError(f"kind must be block or dspark, got {self.kind!r}")
        if self.head not in SEQUENTIAL_HEADS:
            raise ValueError(f"head must be one of {SEQUENTIAL_HEADS}, got {self.head!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        object.__setattr__(self, "target_layers", tuple(self.target_layers))

    def block_config(self, mask_token_id: int) -> BlockConfig:
        # The dspark loss trains a confidence head, so a parallel drafter trained with it gets one too.
        return BlockConfig(target_layers=self.target_layers, block_size=self.block_size, num_layers=self.num_layers,
                           head=self.head if self.kind == "dspark" else "none", markov_rank=self.markov_rank,
                           confidence=self.kind == "dspark" or self.loss == "dspark", mask_token_id=mask_token_id,
                           context_window=self.prompt_len)  # anchors saw prompt_len .. seq_len context positions


@dataclass
class BlockBatch:
    """One step's examples: N = batch_size x anchors blocks."""

    anchors: torch.Tensor  # [N] anchor token ids
    anchor_pos: torch.Tensor  # [N]
    labels: torch.Tensor  # [N, G] the tokens after each anchor
    mask: torch.Tensor  # [N, G] bool: label exists
    seq: torch.Tensor  # [N] which sequence of the batch each block belongs to


def sample_blocks(tokens: torch.Tensor, cfg: BlockTrainConfig, step: int) -> BlockBatch:
    """Anchors uniformly in the continuation part of each sequence (a pure function of the step)."""
    b, t = tokens.shape
    rng = np.random.default_rng([cfg.seed, step, 11])
    lo, hi = cfg.prompt_len - 1, t - 2
    pos = torch.from_numpy(rng.integers(lo, hi + 1, size=(b, cfg.anchors))).flatten()  # [N]
    seq = torch.arange(b).repeat_interleave(cfg.anchors)
    idx = pos[:, None] + 1 + torch.arange(cfg.block_size)[None]  # [N, G]
    mask = idx < t
    labels = tokens[seq[:, None], idx.clamp(max=t - 1)]
    return BlockBatch(tokens[seq, pos], pos, labels, mask, seq)


def block_forward(
    model: BlockDraftModel, target: Transformer, tokens: torch.Tensor, blocks: BlockBatch, hidden: dict
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Draft logits [N, G, V] (teacher-forced Markov bias), confidence [N, G] or None, block states [N, G, d]."""
    t = tokens.shape[1]
    feats = model.context_features({k: v.float() for k, v in hidden.items()})  # [B, T, d]
    positions = torch.arange(t)[None].expand(tokens.shape[0], t)
    ctx = [(k[blocks.seq], v[blocks.seq]) for k, v in model.context_kv(feats, positions)]  # per layer [N, Hkv, T, D]
    ctx_mask = (torch.arange(t)[None, :] < blocks.anchor_pos[:, None])[:, None, None, :]  # [N, 1, 1, T]
    h = model.block_hidden(target.model.embed_tokens, blocks.anchors, blocks.anchor_pos, ctx, ctx_mask)
    logits = target.lm_head(h.to(target.dtype)).float()
    confidence = None
    prev = torch.cat([blocks.anchors[:, None], blocks.labels[:, :-1]], dim=1)  # teacher forcing
    if model.config.head != "none":
        logits = logits + model.head_bias(h, prev).float()
    if model.config.confidence:
        confidence = torch.sigmoid(model.confidence_logit(h, prev).float())
    return logits, confidence, h


class Schedule(Protocol):
    lr: float
    warmup_steps: int
    max_steps: int


def cosine_lr(cfg: Schedule, step: int) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup_steps, then cosine to a tenth of it at cfg.max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(frac, 1.0))))


def block_metrics(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token accuracy on the block and the greedy acceptance length it implies (tau = 1 + leading matches)."""
    hit = (logits.argmax(-1) == labels) & mask
    leading = hit.long().cumprod(dim=1).sum(dim=1).float()
    return {"accuracy": hit.sum().item() / max(mask.sum().item(), 1), "tau": 1.0 + leading.mean().item(),
            "per_pos": (hit.long().cumprod(dim=1).float().mean(0)).tolist()}


def warm_start(model: BlockDraftModel, drafter_dir: Path, target_cfg: ModelConfig) -> None:
    """Copy a shipped drafter's weights into `model`, which must have its architecture (CheckpointError if not)."""
    from verispec.drafters.block import read_block_drafter
    from verispec.errors import CheckpointError

    if not (drafter_dir / "config.json").is_file():
        raise CheckpointError(f"cannot warm-start from {drafter_dir}: no config.json (not a drafter directory)")
    if "quantization_config" in json.loads((drafter_dir / "config.json").read_text()):
        raise CheckpointError(f"cannot warm-start from {drafter_dir}: it is quantized; start from the dense drafter")
    source = read_block_drafter(drafter_dir, target_cfg)
    # The context window is how inference uses the weights, not part of the architecture.
    if replace(source.config, context_window=model.config.context_window) != model.config:
        raise CheckpointError(f"cannot warm-start from {drafter_dir}: its block config {source.config} differs from "
                              f"this run's {model.config}")
    model.load_state_dict(source.state_dict())


def train_block_drafter(
    target_dir: Path, sequences: np.ndarray, out_dir: Path, cfg: BlockTrainConfig, mask_token_id: int,
    progress: bool = True, stop_at: int | None = None, eval_sequences: np.ndarray | None = None,
) -> BlockDraftModel | None:
    """Train (or resume) into out_dir/state; returns the trained model (None when stopped at `stop_at`)."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    target = load_model(target_dir, dtype=cfg.target_dtype).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    model = BlockDraftModel(target.config, cfg.block_config(mask_token_id))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_dir, step, elapsed, log = out_dir / "state", 0, 0.0, []
    if (state_dir / "meta.json").is_file():
        meta = load_state(state_dir, model, opt)
        step, elapsed, log = meta["step"], meta["elapsed_s"], meta["log"]
    elif cfg.init_from is not None:
        warm_start(model, Path(cfg.init_from), target.config)
    data = torch.from_numpy(sequences.astype(np.int64))
    t_start, last_save = time.perf_counter() - elapsed, time.perf_counter()

    def checkpoint() -> None:
        save_state(state_dir, model, opt, {"step": step, "elapsed_s": time.perf_counter() - t_start, "log": log,
                                           "config": json.loads(json.dumps(asdict(cfg)))})

    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, desc=f"train {cfg.kind} ({cfg.loss})")
    layers = cfg.target_layers
    while step < cfg.max_steps:
        if stop_at is not None and step >= stop_at:
            checkpoint()
            return None
        rng = np.random.default_rng([cfg.seed, step, 5])
        tokens = data[torch.from_numpy(rng.integers(0, len(data), size=cfg.batch_size))]
        with torch.no_grad():
            logits_t, hidden = target(tokens, hidden_layers=layers, num_logits=None if cfg.loss == "dspark" else 0)
        blocks = sample_blocks(tokens, cfg, step)
        logits, confidence, _ = block_forward(model, target, tokens, blocks, hidden)
        target_probs = None
        if cfg.loss == "dspark":  # p at the position that predicts each label
            idx = (blocks.anchor_pos[:, None] + torch.arange(cfg.block_size)[None]).clamp(max=tokens.shape[1] - 1)
            target_probs = logits_t[blocks.seq[:, None], idx].float().softmax(-1)
        loss = block_loss(cfg.loss, logits, blocks.labels, blocks.mask, gamma=cfg.gamma,
                          target_probs=target_probs, confidence=confidence)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        m = block_metrics(logits.detach(), blocks.labels, blocks.mask)
        log.append({"step": step, "loss": loss.item(), "accuracy": m["accuracy"], "tau": m["tau"],
                    "elapsed_s": time.perf_counter() - t_start})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{m['accuracy']:.3f}", tau=f"{m['tau']:.2f}")
        if time.perf_counter() - last_save > cfg.checkpoint_every_s:
            checkpoint()
            last_save = time.perf_counter()
    checkpoint()
    bar.close()
    model.eval()
    return model
