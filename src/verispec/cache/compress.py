"""Compressed views of a full KV cache, behind one compressor interface (VeriCache's drafter decodes over them).

A `CompressedView` is a caller-owned `KVCache` that follows a full cache: `sync` copies the full cache's committed
rows it has not seen (the rows the target's own forwards wrote: no second prefill) and lets its compressor bring it
back within budget. Kept rows keep the keys they were computed with at their own RoPE positions; the view's
`position_offset` counts the dropped ones, so a forward over the view puts new tokens at their true positions.

Compressors, composable (`Composed`: evict, then quantize):
- `StreamingLLM` (Xiao et al. 2023): the first `sinks` positions (attention sinks) and the most recent ones.
- `SnapKV` (Li et al. 2024): at the first compression (the prompt), per layer and KV head, the prompt positions the
  last `window` prompt queries attend to most (summed over the queries and the head's query group, max-pooled over
  neighbouring positions), then the recent positions as StreamingLLM's; different heads keep different positions.
- `KIVI` (Liu et al. 2024): keys quantized per channel over groups of `group` tokens, values per token, int8 or
  int4 (symmetric, round to nearest), the most recent `residual` tokens kept in full precision. Attention on this
  CPU reads an fp32 working copy holding the dequantized values (no int-KV attention kernel here): the drafter sees
  exactly what a quantized cache holds, and `nbytes` reports what the quantized cache would store, not that copy.

Budgets are in tokens (rows); `budget_bytes` converts a byte budget for a model's cache shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verispec.cache.kv import KVCache
from verispec.errors import ConfigError

# Queries of the last prompt positions, per layer: f(layer) -> [B, H, w, D] (SnapKV's observation window).
QueryFn = Callable[[int], torch.Tensor]


class Compressor(ABC):
    """Decides which committed rows a view keeps, and how they are stored."""

    name: str = ""

    @property
    @abstractmethod
    def budget(self) -> int:
        """The most committed rows the view holds after `compress` (the drafter's forwards add their own)."""

    @property
    def needs_queries(self) -> bool:
        """Whether the first compression wants the prompt's last queries (`QueryFn`)."""
        return False

    @property
    def query_window(self) -> int:
        """How many of the last positions' queries it scores with (0: none)."""
        return getattr(self, "window", 0)

    @property
    def rebuilds(self) -> bool:
        """Whether each sync refills the view from the whole full cache (`rebuild`) instead of appending to it."""
        return False

    @abstractmethod
    def compress(self, view: KVCache, queries: QueryFn | None) -> None:
        """Bring `view` within budget after new committed rows were appended."""

    def rebuild(self, full: KVCache, view: KVCache, queries: QueryFn) -> None:
        """Refill `view` from the whole `full` cache; CompressedView.sync calls it only where `rebuilds` is True
        (Retrieval, which overrides it), so reaching this is a compressor that claims rebuilds without one."""
        raise NotImplementedError(f"{type(self).__name__} says it rebuilds but has no rebuild")

    def nbytes(self, view: KVCache) -> int:
        """Bytes the view's committed rows take in this compressor's storage format."""
        per_row = view.k.shape[0] * view.k.shape[1] * view.k.shape[2] * view.k.shape[4] * view.k.element_size() * 2
        return view.length * per_row


@dataclass
class StreamingLLM(Compressor):
    sinks: int = 4
    recent: int = 252
    slack: int = 0  # evict down to budget - slack when over budget: fewer, larger moves of the window

    name = "streaming"

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.recent < 1 or not 0 <= self.slack < self.recent:
            raise ConfigError(f"streaming cache needs sinks >= 0, recent >= 1 and 0 <= slack < recent, got "
                              f"sinks={self.sinks}, recent={self.recent}, slack={self.slack}")

    @property
    def budget(self) -> int:
        return self.sinks + self.recent

    def compress(self, view: KVCache, queries: QueryFn | None) -> None:
        if view.length > self.budget:
            view.evict(self.sinks, view.length - self.budget + self.slack)


@dataclass
class SnapKV(Compressor):
    keep: int = 192  # selected prompt positions per layer and KV head
    recent: int = 64  # most recent positions, kept in every head
    window: int = 16  # observation window: the prompt's last queries
    pool: int = 7  # max-pool kernel over neighbouring positions' scores (odd)
    slack: int = 0

    name = "snapkv"

    def __post_init__(self) -> None:
        if self.keep < 0 or self.recent < self.window or self.window < 1 or self.pool < 1 or self.pool % 2 == 0 \
                or not 0 <= self.slack < self.recent:
            raise ConfigError(f"snapkv needs keep >= 0, recent >= window >= 1, an odd pool and 0 <= slack < recent, "
                              f"got keep={self.keep}, recent={self.recent}, window={self.window}, pool={self.pool}, "
                              f"slack={self.slack}")
        self._selected = False

    @property
    def budget(self) -> int:
        return self.keep + self.recent

    @property
    def needs_queries(self) -> bool:
        return not self._selected

    def compress(self, view: KVCache, queries: QueryFn | None) -> None:
        if view.length <= self.budget:
            return
        if not self._selected:
            if queries is None:
                raise ValueError("snapkv selects its first positions from the prompt's last queries: none given")
            self._select(view, queries)
            self._selected = True
        if view.length > self.budget:  # the recent positions roll on after the selected ones
            view.evict(self.keep, view.length - self.budget + self.slack)

    def _select(self, view: KVCache, queries: QueryFn) -> None:
        n = view.length
        idx = [top_positions(queries(layer), view.k[layer, :, :, :n], n - self.recent, self.keep, self.pool)
               for layer in range(view.k.shape[0])]
        recent = torch.arange(n - self.recent, n, device=view.k.device).expand(*idx[0].shape[:2], self.recent)
        view.select(0, torch.stack([torch.cat([top, recent], dim=-1) for top in idx]))


def top_positions(
    q: torch.Tensor,  # [B, H, w, D] queries of the last w positions (n - w .. n - 1)
    k: torch.Tensor,  # [B, Hkv, n, D] keys of positions 0 .. n - 1 (one row per position)
    prefix: int,  # candidates: positions 0 .. prefix - 1
    keep: int,
    pool: int,
) -> torch.Tensor:  # [B, Hkv, keep] ascending
    """Per KV head, the `keep` candidates the queries attend to most: attention probabilities summed over the
    queries and the head's query group, max-pooled over `pool` neighbouring positions (SnapKV's clustering)."""
    b, h, w, d = q.shape
    n, hkv = k.shape[2], k.shape[1]
    if k.dtype == torch.bfloat16 and k.device.type == "cpu":  # a bf16 cache's keys (exact in fp32): CPU maths in fp32
        k = k.float()
    q = q.to(k.dtype).reshape(b, hkv, h // hkv, w, d)
    logits = torch.einsum("bgqwd,bgnd->bgqwn", q, k) / d ** 0.5
    causal = torch.arange(n, device=k.device)[None, :] <= torch.arange(n - w, n, device=k.device)[:, None]  # [w, n]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    score = probs.sum(dim=(2, 3))[..., :prefix]  # [B, Hkv, prefix]
    score = F.max_pool1d(score, pool, stride=1, padding=pool // 2)
    return score.topk(min(keep, prefix), dim=-1).indices.sort(dim=-1).values


@dataclass
class Retrieval(Compressor):
    """SnapKV's selection redone every round over the whole full cache with the latest queries (the last
    `window` committed positions), as TriForce's retrieval cache and Quest re-select for each step: what the
    next tokens attend to moves as the text goes on, which a selection made once at the prompt cannot follow.
    Costs one pass over the full cache's keys per round, amortised over the round's drafted tokens."""

    keep: int = 192
    recent: int = 64
    window: int = 8
    pool: int = 7

    name = "retrieval"

    def __post_init__(self) -> None:
        if self.keep < 0 or self.recent < self.window or self.window < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ConfigError(f"retrieval needs keep >= 0, recent >= window >= 1 and an odd pool, got "
                              f"keep={self.keep}, recent={self.recent}, window={self.window}, pool={self.pool}")

    @property
    def budget(self) -> int:
        return self.keep + self.recent

    @property
    def needs_queries(self) -> bool:
        return True

    @property
    def rebuilds(self) -> bool:
        return True

    def compress(self, view: KVCache, queries: QueryFn | None) -> None:
        if view.length > self.budget:  # only between rebuilds (a view synced without queries)
            view.evict(0, view.length - self.budget)

    def rebuild(self, full: KVCache, view: KVCache, queries: QueryFn) -> None:
        """Fill `view` with the selected and recent rows of `full`'s committed ones."""
        n = full.length
        if n <= self.budget:
            view.truncate(0)
            view.position_offset = 0
            view.append(full.k[:, :1, :, :n], full.v[:, :1, :, :n])
            return
        layers, dev = full.k.shape[0], view.k.device
        keys = full.k[:, :1, :, :n].to(dev)  # a tiered full cache's rows live in host memory
        idx = torch.stack([top_positions(queries(layer), keys[layer], n - self.recent, self.keep, self.pool)
                           for layer in range(layers)])  # [L, 1, Hkv, keep]
        recent = torch.arange(n - self.recent, n, device=idx.device).expand(*idx.shape[:3], self.recent)
        at = torch.cat([idx, recent], dim=-1)[..., None].expand(-1, -1, -1, -1, full.k.shape[-1])
        m = at.shape[3]
        view.k[:, :, :, :m] = torch.gather(keys, 3, at)
        view.v[:, :, :, :m] = torch.gather(full.v[:, :1, :, :n].to(dev), 3, at)
        view.length, view.round_start, view.position_offset = m, 0, n - m


@dataclass
class KIVI(Compressor):
    bits: int = 4
    group: int = 32  # tokens per key scale (per channel)
    residual: int = 32  # most recent tokens kept in full precision
    rows: int = 4096  # token budget (KIVI compresses, it does not evict: the whole context fits)

    name = "kivi"

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8) or self.group < 1 or self.residual < 0 or self.rows < 1:
            raise ConfigError(f"kivi needs bits in 2/4/8, group >= 1, residual >= 0, got bits={self.bits}, "
                              f"group={self.group}, residual={self.residual}")
        self._quantized = 0  # leading committed rows stored quantized

    @property
    def quantized_rows(self) -> int:
        return self._quantized

    @property
    def budget(self) -> int:
        return self.rows

    def forget(self, rows: int) -> None:
        """A composed evictor dropped rows: `rows` of them were in the quantized region."""
        self._quantized -= rows

    def compress(self, view: KVCache, queries: QueryFn | None) -> None:
        qmax = 2 ** (self.bits - 1) - 1
        while view.length - self._quantized - self.residual >= self.group:
            rows = slice(self._quantized, self._quantized + self.group)
            k, v = view.k[:, :, :, rows], view.v[:, :, :, rows]  # [L, B, Hkv, G, D]
            k_scale = k.abs().amax(dim=3, keepdim=True).clamp_min(1e-8) / qmax  # per channel over the group
            v_scale = v.abs().amax(dim=4, keepdim=True).clamp_min(1e-8) / qmax  # per token over the channels
            view.k[:, :, :, rows] = torch.clamp(torch.round(k / k_scale), -qmax, qmax) * k_scale
            view.v[:, :, :, rows] = torch.clamp(torch.round(v / v_scale), -qmax, qmax) * v_scale
            self._quantized += self.group

    def nbytes(self, view: KVCache) -> int:
        layers, batch, heads, _, dim = view.k.shape
        full = view.length - self._quantized
        codes = self._quantized * dim * self.bits // 8 * 2  # keys and values
        scales = (self._quantized // self.group) * dim * 2 + self._quantized * 2  # fp16 key and value scales
        return layers * batch * heads * (codes + scales + full * dim * view.k.element_size() * 2)


@dataclass
class Composed(Compressor):
    """Evict, then quantize what is kept (e.g. StreamingLLM's positions stored as KIVI int4)."""

    evictor: Compressor
    quantizer: KIVI

    def __post_init__(self) -> None:
        self.name = f"{self.evictor.name}+{self.quantizer.name}"

    @property
    def budget(self) -> int:
        return self.evictor.budget

    @property
    def needs_queries(self) -> bool:
        return self.evictor.needs_queries

    @property
    def query_window(self) -> int:
        return self.evictor.query_window

    def compress(self, view: KVCache, queries: QueryFn | None) -> None:
        before = view.position_offset
        self.evictor.compress(view, queries)
        if self.evictor.needs_queries:  # SnapKV has not chosen its rows yet: its selection will move them
            return
        dropped = view.position_offset - before
        if dropped:
            # Evictors drop the rows right after the ones they always keep (sinks, selected): those rows were
            # quantized where the quantized region (the leading rows) reaches past them.
            start = getattr(self.evictor, "sinks", getattr(self.evictor, "keep", 0))
            self.quantizer.forget(max(0, min(dropped, self.quantizer.quantized_rows - start)))
        self.quantizer.compress(view, queries)

    def nbytes(self, view: KVCache) -> int:
        return self.quantizer.nbytes(view)


class CompressedView:
    """A compressed copy of one sequence's full cache, kept in step with it by `sync`."""

    def __init__(self, full: KVCache, compressor: Compressor, headroom: int) -> None:
        # Room for the budget, the rows one sync may bring before compressing, and a round's drafted rows.
        layers, _, heads, _, dim = full.k.shape
        self.full, self.compressor = full, compressor
        # on the device the forwards run on: a tiered full cache keeps its rows in host memory (its compute_device)
        self.cache = KVCache(layers, heads, dim, compressor.budget + headroom, dtype=full.k.dtype,
                             device=getattr(full, "compute_device", full.k.device))
        self.synced = 0  # positions of the full cache copied so far
        self.headroom = headroom

    def sync(self, queries: QueryFn | None = None) -> None:
        """Copy the full cache's committed rows past `synced` (in chunks of at most the headroom), compressing."""
        view, full = self.cache, self.full
        if full.length < self.synced:
            raise ValueError(f"the full cache was rolled back below the {self.synced} positions this view copied")
        if self.compressor.rebuilds and queries is not None:
            if full.length > self.synced or view.length == 0:
                self.compressor.rebuild(full, view, queries)
                self.synced = full.length
            return
        room = self.headroom
        while self.synced < full.length:
            n = min(full.length - self.synced, room)
            rows = slice(self.synced, self.synced + n)
            view.reserve(view.length + n)  # a compressor that keeps every position (KIVI alone) grows the view
            view.append(full.k[:, :1, :, rows], full.v[:, :1, :, rows])
            self.synced += n
            # SnapKV scores the prompt with its last queries: compress once the whole prompt is in.
            if self.synced == full.length or not self.compressor.needs_queries:
                self.compressor.compress(view, queries)
            else:
                view.reserve(view.length + room)  # keep the prompt whole until it is scored
        if view.next_position != self.synced:
            raise AssertionError(f"compressed view at position {view.next_position}, synced {self.synced}")

    @property
    def nbytes(self) -> int:
        return self.compressor.nbytes(self.cache)


def budget_bytes(nbytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 4) -> int:
    """Tokens whose keys and values fit in `nbytes` uncompressed (a byte budget for an evicting compressor)."""
    return nbytes // (num_layers * num_kv_heads * head_dim * dtype_bytes * 2)


def _room_for(name: str, budget: int, recent: int) -> None:
    if budget < recent:
        raise ConfigError(f"a {name} budget of {budget} tokens leaves no room to select beside its {recent} recent "
                          f"ones: give a larger budget (or a smaller recent=)")


def make_compressor(name: str, budget: int, **options: str) -> Compressor:
    """`streaming`, `snapkv`, `kivi` or `EVICTOR+kivi` at a budget in tokens (the recent/selected split, bits and
    groups from `options`, their defaults otherwise)."""
    opts = {}
    for key, value in options.items():
        try:
            opts[key] = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"compressor option {key}={value!r}: expected an integer") from None

    def take(*names: str) -> dict[str, int]:
        return {n: opts.pop(n) for n in names if n in opts}

    if budget < 1:
        raise ConfigError(f"a compressed cache needs a budget of at least one token, got {budget}")
    evict_name, _, quant_name = name.partition("+")
    if evict_name == "kivi" and not quant_name:
        comp: Compressor = KIVI(rows=budget, **take("bits", "group", "residual"))
    else:
        if evict_name == "retrieval":
            o = take("recent", "window", "pool")
            recent = o.pop("recent", max(min(64, budget // 4), o.get("window", 8)))
            _room_for(evict_name, budget, recent)
            comp = Retrieval(keep=budget - recent, recent=recent, **o)
        elif evict_name == "streaming":
            o = take("sinks", "slack")
            sinks = o.pop("sinks", min(4, budget - 1))
            comp = StreamingLLM(sinks=sinks, recent=budget - sinks, **o)
        elif evict_name == "snapkv":
            o = take("recent", "window", "pool", "slack")
            recent = o.pop("recent", max(min(64, budget // 4), o.get("window", 16)))
            _room_for(evict_name, budget, recent)
            comp = SnapKV(keep=budget - recent, recent=recent, **o)
        else:
            raise ConfigError(f"unknown KV compressor {name!r}; available: streaming, snapkv, retrieval, kivi, "
                              f"and EVICTOR+kivi")
        if quant_name:
            if evict_name == "retrieval":
                raise ConfigError("retrieval+kivi: a retrieval view is refilled from the full cache every round; "
                                  "quantize it with snapkv+kivi or streaming+kivi instead")
            if quant_name != "kivi":
                raise ConfigError(f"unknown KV quantizer {quant_name!r} in {name!r}; available: kivi")
            comp = Composed(comp, KIVI(rows=budget, **take("bits", "group", "residual")))
    if opts:
        raise ConfigError(f"compressor {name!r} takes no option {sorted(opts)[0]!r}")
    return comp
