from verispec.cache.kv import KVCache

__all__ = ["KVCache"]
