"""Resumable training state in safetensors (model, AdamW moments) plus JSON (step, config, log).

Never pickle: the optimizer state is flattened to named tensors and rebuilt against the live parameters.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from verispec.errors import CheckpointError


def save_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    """Atomic: written to a temporary directory, then renamed over the previous state."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{names[id(p)]}.{key}"] = value.detach().contiguous()
    # Tied weights appear twice in state_dict; safetensors refuses shared storage, so clone duplicates.
    seen: set[int] = set()
    for k, v in tensors.items():
        if v.data_ptr() in seen:
            tensors[k] = v.clone()
        seen.add(tensors[k].data_ptr())
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    try:
        tensors = load_file(str(path / "state.safetensors"))
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot resume from {path}: {e}") from None
    model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        if key.startswith("optim."):
            name, _, field = key[len("optim."):].rpartition(".")
            optimizer.state[params[name]][field] = value
    return meta
