"""Where the shipped models live: `zoo/` at the repository root, or $VERISPEC_ZOO."""

from __future__ import annotations

import os
from pathlib import Path

from verispec.errors import CheckpointError


def zoo_dir() -> Path:
    env = os.environ.get("VERISPEC_ZOO")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "zoo"


def default_target() -> Path:
    path = zoo_dir() / "target"
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no --target given and the zoo has no target model at {path}")
    return path


def default_drafter_spec() -> str | None:
    """The zoo's draft model as a drafter spec, if it ships one."""
    path = zoo_dir() / "drafter"
    return f"model:{path}" if (path / "config.json").is_file() else None


def best_drafter_spec(zoo: Path | None = None) -> str:
    """The zoo's fastest drafter for its target, as a drafter spec: prompt lookup over the DSpark drafter
    (`lookup:dspark:DIR`, the fastest end to end in reports/cpu and reports/bench at k=8) where the zoo ships
    one, else prompt lookup alone (`ngram`), which beat the draft model on every task of reports/bench."""
    zoo = zoo_dir() if zoo is None else zoo
    return f"lookup:dspark:{zoo / 'dspark'}" if (zoo / "dspark" / "config.json").is_file() else "ngram"
