"""Finishing a trained model for the zoo: held-out perplexity per part, a loss-curve PNG and a model card,
next to the bf16 weights and the tokenizer."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from verispec.model import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.train.corpus import LICENCE, read_split
from verispec.train.target import lm_loss


@torch.no_grad()
def part_perplexity(model_dir: Path, corpus: Path, tokenizer: Tokenizer, split: str = "bench",
                    seq_len: int = 1024, max_windows: int = 24) -> dict[str, float]:
    """exp(mean next-token loss) on windows of each part (code, prose) of a held-out split."""
    model = load_model(model_dir, dtype="fp32")
    streams: dict[str, list[int]] = {"code": [], "prose": []}
    for doc in read_split(corpus, split):
        stream = streams[doc.part]
        if len(stream) < max_windows * (seq_len + 1):
            stream.extend([tokenizer.bos_token_id, *tokenizer.encode(doc.text), tokenizer.eos_token_ids[0]])
    out = {}
    for part, stream in streams.items():
        n = min(max_windows, (len(stream) - 1) // seq_len)
        rows = torch.tensor(np.asarray(stream[: n * seq_len + 1]))
        losses = []
        for i in range(n):
            window = rows[i * seq_len : (i + 1) * seq_len + 1][None]
            losses.append(lm_loss(model, window[:, :-1], window[:, 1:]).item())
        out[part] = math.exp(sum(losses) / len(losses))
    return out


def plot_losses(log: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [e["tokens"] / 1e6 for e in log]
    ax.plot(tokens, [e["train_loss"] for e in log], lw=0.8, alpha=0.6, label="train")
    val = [(e["tokens"] / 1e6, e["val_loss"]) for e in log if "val_loss" in e]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TARGET_METHOD = "Next-token cross-entropy on the corpus"
DRAFTER_METHOD = ("Distilled from the target: next-token cross-entropy on the target's own greedy continuations "
                  "of training-corpus prompts (half of each batch) and on corpus windows (the other half)")


def finalize(run_dir: Path, data_dir: Path, zoo_dir: Path, name: str, role: str, method: str = TARGET_METHOD,
             recipe: str = "verispec train target", earlier: dict | None = None,
             trained_for: dict | None = None) -> dict:
    """Copy run_dir/model (bf16) and the tokenizer into zoo_dir, with loss.png and a README model card.

    `earlier`: the training summary of the run this one warm-started from (a second stage): the card and the
    summary then report both stages and their totals. `trained_for`: a drafter's target (train.drafter's
    target_record), kept in the summary and named on the card."""
    zoo_dir.mkdir(parents=True, exist_ok=True)
    for f in (run_dir / "model").iterdir():
        shutil.copy2(f, zoo_dir / f.name)
    for f in (data_dir / "tokenizer").iterdir():
        shutil.copy2(f, zoo_dir / f.name)
    meta = json.loads((run_dir / "state" / "meta.json").read_text())
    log, cfg = meta["log"], meta["config"]
    plot_losses(log, zoo_dir / "loss.png", f"verispec {name}: training and validation loss")
    tokenizer = Tokenizer.from_dir(zoo_dir)
    ppl = part_perplexity(zoo_dir, data_dir / "corpus", tokenizer)
    model = load_model(zoo_dir)
    params = sum(p.numel() for p in model.parameters())
    corpus_manifest = json.loads((data_dir / "corpus" / "manifest.json").read_text())
    val = [e for e in log if "val_loss" in e]
    summary = {
        "name": name, "role": role, "parameters": params, "steps": meta["step"],
        "training_tokens": log[-1]["tokens"], "training_hours": meta["elapsed_s"] / 3600,
        "final_train_loss": sum(e["train_loss"] for e in log[-20:]) / min(20, len(log)),
        "final_val_loss": val[-1]["val_loss"] if val else None, "heldout_perplexity": ppl,
        "config": cfg,
    }
    if trained_for is not None:
        summary["trained_for"] = trained_for
    stages = ""
    if earlier is not None:
        summary["stages"] = [*earlier.get("stages", [_stage(earlier)]), _stage(summary)]
        summary["steps"] = sum(st["steps"] for st in summary["stages"])
        summary["training_hours"] = sum(st["training_hours"] for st in summary["stages"])
        stages = "\n\nTrained in stages (each later one warm-starts from the weights of the one before, with a fresh " \
                 "optimizer and schedule, and continues the data order):\n" + "\n".join(
                     f"- stage {i}: {st['steps']} steps, peak lr {st['config']['lr']}, {st['training_hours']:.2f} h, "
                     f"validation loss {st['final_val_loss']:.3f}" for i, st in enumerate(summary["stages"], 1)) + \
                 f"\n- total: {summary['steps']} steps = {log[-1]['tokens'] / 1e6:.1f}M tokens in " \
                 f"{summary['training_hours']:.2f} h"
    (zoo_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    c = model.config
    card = f"""# verispec {name}

The {role} of verispec's model zoo: a {params / 1e6:.1f}M-parameter Llama-style decoder (d={c.hidden_size},
{c.num_hidden_layers} layers, {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, SwiGLU
{c.intermediate_size}, RoPE θ={c.rope_theta:g}, tied embeddings, {c.max_position_embeddings}-token context),
trained from scratch on CPU. Weights in bf16 safetensors, Hugging Face layout (`LlamaForCausalLM`).

## Data
{corpus_manifest['sources']['code']['what']} and {corpus_manifest['sources']['prose']['what']}
({corpus_manifest['sources']['prose']['from']}); licence {LICENCE}. Split by file:
{corpus_manifest['split']}. Tokenizer: byte-level BPE, {tokenizer.vocab_size} tokens, special tokens
`<|bos|>` `<|eos|>` `<|pad|>` `<|mask|>` (ids 0-3), trained on the train split.

## Training
{method}; AdamW (β 0.9/0.95, weight decay {cfg['weight_decay']}), peak lr {cfg['lr']} with
{cfg['warmup_steps']} warmup steps and cosine decay to {cfg['min_lr_ratio']}×, {cfg['batch_size']}×{cfg['seq_len']}
tokens per step, bf16 autocast, {meta['step']} steps = {meta['step'] * cfg['batch_size'] * cfg['seq_len'] / 1e6:.1f}M tokens in
{meta['elapsed_s'] / 3600:.2f} h on 2 CPU cores. Recipe: `{recipe}`.{stages}{_target_line(trained_for)}

## Results
- final train loss (mean of the last 20 steps): {summary['final_train_loss']:.3f} nats/token
- final validation loss: {summary['final_val_loss']:.3f} nats/token
- held-out (bench split) perplexity: code {ppl['code']:.2f}, prose {ppl['prose']:.2f}

![loss curves](loss.png)
"""
    (zoo_dir / "README.md").write_text(card)
    return summary


def _stage(summary: dict) -> dict:
    cfg = summary["config"]
    stage = {k: summary[k] for k in ("steps", "training_hours", "final_val_loss", "config")}
    return {**stage, "training_tokens": summary["steps"] * cfg["batch_size"] * cfg["seq_len"]}


def _target_line(trained_for: dict | None) -> str:
    if trained_for is None:
        return ""
    quant = f", {trained_for['quantization']} weights" if trained_for.get("quantization") else ""
    return f"\n\nTrained for the target `{trained_for['path']}` (fingerprint `{trained_for['fingerprint']}`{quant})."
