"""Distilling the zoo's draft model from the target: the target's own greedy continuations of training-corpus
prompts (so the drafter learns to agree with the target rather than with the corpus), mixed half and half
with plain corpus windows, trained with the target's loop."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from verispec.cache import KVCache
from verispec.model import load_model
from verispec.train.data import TokenWindows
from verispec.train.target import TrainConfig, train_lm

# <= 1/8 of the target's parameters (3.57M vs 29.4M): most of it is the 8k x 256 embedding.
DRAFT_MODEL = dict(
    model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=(1,), pad_token_id=2,
)
DRAFT_TRAIN = TrainConfig(seq_len=256, batch_size=16, lr=2e-3, warmup_steps=50, max_steps=800, eval_every=200,
                          model=DRAFT_MODEL)


@torch.inference_mode()
def target_continuations(target_dir: Path, train_tokens: Path, out: Path, num: int = 1536, prompt_len: int = 128,
                         new_tokens: int = 128, batch: int = 32, seed: int = 1, progress: bool = True,
                         dtype: str = "bf16") -> np.ndarray:
    """[num, prompt_len + new_tokens] uint16: corpus prompts followed by the target's greedy continuation.

    Batched: every row has the same prompt length, so one cache with batch rows serves them all. Rows are
    written as they finish and reused on a rerun."""
    from tqdm import tqdm

    width = prompt_len + new_tokens
    done = np.fromfile(out, dtype=np.uint16).reshape(-1, width) if out.is_file() else np.zeros((0, width), np.uint16)
    if len(done) >= num:
        return done[:num]
    target = load_model(target_dir, dtype=dtype)
    windows = TokenWindows(train_tokens, prompt_len - 1, seed)
    bar = tqdm(total=num, initial=len(done), disable=not progress, desc="target continuations", unit="seq")
    with out.open("ab") as f:
        for start in range(len(done), num, batch):
            rows = min(batch, num - start)
            x, y = windows.batch(start // batch, rows)
            prompts = torch.cat([x, y[:, -1:]], dim=1)  # [rows, prompt_len]
            cache = KVCache.for_model(target, max_len=width, batch=rows)
            logits, _ = target(prompts, cache=cache, num_logits=1)
            out_tokens = [logits[:, -1].argmax(-1)]
            for _ in range(new_tokens - 1):
                logits, _ = target(out_tokens[-1][:, None], cache=cache)
                out_tokens.append(logits[:, -1].argmax(-1))
            block = torch.cat([prompts, torch.stack(out_tokens, dim=1)], dim=1).numpy().astype(np.uint16)
            block.tofile(f)
            f.flush()
            bar.update(rows)
    bar.close()
    return np.fromfile(out, dtype=np.uint16).reshape(-1, width)[:num]


def train_drafter(target_dir: Path, data_dir: Path, out_dir: Path, cfg: TrainConfig = DRAFT_TRAIN,
                  num_sequences: int = 1536, progress: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    distill = torch.from_numpy(target_continuations(
        target_dir, data_dir / "train.bin", out_dir / "continuations.u16", num=num_sequences, progress=progress
    ).astype(np.int64))
    corpus = TokenWindows(data_dir / "train.bin", cfg.seq_len, cfg.seed + 1)
    val = TokenWindows(data_dir / "val.bin", cfg.seq_len)
    half = cfg.batch_size // 2

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([cfg.seed, step, 7])
        rows = distill[torch.from_numpy(rng.integers(0, len(distill), size=half))]  # [half, seq_len]
        cx, cy = corpus.batch(step, cfg.batch_size - half)
        return torch.cat([rows[:, :-1], cx[:, : rows.shape[1] - 1]]), torch.cat([rows[:, 1:], cy[:, : rows.shape[1] - 1]])

    cfg = replace(cfg, seq_len=distill.shape[1] - 1)
    return train_lm(cfg, batches, val, out_dir, "train drafter", progress)
