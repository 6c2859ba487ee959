"""The Python API: `LLM(target, drafter=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from verispec.config import DEFAULT_DTYPE, SamplingParams, SpecConfig, TreeConfig
from verispec.decode import GenerationResult, StreamEvent, decode, decode_stream
from verispec.drafters.base import Drafter, build_drafter
from verispec.errors import ConfigError
from verispec.model.checkpoint import load_model, parse_dtype
from verispec.model.tokenizer import Tokenizer
from verispec.model.transformer import Transformer
from verispec.policies import AcceptanceEstimator

Prompt = str | Sequence[int]


class LLM:
    """A target model, an optional drafter and a tokenizer, ready to generate.

    target: a checkpoint directory or a loaded Transformer. drafter: a registry spec (`ngram`, `ngram:4`,
    `model:DIR`, `model` for self-drafting) or a Drafter instance; None decodes plainly.
    """

    def __init__(
        self,
        target: str | Path | Transformer,
        drafter: str | Drafter | None = None,
        *,
        k: int = 4,
        verify: str = "auto",
        policy: str = SpecConfig.policy,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        device: str | torch.device = "cpu",
        tokenizer: Tokenizer | str | Path | None = None,
        context_limit: int | None = None,
        kv_tier: str | None = None,
        tree: TreeConfig | None = None,
    ) -> None:
        if isinstance(target, Transformer):
            self.target = target
            source = None
        else:
            source = Path(target)
            self.target = load_model(source, dtype=dtype, device=device)
            self.target.source_dir = source  # lets drafters compare tokenizers with the target's
        if tokenizer is None and source is not None and (source / "tokenizer.json").is_file():
            tokenizer = source
        self.tokenizer = Tokenizer.from_dir(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        if isinstance(drafter, str):
            drafter = build_drafter(drafter, target=self.target, dtype=self.target.dtype, device=self.target.device)
        self.drafter = drafter
        self.spec = SpecConfig(k=k if drafter is not None else 0, verify=verify, policy=policy, kv_tier=kv_tier,
                               tree=tree)
        self.context_limit = context_limit
        # the dspark policy's acceptance record, carried from one generation to the next (outputs never depend on it)
        self.estimator = AcceptanceEstimator(max(k, 1)) if drafter is not None and policy == "dspark" else None

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("text prompts need a tokenizer: the checkpoint has no tokenizer.json")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        return [int(t) for t in prompt]

    def _kwargs(self, plain: bool) -> dict:
        return dict(
            drafter=None if plain else self.drafter,
            spec=SpecConfig(k=0, kv_tier=self.spec.kv_tier) if plain else self.spec,
            tokenizer=self.tokenizer,
            context_limit=self.context_limit,
            estimator=None if plain else self.estimator,
        )

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *, plain: bool = False
    ) -> list[GenerationResult]:
        """Generate for each prompt (text or token ids). `plain=True` skips the drafter (for comparisons)."""
        params = params or SamplingParams()
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # one prompt
        return [decode(self.target, self.encode(p), params, **self._kwargs(plain)) for p in prompts]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        """Yield each round's committed tokens and text delta; the last event carries the full result."""
        return decode_stream(self.target, self.encode(prompt), params or SamplingParams(), **self._kwargs(False))


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


__all__ = ["LLM", "SamplingParams", "parse_dtype", "set_threads"]
