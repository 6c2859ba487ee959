"""compressed-tensors' int32 packing ("pack-quantized", compressors/pack_quantized/helpers.py, v0.20): each row's
values, offset to unsigned (q + 2^(bits-1)), packed densely so that element i sits at bits [i*bits, (i+1)*bits) of
the row's little-endian stream of int32 words; a row takes ceil(in * bits / 32) words, the tail zero-padded.
For 4 and 8 bits no value straddles a word.
"""

from __future__ import annotations

import torch


def packed_words(cols: int, bits: int) -> int:
    return -(-cols * bits // 32)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:  # q int8 [rows, cols] -> int32 [rows, words]
    per = 32 // bits
    rows, cols = q.shape
    words = packed_words(cols, bits)
    u = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, words * per - cols)).view(rows, words, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (u << shifts).sum(dim=-1)  # [rows, words] in [0, 2^32)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:  # [rows, words] -> int8 [rows, cols]
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    u = (packed.to(torch.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then masked
    return (u.flatten(1)[:, :cols] - (1 << (bits - 1))).to(torch.int8)
