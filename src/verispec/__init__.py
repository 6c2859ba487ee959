"""verispec: lossless speculative decoding.

    from verispec import LLM, SamplingParams
    llm = LLM("path/to/target", drafter="ngram", k=4)
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=64))[0]
"""

from verispec.config import ModelConfig, SamplingParams, SpecConfig
from verispec.errors import CheckpointError, ConfigError, VerispecError

__all__ = ["LLM", "ModelConfig", "SamplingParams", "SpecConfig", "VerispecError", "CheckpointError", "ConfigError"]


def __getattr__(name: str):
    # Lazy: `import verispec` stays cheap and free of torch-side effects until the API is used.
    if name == "LLM":
        from verispec.api import LLM

        return LLM
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")
