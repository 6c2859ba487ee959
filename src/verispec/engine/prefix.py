"""Prompt-prefix KV reuse across requests (automatic prefix caching, as vLLM and SGLang do it).

A prompt is cut into blocks of `block` tokens; each full block is keyed by a hash chained over every token up to
its end, so a key names the whole prefix, not just the block. After a request's first round its cache holds the
target's rows for the whole prompt, and the blocks not yet cached are copied out; a later request whose prompt
starts with cached blocks gets those rows copied into its own cache and prefills only the rest.

Requests own contiguous caches here (not pages), so a hit is a copy (one row of the zoo target is 16 KB; with a
1,000-token shared prefix the first token came after 23 ms instead of 216, scripts/prefix_ttft.py on a Zen 5),
entries need no reference counts, and eviction is least recently used by bytes. Requests whose drafter needs the
prompt's own forward (hidden states, the target's KV as written) take no copied rows (Engine._reads_prompt). Exactness: the native kernels compute every row alone, in an
order that does not depend on how many rows a forward holds, so a copied row is the row a prefill would have
written (tests/test_prefix_cache.py checks outputs against plain decoding).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from verispec.cache import KVCache


@dataclass
class PrefixCache:
    budget_bytes: int
    block: int = 32
    entries: OrderedDict = field(default_factory=OrderedDict)  # key -> (k, v) [L, B, Hkv, block, D], LRU last
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

    def load(self, prompt: list[int], cache: KVCache) -> int:
        """Copy the longest cached prefix of `prompt` into the empty `cache`; the number of rows now in it. The
        prompt's last token is always left to compute: the first round needs its logits."""
        usable = self.keys(prompt[: len(prompt) - 1])
        self.queried_tokens += len(prompt) - 1
        n = 0
        for key in usable:
            hit = self.entries.get(key)
            if hit is None:
                break
            self.entries.move_to_end(key)
            k, v = hit
            cache.k[:, :, :, n : n + self.block] = k
            cache.v[:, :, :, n : n + self.block] = v
            n += self.block
        cache.length = cache.round_start = n
        self.hit_tokens += n
        return n

    def store(self, prompt: list[int], cache: KVCache) -> None:
        """Copy out the full blocks of `prompt` that `cache` holds and the prefix cache lacks."""
        for i, key in enumerate(self.keys(prompt[: cache.length])):
            if key in self.entries:
                self.entries.move_to_end(key)
                continue
            rows = slice(i * self.block, (i + 1) * self.block)
            k, v = cache.k[:, :, :, rows].clone(), cache.v[:, :, :, rows].clone()
            size = 2 * k.numel() * k.element_size()
            if size > self.budget_bytes:
                return
            while self.nbytes + size > self.budget_bytes:
                _, (old_k, old_v) = self.entries.popitem(last=False)
                self.nbytes -= 2 * old_k.numel() * old_k.element_size()
            self.entries[key] = (k, v)
            self.nbytes += size

    @staticmethod
    def takes(cache: KVCache) -> bool:
        """Whether rows can be copied into and out of `cache`: a plain one (a tiered cache's rows move between
        devices)."""
        return type(cache) is KVCache

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
