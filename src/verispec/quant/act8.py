"""W4A8's int8 activations and its matmul in torch: the reference the native kernel (kernels/qgemm.c, act_bits 8)
matches bit for bit, and the path wherever that kernel does not run (CUDA, no native build).

Each row of x is rounded per group of `group` inputs: s = amax / 127 (fp32), q = round(x / s) half to even,
clamped to [-127, 127] (0 where the group is all zero). A group's products with the int4 weights sum exactly (small
integers in fp32 or int32 alike), and the groups add up in order: y = sum_g (isum_g * s[:, g]) * scale[:, g].
"""

from __future__ import annotations

import torch


def quantize_rows(
    x: torch.Tensor,  # [M, K] fp32 or bf16
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [M, K // group, group] fp32 integers, s [M, K // group] fp32
    xf = x.float().view(x.shape[0], -1, group)
    amax = xf.abs().amax(-1)
    s = amax / 127.0
    nonzero = (amax > 0).unsqueeze(-1)
    q = torch.where(nonzero, torch.round(xf / torch.where(nonzero, s.unsqueeze(-1), 1.0)), 0.0).clamp(-127, 127)
    return q, s


def w4a8_linear(
    x: torch.Tensor,  # [..., K] fp32 or bf16
    qweight: torch.Tensor,  # [N, K] int8 values in [-8, 7]
    scales: torch.Tensor,  # [N, K // group]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] in x's dtype
    n, k = qweight.shape
    group = k // scales.shape[1]
    rows = x.reshape(-1, k)
    q, s = quantize_rows(rows, group)
    w = qweight.to(torch.float32).view(n, -1, group)
    sc = scales.float()
    isum = torch.einsum("mgk,ngk->gmn", q, w)  # [G, M, N] exact integers
    acc = torch.zeros(rows.shape[0], n, dtype=torch.float32, device=x.device)
    for g in range(isum.shape[0]):  # in group order, as the kernel's chain
        acc = acc + (isum[g] * s[:, g : g + 1]) * sc[:, g]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).view(*x.shape[:-1], n)
