"""Pre-training the zoo's target model, and the language-model training loop the drafter reuses:
next-token cross-entropy, bf16 autocast on CPU, AdamW with warmup and cosine decay, resumable from its last
checkpoint."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.config import ModelConfig
from verispec.model import Transformer, save_model
from verispec.train.checkpointing import load_state, save_state
from verispec.train.data import TokenWindows

# The zoo target: Llama-style, GQA, untied embeddings off (tied), 2048-token context.
TARGET_MODEL = dict(
    model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
    rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=(1,), pad_token_id=2,
)


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 1024
    batch_size: int = 8  # sequences per step
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 1500
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    checkpoint_every_s: float = 300.0
    seed: int = 0
    # Warm start: begin from these weights (fresh optimizer and schedule) and skip the first data_offset steps'
    # batches, so a second stage continues where an earlier run's data order stopped.
    init_from: str | None = None
    data_offset: int = 0
    model: dict = field(default_factory=lambda: dict(TARGET_MODEL))


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lm_loss(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def evaluate(model: Transformer, windows: TokenWindows, max_windows: int, batch_size: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in windows.sequential(batch_size, max_windows):
        total += lm_loss(model, inputs, targets).item() * inputs.numel()
        count += inputs.numel()
    model.train()
    return total / max(count, 1)


def train_target(
    data_dir: Path, out_dir: Path, cfg: TrainConfig, progress: bool = True, stop_at: int | None = None
) -> Path | None:
    """Pre-train the target on data_dir/{train,val}.bin."""
    train = TokenWindows(data_dir / "train.bin", cfg.seq_len, cfg.seed)
    val = TokenWindows(data_dir / "val.bin", cfg.seq_len)
    return train_lm(cfg, lambda step: train.batch(step + cfg.data_offset, cfg.batch_size), val, out_dir, "train target", progress,
                    stop_at)


def train_lm(
    cfg: TrainConfig,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],  # step -> inputs, targets [B, T]
    val: TokenWindows,
    out_dir: Path,
    desc: str,
    progress: bool = True,
    stop_at: int | None = None,
) -> Path | None:
    """Train (or resume) cfg.model into out_dir/state; returns the final bf16 checkpoint out_dir/model.

    `batches(step)` must be a pure function of the step, so a resumed run continues exactly. With `stop_at`,
    checkpoint at that step and return None (a later call resumes): for runs longer than one sitting.
    """
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    model = Transformer(ModelConfig(**cfg.model))
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=0.02)
    if cfg.init_from:
        from verispec.model import load_model

        model.load_state_dict(load_model(Path(cfg.init_from), dtype="fp32").state_dict())
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    state_dir = out_dir / "state"
    log: list[dict] = []
    step, elapsed = 0, 0.0
    if (state_dir / "meta.json").is_file():
        meta = load_state(state_dir, model, opt)
        step, elapsed, log = meta["step"], meta["elapsed_s"], meta["log"]
        if meta["config"] != json.loads(json.dumps(asdict(cfg))):
            print(f"note: resuming {state_dir} with a changed config (steps {meta['config']['max_steps']} -> "
                  f"{cfg.max_steps})")
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not progress, desc=desc, unit="step")
    last_save = time.perf_counter()
    t_start = time.perf_counter() - elapsed
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def checkpoint() -> None:
        meta = {"step": step, "elapsed_s": time.perf_counter() - t_start, "log": log,
                "config": json.loads(json.dumps(asdict(cfg)))}
        save_state(state_dir, model, opt, meta)

    while step < cfg.max_steps:
        if stop_at is not None and step >= stop_at:
            checkpoint()
            bar.close()
            return None
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        inputs, targets = batches(step)
        loss = lm_loss(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        now = time.perf_counter() - t_start
        entry = {"step": step, "train_loss": loss.item(), "elapsed_s": now,
                 "tokens": (step + cfg.data_offset) * tokens_per_step}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            entry["val_loss"] = evaluate(model, val, cfg.eval_windows)
        log.append(entry)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{step * tokens_per_step / max(now, 1e-9):.0f}")
        if time.perf_counter() - last_save > cfg.checkpoint_every_s:
            checkpoint()
            last_save = time.perf_counter()
    checkpoint()
    bar.close()
    final = out_dir / "model"
    model.eval()
    save_model(model, final, dtype="bf16")
    (out_dir / "train_log.json").write_text(json.dumps(log) + "\n")
    return final
