"""Logits -> probabilities and seeded sampling. Pure tensor functions.

The *processed* distribution (temperature, top-k, top-p applied) is the distribution the output must follow:
p for the target and q for the draft are always processed with the same parameters.
"""

from __future__ import annotations

import math

import torch

from verispec.config import SamplingParams
from verispec.kernels import native

_FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; an unseeded request draws its seed from torch's global RNG."""
    g = torch.Generator(device=device)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    g.manual_seed(seed)
    return g


def logits_to_probs(
    logits: torch.Tensor,  # [..., V]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., V] fp32, rows sum to 1
    """Processed sampling distribution. temperature must be finite and > 0 (greedy does not need probabilities).

    Scaled as (l - max l) / T: the top logit maps to exactly 0 and every other one to a value <= 0 (-inf where it
    overflows), so no temperature, however small, yields inf or NaN. Once exp((l_i - max l) / T) underflows for
    every other token the row is the point mass on the argmax, which is softmax(l / T) to fp32 precision; exact
    ties share the mass, as they do at every temperature."""
    if not 0 < temperature < math.inf:
        raise ValueError(f"logits_to_probs needs a finite temperature > 0, got {temperature}; "
                         "use greedy() for temperature 0")
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    if temperature < _FP32_TINY:  # T would round to a subnormal or 0 in fp32 (0 / 0 = NaN): divide in fp64
        logits = (shifted.double() / temperature).float()
    else:
        logits = shifted / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # Stable: among equal logits the lowest token id comes first, as in greedy().
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        # The top token always stays (a top_p below fp32's range would otherwise compare 0 >= 0 and drop it).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return logits_to_probs(logits, params.temperature, params.top_k, params.top_p)


def greedy(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
    """argmax; ties go to the lowest token id in every path (torch.argmax returns the first maximum). On the CPU
    through the native kernel where it builds: torch's CPU argmax is scalar, a tenth of a verify step's overhead."""
    if (logits.device.type == "cpu" and logits.dim() in (1, 2) and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.shape[-1] > 0 and native.available()):
        rows = logits.reshape(-1, logits.shape[-1])
        out = native.argmax(rows)
        return out.view(logits.shape[:-1])
    return logits.argmax(dim=-1)


def greedy_ids(logits: torch.Tensor) -> list[int]:  # [R, V] -> R token ids
    """greedy() of each row as Python ints (native.argmax_ids on the CPU: no output tensor to build and read)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.shape[-1] > 0 and native.available()):
        return native.argmax_ids(logits)
    return greedy(logits).tolist()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:  # [..., V] -> [...]
    """Sample from each row with an exponential race: argmax(p / E), E ~ Exp(1), which is exact and sync-free."""
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(1.0, generator=generator)
    return (probs.float() / noise).argmax(dim=-1)
