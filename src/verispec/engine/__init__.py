"""Continuous batching with per-request speculation and load-aware verification scheduling."""

from verispec.engine.engine import Engine
from verispec.engine.request import RequestOutput

__all__ = ["Engine", "RequestOutput"]
