from verispec.model.checkpoint import load_config, load_model, save_model
from verispec.model.transformer import Transformer

__all__ = ["Transformer", "load_config", "load_model", "save_model"]
