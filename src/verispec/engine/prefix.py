"""Prompt-prefix KV reuse across requests (automatic prefix caching, as vLLM and SGLang do it).

A prompt is cut into blocks of `block` tokens; each full block is keyed by a hash chained over every token up to
its end, so a key names the whole prefix, not just the block. After a request's first round its cache holds the
target's rows for the whole prompt, and the blocks not yet cached are copied out; a later request whose prompt
starts with cached blocks gets those rows copied into its own cache and prefills only the rest.

Requests own contiguous caches here (not pages), so a hit is a copy (one row of the zoo target is 16 KB; with a
1,000-token shared prefix the first token came after 23 ms instead of 216, scripts/prefix_ttft.py on a Zen 5),
entries need no reference counts, and eviction is least recently used by bytes. A block can also keep the target's
hidden states of its rows at the layers a drafter reads (DSpark, EAGLE, MTP, Medusa): such a drafter's request takes
a hit only on blocks that have them, and gets them with the rows, so its drafter sees the context a prefill would
have given it; a windowed block drafter, whose context may restart anywhere, takes KV-only blocks and restarts its
context after them (Engine._prefix_layers). A drafter reading the target's KV as written (VeriCache) takes no copied
rows. Exactness: the native kernels compute every row alone, in an order that does not depend on how many rows a
forward holds, so a copied row (and hidden state) is the one a prefill would have written
(tests/test_prefix_cache.py checks outputs against plain decoding).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from verispec.cache import KVCache


@dataclass
class PrefixCache:
    budget_bytes: int
    block: int = 32
    # key -> (k, v [L, B, Hkv, block, D], {layer: hidden [block, d]}), least recently used first
    entries: OrderedDict = field(default_factory=OrderedDict)
    nbytes: int = 0
    queried_tokens: int = 0  # prompt tokens looked up, and of those, found (the hit rate's two counters)
    hit_tokens: int = 0

    def keys(self, tokens: list[int]) -> list[bytes]:
        """One key per full block of `tokens`: a digest of the previous key and the block's tokens."""
        out, prev = [], b""
        for start in range(0, len(tokens) - self.block + 1, self.block):
            prev = hashlib.blake2b(prev + array("i", tokens[start : start + self.block]).tobytes(),
                                   digest_size=16).digest()
            out.append(prev)
        return out

    def load(self, prompt: list[int], cache: KVCache, layers: tuple[int, ...] = (),
             compute: int = 1) -> tuple[int, dict[int, torch.Tensor]]:  # rows, {layer: [rows, d]}
        """Copy the longest cached prefix of `prompt` whose blocks hold hidden states at `layers` into the empty
        `cache`; the number of rows now in it and those rows' hidden states. The prompt's last `compute` tokens
        are always left to compute: the first round needs the last one's logits."""
        usable = self.keys(prompt[: len(prompt) - compute])
        self.queried_tokens += len(prompt) - 1
        n, hidden = 0, []
        for key in usable:
            hit = self.entries.get(key)
            if hit is None or any(layer not in hit[2] for layer in layers):
                break
            self.entries.move_to_end(key)
            k, v, h = hit
            cache.k[:, :, :, n : n + self.block] = k
            cache.v[:, :, :, n : n + self.block] = v
            hidden.append(h)
            n += self.block
        cache.length = cache.round_start = n
        self.hit_tokens += n
        return n, {layer: torch.cat([h[layer] for h in hidden]) for layer in layers} if n else {}

    def store(self, prompt: list[int], cache: KVCache, hidden: dict[int, torch.Tensor] | None = None,
              start: int = 0) -> None:
        """Copy out the full blocks of `prompt` that `cache` holds and the prefix cache lacks; with `hidden`
        ({layer: [m, d]} for positions start..start+m-1), the hidden states of the blocks they cover too (added
        to blocks stored without them)."""
        m = next(iter(hidden.values())).shape[0] if hidden else 0
        for i, key in enumerate(self.keys(prompt[: cache.length])):
            lo, hi = i * self.block, (i + 1) * self.block
            covered = bool(hidden) and start <= lo and hi <= start + m
            old = self.entries.get(key)
            if old is not None:
                self.entries.move_to_end(key)
                if not covered or set(hidden) <= set(old[2]):
                    continue
            h = {layer: t[lo - start : hi - start].clone() for layer, t in hidden.items()} if covered else {}
            if old is None:
                k, v = cache.k[:, :, :, lo:hi].clone(), cache.v[:, :, :, lo:hi].clone()
            else:  # the block again, with the hidden states it lacked
                k, v, h = old[0], old[1], {**old[2], **h}
            size = _nbytes(k, v, h)
            if size > self.budget_bytes:
                return
            if old is not None:
                self._drop(key)
            while self.nbytes + size > self.budget_bytes:
                self._drop(next(iter(self.entries)))
            self.entries[key] = (k, v, h)
            self.nbytes += size

    def _drop(self, key: bytes) -> None:
        self.nbytes -= _nbytes(*self.entries.pop(key))

    @staticmethod
    def takes(cache: KVCache) -> bool:
        """Whether rows can be copied into and out of `cache`: a plain one (a tiered cache's rows move between
        devices)."""
        return type(cache) is KVCache

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


def _nbytes(k: torch.Tensor, v: torch.Tensor, hidden: dict[int, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in (k, v, *hidden.values()))
