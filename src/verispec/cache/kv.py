"""A preallocated key/value cache owned by the caller, with O(1) rollback.

All sequences in one cache share one length (the reference loop runs one sequence; batched engines keep one
cache per slot or a paged cache). Rolling back rejected draft tokens is `truncate(n)`: the stale entries stay
in memory and are overwritten by the next forward, exactly like a position-indexed static cache. A tree round
keeps its accepted path instead: `compact(indices)` keeps the given rows of the last forward, in order.

A compressed cache (cache/compress.py) holds fewer rows than positions: every row keeps the key it was computed
with at its own RoPE position, and `next_position` (rows + `position_offset`, the positions dropped so far) is where
the next token goes, while attention masks count rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, T_max, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # committed entries; positions [0, length) are valid
        self.round_start = 0  # where the last forward's entries begin (see compact)
        self.position_offset = 0  # positions dropped before the last row (evicted); 0 for a full cache

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_len: int | None = None, batch: int = 1,
                  tier: str | None = None) -> KVCache:
        """A cache for `model`'s forwards; with `tier` (a device, e.g. "cpu"), a TieredKVCache kept there."""
        cfg = model.config
        param = next(model.parameters())
        # the model's own choice where it makes one (Transformer.kv_dtype); else a bf16 model on CPU keeps its cache,
        # and computes attention, in fp32 (bf16 attention there is several times slower)
        dtype = getattr(model, "kv_dtype", None)
        if dtype is None:
            dtype = torch.float32 if param.dtype == torch.bfloat16 and param.device.type == "cpu" else param.dtype
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_len or cfg.context_limit)
        if tier is not None:
            return TieredKVCache(*shape, batch=batch, dtype=dtype, device=param.device, tier=tier)
        return cls(*shape, batch=batch, dtype=dtype, device=param.device)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Where the cache must be on the compute device for a forward (TieredKVCache); here it always is."""
        yield

    def prefetch(self) -> None:
        """Start bringing the cache to the compute device before a forward (TieredKVCache); here a no-op."""

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor  # [B, Hkv, T, D] for positions length..length+T
    ) -> tuple[torch.Tensor, torch.Tensor]:  # views [B, Hkv, length+T, D]
        """Store one layer's new entries after the committed ones; `advance` commits them once all layers ran."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.max_len}")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    @property
    def next_position(self) -> int:
        """The RoPE position of the next entry: the row count, plus the positions a compressed cache dropped."""
        return self.length + self.position_offset

    def advance(self, num_new: int) -> None:
        self.round_start = self.length
        self.length += num_new

    def truncate(self, length: int) -> None:
        """Roll back to `length` committed entries (O(1): nothing is copied or freed)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
        self.round_start = min(self.round_start, length)

    def compact(self, indices: Sequence[int]) -> None:
        """Keep only the given rows of the last forward's entries (ascending indices into them), moved to its
        first rows in order, and drop the rest: a tree round keeps the anchor and its accepted path. The kept keys
        carry the RoPE positions they were computed at (anchor + depth), which are the positions they now hold.
        compact(range(m)) is truncate(round_start + m)."""
        rows = self.length - self.round_start
        keep = list(indices)
        if any(not 0 <= i < rows for i in keep) or any(a >= b for a, b in zip(keep, keep[1:])):
            raise ValueError(f"cannot compact the last {rows} entries to rows {keep}: need ascending indices "
                             f"in [0, {rows})")
        start, m = self.round_start, len(keep)
        src = torch.tensor(keep, dtype=torch.long, device=self.k.device) + start
        self.k[:, :, :, start : start + m] = self.k[:, :, :, src]  # advanced indexing copies: no overlap issue
        self.v[:, :, :, start : start + m] = self.v[:, :, :, src]
        self.length = start + m

    def reserve(self, max_len: int) -> None:
        """Room for at least max_len entries: grows the storage (at least doubling it, committed entries
        copied) when it is smaller, for caches sized by what they hold rather than by the whole context."""
        if max_len > self.max_len:
            self.resize(max(max_len, 2 * self.max_len))

    def resize(self, max_len: int) -> None:
        """Storage for exactly max_len entries, the committed ones copied (the engine grows a request's cache
        block by block from its pool)."""
        if max_len < self.length:
            raise ValueError(f"cannot resize a cache holding {self.length} entries to {max_len}")
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_zeros((*old.shape[:3], max_len, old.shape[4]))
            grown[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, grown)
        self.max_len = max_len

    def drop_front(self, n: int) -> None:
        """Forget the oldest n committed entries: the newest length - n move to the front (a sliding window)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot drop {n} entries of a cache of length {self.length}")
        if n:
            keep = self.length - n
            self.k[:, :, :, :keep] = self.k[:, :, :, n : self.length].clone()
            self.v[:, :, :, :keep] = self.v[:, :, :, n : self.length].clone()
            self.length = keep
            self.round_start = max(0, self.round_start - n)
            self.position_offset += n

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # [L, B, Hkv, T, D] entries computed elsewhere
        """Commit T entries another forward computed (a compressed view copying its full cache's new rows)."""
        end = self.length + k.shape[3]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.max_len}")
        self.k[:, :, :, self.length : end] = k
        self.v[:, :, :, self.length : end] = v
        self.round_start, self.length = self.length, end

    def evict(self, start: int, n: int) -> None:
        """Drop committed rows start..start+n-1 (the rows after them move up); their positions stay dropped, so
        `next_position` does not change."""
        if not (0 <= start and 0 <= n and start + n <= self.length):
            raise ValueError(f"cannot evict rows {start}..{start + n - 1} of a cache of length {self.length}")
        if n:
            tail = slice(start + n, self.length)
            keep = self.length - start - n
            self.k[:, :, :, start : start + keep] = self.k[:, :, :, tail].clone()
            self.v[:, :, :, start : start + keep] = self.v[:, :, :, tail].clone()
            self.length -= n
            self.position_offset += n
            self.round_start = min(self.round_start, self.length)

    def select(self, start: int, index: torch.Tensor) -> None:  # index [L, B, Hkv, m] rows in [start, length)
        """Keep, per layer, sequence and KV head, the m given committed rows (ascending) of those from `start` on,
        moved to rows start..start+m-1: score-based eviction keeps different positions in each head. Rows before
        `start` stay; `next_position` does not change."""
        m = index.shape[-1]
        if index.shape[:3] != self.k.shape[:3] or not start + m <= self.length:
            raise ValueError(f"cannot select {tuple(index.shape)} rows from {start} of a cache of length "
                             f"{self.length} shaped {tuple(self.k.shape)}")
        if m and (int(index.min()) < start or int(index.max()) >= self.length or (index.diff(dim=-1) <= 0).any()):
            raise ValueError(f"select needs ascending rows in [{start}, {self.length}) per head")
        at = index[..., None].expand(*index.shape, self.k.shape[-1])
        for name in ("k", "v"):
            t = getattr(self, name)
            t[:, :, :, start : start + m] = torch.gather(t[:, :, :, : self.length], 3, at)
        self.position_offset += self.length - start - m
        self.length = start + m
        self.round_start = min(self.round_start, self.length)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class TieredKVCache(KVCache):
    """A full cache whose committed rows live in a slower tier between forwards (VeriCache keeps the full KV in host
    memory and swaps it in to verify): `store` sits on `tier` (pinned host memory when the model runs on CUDA), and a
    forward runs inside `resident()`, which brings the committed rows to the compute device (started early by
    `prefetch`, on a side stream under CUDA, so the copy overlaps drafting), then writes the forward's new rows back
    and frees the working copy. Outside a forward `k`/`v` are the store, which is what a drafter reading the target's
    cache (a compressed view's sync) copies from. On the CPU the tier is a parameter: the same swap path runs, each
    forward copying in and out of host memory."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, *, batch: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tier: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_len, batch=batch, dtype=dtype, device=tier)
        self.compute_device = torch.device(device)
        if self.compute_device.type == "cuda" and torch.device(tier).type == "cpu":
            self.k, self.v = self.k.pin_memory(), self.v.pin_memory()
        self.store = (self.k, self.v)
        self._working: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ready = None  # the side stream's event for an in-flight prefetch (CUDA)
        self.swaps = {"fetches": 0, "bytes_in": 0, "bytes_out": 0}

    def prefetch(self) -> None:
        """Start copying the committed rows to the compute device (a no-op if a copy is already there)."""
        if self._working is not None:
            return
        k, v = self.store
        work = tuple(torch.empty(t.shape, dtype=t.dtype, device=self.compute_device) for t in (k, v))
        rows = slice(0, self.length)
        cuda = self.compute_device.type == "cuda"
        stream = torch.cuda.Stream(self.compute_device) if cuda else None
        with torch.cuda.stream(stream) if cuda else nullcontext():
            for dst, src in zip(work, (k, v)):
                dst[:, :, :, rows].copy_(src[:, :, :, rows], non_blocking=cuda)
        if cuda:
            self._ready = torch.cuda.Event()
            self._ready.record(stream)
        self._working = work
        self.swaps["fetches"] += 1
        self.swaps["bytes_in"] += 2 * k[:, :, :, rows].numel() * k.element_size()

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The committed rows on the compute device for one forward; its new rows go back to the store after it."""
        self.prefetch()
        if self._ready is not None:
            torch.cuda.current_stream(self.compute_device).wait_event(self._ready)
            self._ready = None
        start = self.length
        self.k, self.v = self._working
        try:
            yield
        finally:
            rows = slice(start, self.length)
            for dst, src in zip(self.store, self._working):
                dst[:, :, :, rows].copy_(src[:, :, :, rows])
            self.swaps["bytes_out"] += 2 * self.store[0][:, :, :, rows].numel() * self.store[0].element_size()
            self.k, self.v = self.store
            self._working = None

    def resize(self, max_len: int) -> None:
        if self._working is not None:
            raise RuntimeError("cannot resize a tiered cache while it is resident")
        super().resize(max_len)
        if self.compute_device.type == "cuda" and self.k.device.type == "cpu":
            self.k, self.v = self.k.pin_memory(), self.v.pin_memory()
        self.store = (self.k, self.v)
