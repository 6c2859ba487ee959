"""The target model: `Transformer`, and checkpoints (`load_config`, `load_model`, `save_model`).

The names load on first use (PEP 562), so importing one of this package's leaf modules, such as `model.packing`
(which quant.linear builds on), does not import the transformer and its fused forward, which import quant.linear
back: `import verispec.quant.linear` alone used to fail on that cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verispec.model.checkpoint import load_config, load_model, save_model
    from verispec.model.transformer import Transformer

__all__ = ["Transformer", "load_config", "load_model", "save_model"]


def __getattr__(name: str) -> Any:
    if name == "Transformer":
        from verispec.model.transformer import Transformer

        return Transformer
    if name in ("load_config", "load_model", "save_model"):
        from verispec.model import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
