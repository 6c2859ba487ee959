"""Distilling the zoo's draft model from the target: the target's own greedy continuations of training-corpus
prompts (so the drafter learns to agree with the target rather than with the corpus), mixed half and half
with plain corpus windows, trained with the target's loop."""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch

from verispec.cache import KVCache
from verispec.errors import CheckpointError
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


def target_fingerprint(target: Path) -> str:
    """Continuations and drafters trained on them depend on the target's weights: key their files by these.

    A dense checkpoint: its weights file's size and first MiB (the key continuation caches have always had). A
    quantized one (config.json has a quantization_config): the whole file (int4/int8 files are small), so two
    copies of one target by different methods, whose headers and dense tensors agree, never share a key."""
    weights = target / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{target}: no model.safetensors to key the target's continuations by")
    h = hashlib.sha256(str(weights.stat().st_size).encode())
    quantized = "quantization_config" in json.loads((target / "config.json").read_text())
    with weights.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if not quantized:
                break
    return h.hexdigest()[:12]


def target_record(target: Path) -> dict:
    """Which target a drafter (or a training run) is for: its path, fingerprint and quantization scheme."""
    from verispec.quant.format import parse_quant_config

    raw = json.loads((target / "config.json").read_text())
    scheme = None
    if "quantization_config" in raw:
        groups = parse_quant_config(raw["quantization_config"], target).groups
        scheme = ",".join(sorted({s.name for _, s in groups}))
    return {"path": str(target), "fingerprint": target_fingerprint(target), "quantization": scheme}


def continuations_file(target: Path, runs: Path, split: str, dtype: str = "bf16") -> Path:
    suffix = "" if dtype == "bf16" else f"-{dtype}"  # greedy continuations differ (rarely) between dtypes
    return runs / f"continuations-{split}-{target_fingerprint(target)}{suffix}.u16"


def claim_run_dir(out_dir: Path, target: Path) -> dict:
    """Tie a run directory to its target (out_dir/target.json): resuming a run made for another target (say the
    bf16 one, when stage 2 trains for a quantized copy) is refused. Returns the target's record."""
    record = target_record(target)
    f = out_dir / "target.json"
    if f.is_file():
        old = json.loads(f.read_text())
        if old.get("fingerprint") != record["fingerprint"]:
            raise CheckpointError(f"{out_dir} holds a run for target {old.get('path')} (fingerprint "
                                  f"{old.get('fingerprint')}), not {target} ({record['fingerprint']}); "
                                  "pass another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(record, indent=1) + "\n")
    return record


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


def draft_architecture(init_from: Path) -> dict:
    """The model config of a draft model to warm-start from: a dense checkpoint (CheckpointError otherwise)."""
    from verispec.model.checkpoint import load_config

    raw = json.loads((init_from / "config.json").read_text()) if (init_from / "config.json").is_file() else {}
    if "quantization_config" in raw:
        raise CheckpointError(f"cannot warm-start from {init_from}: it is quantized; start from the dense drafter")
    cfg = load_config(init_from)
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def train_drafter(target_dir: Path, data_dir: Path, out_dir: Path, cfg: TrainConfig = DRAFT_TRAIN,
                  num_sequences: int = 1536, progress: bool = True, continuations: Path | None = None,
                  dtype: str = "bf16", stop_at: int | None = None) -> Path | None:
    """Train (or resume) the draft model in out_dir on `target_dir`'s continuations (cached in `continuations`,
    default out_dir/continuations-FINGERPRINT.u16); None when stopped at `stop_at`."""
    claim_run_dir(out_dir, target_dir)
    suffix = "" if dtype == "bf16" else f"-{dtype}"
    continuations = continuations or out_dir / f"continuations-{target_fingerprint(target_dir)}{suffix}.u16"
    distill = torch.from_numpy(target_continuations(
        target_dir, data_dir / "train.bin", continuations, num=num_sequences, progress=progress, dtype=dtype
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
    return train_lm(cfg, batches, val, out_dir, "train drafter", progress, stop_at=stop_at)
