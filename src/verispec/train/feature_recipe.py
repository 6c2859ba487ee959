"""The `verispec train drafter --kind eagle|mtp|medusa` recipe: data, training, held-out evaluation, model card."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from verispec.train.block_recipe import _shown
from verispec.train.drafter import claim_run_dir, continuations_file, target_continuations
from verispec.train.feature import FeatureTrainConfig, evaluate, finish_medusa, train_feature_drafter

DESCRIPTION = {
    "eagle": "EAGLE-3-style drafter: one decoder layer over a fusion of the target's hidden states at layers {layers} "
             "and the next token's embedding, drafting from its own output states, trained with training-time test "
             "({ttt} unrolled steps)",
    "mtp": "MTP module (DeepSeek-V3's, depth 1): one decoder layer over the target's last-layer hidden state "
           "(layer {layers}) and the next token's embedding, applied recursively past the first draft",
    "medusa": "Medusa heads: {heads} residual heads on the target's normed last hidden state (layer {layers}), "
              "sharing the target's LM head; a static sparse tree of {nodes} rank paths from held-out accuracies",
}


def train_feature_recipe(args: argparse.Namespace, target: Path, out: Path, zoo_dir: Path) -> int:
    from verispec.drafters.feature import save_feature_drafter
    from verispec.drafters.medusa import save_medusa
    from verispec.model.medusa import MedusaHeads

    defaults = FeatureTrainConfig()
    cfg = FeatureTrainConfig(
        kind=args.kind, ttt_steps=args.ttt_steps or defaults.ttt_steps, num_heads=args.num_heads or defaults.num_heads,
        max_steps=args.max_steps or defaults.max_steps, lr=args.lr or defaults.lr, target_dtype=args.dtype,
        draft_vocab=str(args.draft_vocab) if args.draft_vocab and args.kind != "medusa" else None,
    )
    runs, tokens = args.data_dir / "runs", args.data_dir / "tokens"
    runs.mkdir(parents=True, exist_ok=True)
    trained_for = claim_run_dir(out, target)
    train = target_continuations(target, tokens / "train.bin", continuations_file(target, runs, "train", args.dtype),
                                 num=args.num_sequences, dtype=args.dtype)
    model = train_feature_drafter(target, train, out, cfg, stop_at=args.stop_at)
    if model is None:
        print(f"checkpointed at step {args.stop_at} in {out}/state; rerun to continue")
        return 0
    val = target_continuations(target, tokens / "val.bin", continuations_file(target, runs, "val", args.dtype), num=64,
                               seed=2, dtype=args.dtype)
    held_out = evaluate(model, target, val, cfg)
    meta = json.loads((out / "state" / "meta.json").read_text())
    summary = {"kind": cfg.kind, "parameters": sum(p.numel() for p in model.parameters()), "steps": meta["step"],
               "training_hours": meta["elapsed_s"] / 3600, "held_out": held_out, "num_sequences": len(train),
               "target": {**trained_for, "path": _shown(target)}, "config": json.loads(json.dumps(cfg.__dict__))}
    extra = {"training": summary, "trained_for": summary["target"]}
    if isinstance(model, MedusaHeads):
        save_medusa(finish_medusa(model, held_out), zoo_dir, extra)
    else:
        save_feature_drafter(model, zoo_dir, extra)
        if cfg.draft_vocab:
            shutil.copyfile(cfg.draft_vocab, zoo_dir / "draft_vocab.json")
    (zoo_dir / "README.md").write_text(card(summary, model, target))
    print(f"saved {zoo_dir}: held-out greedy tau {held_out['tau']:.2f}")
    return 0


def card(summary: dict, model, target: Path) -> str:
    c = summary["config"]
    layers = getattr(model.config, "target_layers", None) or [getattr(model.config, "target_layer", None)]
    what = DESCRIPTION[summary["kind"]].format(layers=list(layers), ttt=c["ttt_steps"], heads=c["num_heads"],
                                               nodes=len(getattr(model.config, "tree", ())))
    per_pos = ", ".join(f"{x:.2f}" for x in summary["held_out"]["per_pos"])
    flags = {"eagle": f" --ttt-steps {c['ttt_steps']}", "medusa": f" --num-heads {c['num_heads']}"}.get(
        summary["kind"], "")
    vocab = ""
    if c.get("draft_vocab"):
        flags += f" \\\n        --draft-vocab {_shown(Path(c['draft_vocab']))}"
        vocab = (" The head drafts over the draft vocabulary in `draft_vocab.json` (FR-Spec, as EAGLE-3 reduces its "
                 "head; `vocab=full` in a structured spec ignores it).")
    window = "" if summary["kind"] == "medusa" else (
        f" Proposals see the latest {c['context_window']}..{2 * c['context_window']} committed entries "
        "(`window=N` changes it).")
    t = summary.get("target") or {}
    depth = len(summary["held_out"]["per_pos"])
    return f"""# verispec {summary['kind']} drafter

For `{_shown(target)}` (fingerprint `{t.get('fingerprint')}`): {what}; {summary['parameters'] / 1e6:.2f}M parameters
of its own (the target's embedding and LM head are shared). Weights in bf16 safetensors.{window}{vocab}

## Training
The target's own greedy continuations of training-corpus prompts (PSF-licensed Python sources and docs), soft
cross-entropy to the target's next-token distributions on the continuation part, AdamW lr {c['lr']} (cosine),
{summary['steps']} steps of {c['batch_size']} sequences in {summary['training_hours']:.2f} h on CPU (frozen target in
{c['target_dtype']}). Recipe:

    verispec train drafter --kind {summary['kind']}{flags} \\
        --max-steps {c['max_steps']} --num-sequences {summary['num_sequences']} --dtype {c['target_dtype']}

## Held-out (validation split continuations)
{summary['held_out']['anchors']} fixed anchors in 64 held-out continuations, greedy drafts of up to {depth} tokens:
- greedy acceptance length tau {summary['held_out']['tau']:.2f}
- per-position survival (all before accepted): {per_pos}
"""
