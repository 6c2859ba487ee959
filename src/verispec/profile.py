"""The target's step time against the number of tokens verified in one step and the context they attend to: SPS(B)
for the dspark policy.

Measured once per (model, dtype, threads, device) and cached as JSON. A step over R requests and B tokens costs
`time(B) + (R - 1) * per_request_s`: the token cost is measured with one request, the per-request cost (one
attention call and cache write per layer) from R requests of one token each against one request of R tokens.
Those are measured at a short context; past it, attention adds `(C - context) * (kv_read_s * R + kv_row_s * B)`
for requests whose caches hold C positions on average: reading each request's keys and values once per step
(memory-bound: a one-token step at 1,900 positions reads ~30 MB on the zoo target) and scoring every verified
token against every position (compute), fitted from one and 16 tokens at a long context.
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
    kv_read_s: float = 0.0  # per request and cached position past `context` (reading its keys and values)
    kv_row_s: float = 0.0  # per verified token and cached position past `context` (attention's compute)

    @functools.cached_property
    def _rising(self) -> tuple[float, ...]:
        """The measured seconds made non-decreasing: more tokens never cost less, a measured dip is the machine's
        noise. Computed once (step_time runs per draft position every round)."""
        return tuple(itertools.accumulate(self.seconds, max))

    def step_time(self, tokens: int, requests: int = 1, context: float | None = None) -> float:
        """Linear interpolation between the (non-decreasing) measured points, linear extrapolation past the last
        two; with `context` (the requests' mean cached positions), plus attention's cost past the measured one."""
        extra = 0.0
        if context is not None and context > self.context:
            extra = (context - self.context) * (self.kv_read_s * max(requests, 1) + self.kv_row_s * tokens)
        return self._token_time(tokens, requests) + extra

    def _token_time(self, tokens: int, requests: int) -> float:
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
        return StepProfile(d["key"], tuple(d["tokens"]), tuple(d["seconds"]), d["per_request_s"], d["context"],
                           d.get("kv_read_s", 0.0), d.get("kv_row_s", 0.0))


def profile_key(target: Transformer) -> dict:
    cfg = json.dumps(target.config.to_hf_dict(), sort_keys=True)
    weights = hashlib.sha256()
    for p in list(target.parameters())[:4]:  # cheap fingerprint: config + a few weight tensors
        weights.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return {
        "model": hashlib.sha256(cfg.encode()).hexdigest()[:16] + "-" + weights.hexdigest()[:16],
        "dtype": str(target.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "packed": target.packed,
        "matmuls": target.matmuls,
        "kernels": native.isa(),  # the instruction set of the native kernels (None: torch's)
        "kernel_sources": native.source_digest() if native.available() else None,  # a kernel change re-measures
        "forward": "native" if target.fused is not None else "torch",
        "method": 4,  # how measure() times which points (older profiles are measured again)
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
    if device.type == "cuda":
        torch.cuda.synchronize()  # time this step only, not the copies queued before it
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
    """The 20th percentile of `repeats` rounds, each timing every point once in turn: on a shared, noisy machine a
    slow moment then spreads over all points instead of bending the curve at a few (the dspark rule reads its
    slope), and a low quantile rather than the median, because contention only ever adds time: a profile measured
    while another process kept both cores busy had every even token count (split over two threads) 1.4-2.6x its
    odd neighbours, which made the dspark rule cut drafts that paid."""
    limit = target.config.context_limit
    token_counts = tuple(b for b in token_counts if b <= limit // 2) or (1,)
    max_b = max(*token_counts, 16)  # 8 and 16: the per-request and long-context probes below
    context = max(1, min(context, limit - max_b - 1))
    long = min(limit - 17, 1024)  # the long-context probe: attention's share of a step grows with the context
    caches = [KVCache.for_model(target, max_len=context + max_b + 1) for _ in range(8)]
    gen = torch.Generator().manual_seed(0)  # leave the global RNG alone
    prompt = torch.randint(0, target.config.vocab_size, (1, max(context, long)), generator=gen).to(target.device)
    for c in caches:
        target(prompt[:, :context], cache=c, num_logits=0)
    # Points: one request verifying B tokens, then 8 requests of one token against one request of 8, then one and
    # 16 tokens against the long context and the short one.
    points = [(caches[:1], [b], context) for b in token_counts] + [(caches, [1] * 8, context),
                                                                   (caches[:1], [8], context)]
    if long > 2 * context:
        deep = KVCache.for_model(target, max_len=long + 17)
        target(prompt[:, :long], cache=deep, num_logits=0)
        points += [([deep], [1], long), ([deep], [16], long), (caches[:1], [16], context), (caches[:1], [1], context)]
    times: list[list[float]] = [[] for _ in points]
    for rep in range(repeats + 1):  # the first round warms up
        for i, (cs, lengths, ctx) in enumerate(points):
            t = _time_step(target, cs, lengths, ctx)
            if rep:
                times[i].append(t)
    med = [statistics.quantiles(t, n=5)[0] if len(t) > 1 else t[0] for t in times]
    n = len(token_counts)
    seconds = med[:n]
    if progress:
        for b, sec in zip(token_counts, seconds):
            print(f"  B={b:4d}  {sec * 1e3:8.2f} ms/step")
    per_request = max(0.0, (med[n] - med[n + 1]) / 7)
    kv_read = kv_row = 0.0
    if long > 2 * context:  # extra(B) = (long - context) * (kv_read + kv_row * B) at B = 1 and 16
        one_extra, sixteen_extra = med[n + 2] - med[n + 5], med[n + 3] - med[n + 4]
        span = long - context
        kv_row = max(0.0, (sixteen_extra - one_extra) / (15 * span))
        kv_read = max(0.0, one_extra / span - kv_row)
    return StepProfile(profile_key(target), tuple(token_counts), tuple(seconds), per_request, context, kv_read, kv_row)


def disturbed(prof: StepProfile, dip: float = 1.3) -> bool:
    """Whether a measured profile shows the marks of a busy machine: a token count that cost more than `dip` times
    a larger one (a step never gets cheaper with more tokens; noise this large is another process's)."""
    worst_after = list(itertools.accumulate(reversed(prof.seconds), min))[::-1]  # min over this and larger counts
    return any(s > dip * later for s, later in zip(prof.seconds, worst_after[1:]))


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
    if disturbed(prof):  # used this once, measured again by the next process rather than cached
        return prof
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
