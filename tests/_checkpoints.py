"""Broken copies of a checkpoint directory, for the tests that a bad checkpoint fails with a message naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def edited_copy(src: Path, dst: Path, edit: Callable[[dict, dict[str, torch.Tensor]], None]) -> Path:
    """dst: a copy of the checkpoint directory src after edit(config, tensors) changed its config.json and
    model.safetensors in place."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    state = load_file(str(dst / "model.safetensors"))
    edit(cfg, state)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(dst / "model.safetensors"))
    return dst
