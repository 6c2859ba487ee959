from verispec.cache.kv import KVCache
from verispec.cache.packed import PackedBatch, Segment, causal_mask, tree_mask, tree_positions

__all__ = ["KVCache", "PackedBatch", "Segment", "causal_mask", "tree_mask", "tree_positions"]
