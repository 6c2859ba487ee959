"""The target's step time against the number of tokens verified in one step: SPS(B) for the dspark policy.

Measured once per (model, dtype, threads, device) and cached as JSON. A step over R requests and B tokens costs
`time(B) + (R - 1) * per_request_s`: the token cost is measured with one request, the per-request cost (one
attention call and cache write per layer) from R requests of one token each against one request of R tokens.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.kernels import native
from verispec.model.transformer import Transformer
from verispec.paths import user_cache

# Every count up to 16: a verify step's cost moves in steps with the matmul's row tiles (on a 2-vCPU AVX2 machine
# 7 rows cost ~1.7 ms more than 6), which is what the dspark rule weighs at k <= 15; sparser past it (prefills).
DEFAULT_TOKENS = (*range(1, 17), 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class StepProfile:
    key: dict
    tokens: tuple[int, ...]  # B, ascending
    seconds: tuple[float, ...]  # median step time at each B (one request)
    per_request_s: float  # extra cost of each request beyond the first
    context: int  # committed tokens in each request's cache while measuring

    @functools.cached_property
    def _rising(self) -> tuple[float, ...]:
        """The measured seconds made non-decreasing: more tokens never cost less, a measured dip is the machine's
        noise. Computed once (step_time runs per draft position every round)."""
        return tuple(itertools.accumulate(self.seconds, max))

    def step_time(self, tokens: int, requests: int = 1) -> float:
        """Linear interpolation between the (non-decreasing) measured points, linear extrapolation past the last
        two."""
        xs, ys = self.tokens, self._rising
        if tokens <= xs[0]:
            t = ys[0]
        else:
            i = next((i for i, x in enumerate(xs) if x >= tokens), len(xs) - 1)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            t = y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        return max(t, 1e-9) + max(requests - 1, 0) * self.per_request_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> StepProfile:
        d = json.loads(text)
        return StepProfile(d["key"], tuple(d["tokens"]), tuple(d["seconds"]), d["per_request_s"], d["context"])


def profile_key(target: Transformer) -> dict:
    cfg = json.dumps(target.config.to_hf_dict(), sort_keys=True)
    weights = hashlib.sha256()
    for p in list(target.parameters())[:4]:  # cheap fingerprint: config + a few weight tensors
        weights.update(p.detach().float().flatten()[:256].numpy().tobytes())
    return {
        "model": hashlib.sha256(cfg.encode()).hexdigest()[:16] + "-" + weights.hexdigest()[:16],
        "dtype": str(target.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "packed": target.packed,
        "matmuls": target.matmuls,
        "kernels": native.isa(),  # the instruction set of the native kernels (None: torch's)
        "forward": "native" if target.fused is not None else "torch",
        "method": 3,  # how measure() times which points (older profiles are measured again)
    }


def cache_dir() -> Path:
    return user_cache("profiles")


def cache_path(key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{name}.json"


def _time_step(target: Transformer, caches: list[KVCache], lengths: list[int], context: int) -> float:
    """One step's seconds: the given requests (caches at `context` positions) verifying `lengths` tokens each."""
    device = target.device
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, target.config.vocab_size, (sum(lengths),), generator=gen).to(device)
    logit_rows = torch.arange(sum(lengths), device=device)
    for c in caches:
        c.truncate(context)
    batch = PackedBatch.build(caches, lengths, device)
    t0 = time.perf_counter()
    target.forward_packed(tokens, batch, logit_rows)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure(
    target: Transformer, token_counts: tuple[int, ...] = DEFAULT_TOKENS, context: int = 128, repeats: int = 15,
    progress: bool = False,
) -> StepProfile:
    """Medians of `repeats` rounds, each timing every point once in turn: on a shared, noisy machine a slow moment
    then spreads over all points instead of bending the curve at a few (the dspark rule reads its slope)."""
    limit = target.config.context_limit
    token_counts = tuple(b for b in token_counts if b <= limit // 2) or (1,)
    max_b = max(*token_counts, 8)  # 8: the per-request probe below
    context = max(1, min(context, limit - max_b - 1))
    caches = [KVCache.for_model(target, max_len=context + max_b + 1) for _ in range(8)]
    gen = torch.Generator().manual_seed(0)  # leave the global RNG alone
    prompt = torch.randint(0, target.config.vocab_size, (1, context), generator=gen).to(target.device)
    for c in caches:
        target(prompt, cache=c, num_logits=0)
    # Points: one request verifying B tokens, then 8 requests of one token against one request of 8.
    points = [(caches[:1], [b]) for b in token_counts] + [(caches, [1] * 8), (caches[:1], [8])]
    times: list[list[float]] = [[] for _ in points]
    for rep in range(repeats + 1):  # the first round warms up
        for i, (cs, lengths) in enumerate(points):
            t = _time_step(target, cs, lengths, context)
            if rep:
                times[i].append(t)
    seconds = [statistics.median(t) for t in times[: len(token_counts)]]
    if progress:
        for b, sec in zip(token_counts, seconds):
            print(f"  B={b:4d}  {sec * 1e3:8.2f} ms/step")
    many, one = (statistics.median(t) for t in times[len(token_counts):])
    per_request = max(0.0, (many - one) / 7)
    return StepProfile(profile_key(target), tuple(token_counts), tuple(seconds), per_request, context)


def load_or_measure(target: Transformer, progress: bool = False, refresh: bool = False) -> StepProfile:
    """The cached profile for this model, dtype, thread count and device, measured (and cached) if missing."""
    key = profile_key(target)
    path = cache_path(key)
    if path.is_file() and not refresh:
        try:
            prof = StepProfile.from_json(path.read_text())
            if prof.key == key:
                return prof
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    prof = measure(target, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(prof.to_json())
    tmp.replace(path)
    return prof


def plot_profile(prof: StepProfile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ms = [s * 1e3 for s in prof.seconds]
    ax1.plot(prof.tokens, ms, "o-")
    ax1.set_xlabel("tokens verified in one step (B)")
    ax1.set_ylabel("step time (ms)")
    ax1.set_title("target step time")
    ax2.plot(prof.tokens, [b / s for b, s in zip(prof.tokens, prof.seconds)], "o-")
    ax2.set_xlabel("tokens verified in one step (B)")
    ax2.set_ylabel("tokens/s if all accepted (B x SPS)")
    ax2.set_title("throughput ceiling")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    k = prof.key
    fig.suptitle(f"{k['dtype']}, {k['threads']} threads, {k['device']}; +{prof.per_request_s * 1e3:.2f} ms/request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
