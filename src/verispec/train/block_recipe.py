"""The `verispec train drafter --kind block|dspark` recipe: data, training, held-out evaluation, model card."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from verispec.drafters.block import VOCAB_FILE, save_block_drafter
from verispec.model import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.train.block import BlockTrainConfig, block_forward, block_metrics, sample_blocks, train_block_drafter
from verispec.train.drafter import (  # noqa: F401  (continuations_file, target_fingerprint: bench.ablation's)
    claim_run_dir,
    continuations_file,
    target_continuations,
    target_fingerprint,
)

MASK_TOKEN = "<|mask|>"


@torch.no_grad()
def evaluate(model, target_dir: Path, sequences: np.ndarray, cfg: BlockTrainConfig, batches: int = 8) -> dict:
    """Held-out block accuracy, greedy tau and per-position survival on fixed anchors."""
    target = load_model(target_dir, dtype=cfg.target_dtype).eval()
    data = torch.from_numpy(sequences.astype(np.int64))
    totals = {"accuracy": [], "tau": [], "per_pos": []}
    for i in range(batches):
        tokens = data[i * cfg.batch_size : (i + 1) * cfg.batch_size]
        if len(tokens) == 0:
            break
        _, hidden = target(tokens, hidden_layers=cfg.target_layers, num_logits=0)
        blocks = sample_blocks(tokens, cfg, step=10**6 + i)
        logits, _, _ = block_forward(model, target, tokens, blocks, hidden)
        m = block_metrics(logits, blocks.labels, blocks.mask)
        for k in totals:
            totals[k].append(m[k])
    return {"accuracy": float(np.mean(totals["accuracy"])), "tau": float(np.mean(totals["tau"])),
            "per_pos": np.mean(np.array(totals["per_pos"]), axis=0).tolist()}


def train_block_recipe(args: argparse.Namespace, target: Path, out: Path, zoo_dir: Path) -> int:
    defaults = BlockTrainConfig()
    cfg = BlockTrainConfig(
        kind=args.kind, head=args.head, loss=args.loss or ("dspark" if args.kind == "dspark" else "ce+decay"),
        block_size=args.block_size, max_steps=args.max_steps or defaults.max_steps,
        anchors=args.anchors or defaults.anchors, target_dtype=args.dtype,
        lr=args.lr or defaults.lr, init_from=str(args.init_from) if args.init_from else None,
    )
    tokenizer = Tokenizer.from_dir(target)
    mask_id = tokenizer.token_id(MASK_TOKEN)
    runs = args.data_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    tokens = args.data_dir / "tokens"
    trained_for = claim_run_dir(out, target)
    train = target_continuations(target, tokens / "train.bin", continuations_file(target, runs, "train", args.dtype),
                                 num=args.num_sequences, dtype=args.dtype)
    model = train_block_drafter(target, train, out, cfg, mask_id, stop_at=args.stop_at)
    if model is None:
        print(f"checkpointed at step {args.stop_at} in {out}/state; rerun to continue")
        return 0
    val = target_continuations(target, tokens / "val.bin", continuations_file(target, runs, "val", args.dtype), num=64,
                               seed=2, dtype=args.dtype)
    held_out = evaluate(model, target, val, cfg)
    meta = json.loads((out / "state" / "meta.json").read_text())
    summary = {"kind": cfg.kind, "loss": cfg.loss, "parameters": sum(p.numel() for p in model.parameters()),
               "steps": meta["step"], "training_hours": meta["elapsed_s"] / 3600, "held_out": held_out,
               "num_sequences": len(train), "target": {**trained_for, "path": _shown(target)},
               "config": json.loads(json.dumps(cfg.__dict__, default=list))}
    # `trained_for` names the target whose continuations and hidden states trained it (a quantized copy in stage 2)
    save_block_drafter(model, zoo_dir, extra={"training": summary, "trained_for": summary["target"]})
    carry_draft_vocab(cfg.init_from, zoo_dir)
    (zoo_dir / "README.md").write_text(card(summary, target))
    print(f"saved {zoo_dir}: held-out block accuracy {held_out['accuracy']:.3f}, greedy tau {held_out['tau']:.2f}")
    return 0


def carry_draft_vocab(init_from: str | None, zoo_dir: Path) -> bool:
    """A warm-started drafter keeps its source's draft vocabulary (FR-Spec: the tokens of the text domain, the same
    for a quantized copy of the target), as a stage-2 run must to draft as the shipped drafter does. Its calibration
    is the target's and is made again (`verispec calibrate`). Returns whether a vocabulary was carried."""
    src = Path(init_from) / VOCAB_FILE if init_from else None
    if src is None or not src.is_file():
        return False
    shutil.copyfile(src, zoo_dir / VOCAB_FILE)
    return True


def card(summary: dict, target: Path) -> str:
    c = summary["config"]
    heads = {"markov": "Markov head", "rnn": "RNN head"}
    head = "{} (rank {}) and confidence head".format(heads[c.get("head", "markov")], c["markov_rank"]) \
        if summary["kind"] == "dspark" else "no sequential head (parallel)"
    per_pos = ", ".join(f"{x:.2f}" for x in summary["held_out"]["per_pos"])
    warm = ""
    if c.get("init_from"):  # a warm-started leg: its steps come on top of the source drafter's
        warm = f" --lr {c['lr']} \\\n        --init-from {_shown(Path(c['init_from']))}"
    rnn = " --head rnn" if summary["kind"] == "dspark" and c.get("head") == "rnn" else ""
    t = summary.get("target") or {}
    quant = f" ({t['quantization']} weights)" if t.get("quantization") else ""
    return f"""# verispec {summary['kind']} drafter

A block drafter for `{_shown(target)}`{quant} (fingerprint `{t.get('fingerprint')}`): {c['num_layers']} decoder
layers over the target's hidden states at layers {c['target_layers']}, block size {c['block_size']}, {head};
{summary['parameters'] / 1e6:.2f}M parameters of its own (the target's embedding and LM head are shared). Weights in
bf16 safetensors. Proposals see the latest {c['prompt_len']}..{2 * c['prompt_len']} context positions
(`context_window`, as in training; `:window=N` changes it).

## Training
The target's own greedy continuations of training-corpus prompts (PSF-licensed Python sources and docs),
{c['anchors']} random anchors per sequence, loss `{summary['loss']}`, AdamW lr {c['lr']}, {summary['steps']} steps of
{c['batch_size']} sequences in {summary['training_hours']:.2f} h on CPU (frozen target in {c['target_dtype']}). Recipe:

    verispec train drafter --target {_shown(target)} --kind {summary['kind']}{rnn} --loss {summary['loss']} \\
        --block-size {c['block_size']} --anchors {c['anchors']} --max-steps {c['max_steps']} \\
        --num-sequences {summary.get('num_sequences', 1536)} --dtype {c['target_dtype']}{warm}

## Held-out (validation split continuations)
- block token accuracy {summary['held_out']['accuracy']:.3f}; greedy acceptance length tau {summary['held_out']['tau']:.2f}
- per-position survival (all before accepted): {per_pos}
"""


def _shown(path: Path) -> str:
    """A path as a card shows it: relative to the working directory when under it (cards ship in the repo)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
