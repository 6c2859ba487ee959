"""Drafter directories that only run beside their target (block, dspark, eagle, mtp, medusa): config.json names the
kind (DRAFTER_KIND_KEY), the kind's config section and the target shape it was trained for; model.safetensors holds
the weights in bf16. Reading checks every part and names what does not fit (CheckpointError)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from verispec.config import ModelConfig, TreeConfig
from verispec.drafters.tree import TREE_OPTIONS, tree_config
from verispec.errors import CheckpointError, ConfigError
from verispec.model.checkpoint import DRAFTER_KIND_KEY

TARGET_KEYS = ("hidden_size", "vocab_size", "num_hidden_layers")


def save_drafter_dir(path: Path, kind: str, section: str, config: dict, model: nn.Module, target_cfg: ModelConfig,
                     extra: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    meta = {DRAFTER_KIND_KEY: kind, section: config,
            "target": {key: getattr(target_cfg, key) for key in TARGET_KEYS}, **(extra or {})}
    (path / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))


def zoo_spec(kind: str) -> Callable[[Path], str | None]:
    """The benchmark's spec for a drafter of `kind` shipped in the zoo as zoo/KIND (None where it is not)."""
    def spec(zoo: Path) -> str | None:
        return f"{kind}:{zoo / kind}" if (zoo / kind / "config.json").is_file() else None

    return spec


@dataclass(frozen=True)
class DirOptions:
    """A structured spec's options for a drafter directory beside its target."""
    path: str
    tree: TreeConfig
    draft_vocab: bool  # use the directory's draft vocabulary where it ships one
    context_window: int | None  # None: the checkpoint's own


def dir_options(kind: str, arg: str | None, options: dict[str, str]) -> DirOptions:
    """`kind(path=DIR, window=N, vocab=draft|full, tree=auto|off, width=W, depth=D, nodes=N, rank=calibrated|q)`;
    an unknown option or a bad value is a ConfigError naming it."""
    opts = dict(options)
    path = opts.pop("path", None) or arg
    tree = tree_config(opts, kind)
    window, vocab = opts.pop("window", None), opts.pop("vocab", "draft")
    if opts:
        raise ConfigError(f"{kind} takes no option {sorted(opts)[0]!r}; options: path, window, vocab, "
                          f"{', '.join(TREE_OPTIONS)}")
    if path is None:
        raise CheckpointError(f"the {kind} drafter needs a checkpoint: {kind}:DIR")
    if window is not None and not window.isdigit():
        raise ConfigError(f"{kind} option window: expected a whole number >= 0, got {window!r}")
    if vocab not in ("draft", "full"):
        raise ConfigError(f"{kind} option vocab: draft or full, got {vocab!r}")
    return DirOptions(path, tree, vocab == "draft", None if window is None else int(window))


def read_drafter_meta(path: Path, kinds: tuple[str, ...], what: str) -> dict:
    """config.json of a directory holding one of `kinds` (and its weights file)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{path} is not a {what} checkpoint (needs config.json and model.safetensors)")
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not a {what} config: {e}") from None
    found = meta.get(DRAFTER_KIND_KEY) if isinstance(meta, dict) else None
    if found not in kinds:
        raise CheckpointError(f"{path} holds {f'a {found} drafter' if found else 'not a verispec drafter'}, "
                              f"not a {what}")
    return meta


def check_target(meta: dict, target_cfg: ModelConfig, path: Path, what: str) -> None:
    want = meta.get("target", {})
    for key in TARGET_KEYS:
        if want.get(key) != getattr(target_cfg, key):
            raise CheckpointError(f"{what} {path} was trained for a target with {key}={want.get(key)}, this target "
                                  f"has {getattr(target_cfg, key)}")


def check_state(weights: Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every expected tensor present with its shape, nothing else."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{weights}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in expected.items():
        if state[k].shape != v.shape:
            raise CheckpointError(f"{weights}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
