"""Scales and round-to-nearest, with compressed-tensors' symmetric formula (quantization/utils/helpers.py
calculate_qparams and lifecycle/forward_helpers.py _quantize, v0.20): scale = absmax / ((qmax - qmin) / 2), i.e.
absmax / 7.5 for int4 and absmax / 127.5 for int8, a zero scale replaced by the scale dtype's eps, and
q = clamp(round(w / scale), qmin, qmax) with round half to even (torch.round).
"""

from __future__ import annotations

import torch

from verispec.quant.scheme import QuantScheme


def scales_for(
    w: torch.Tensor,  # [out, n] the columns one scale covers (a group, or the whole row)
    scheme: QuantScheme,
    dtype: torch.dtype,
) -> torch.Tensor:  # [out] in `dtype`, the scale as the checkpoint stores it
    half_range = (scheme.qmax - scheme.qmin) / 2
    scale = (w.float().abs().amax(dim=-1) / half_range).to(dtype)
    return torch.where(scale == 0, torch.finfo(dtype).eps, scale)


def quantize_with(
    w: torch.Tensor,  # [out, n]
    scale: torch.Tensor,  # [out] or [out, 1]: the stored scale, so that q * scale is what loading computes
    scheme: QuantScheme,
) -> torch.Tensor:  # [out, n] int8
    s = scale.float().reshape(-1, 1)
    return torch.clamp(torch.round(w.float() / s), scheme.qmin, scheme.qmax).to(torch.int8)


def quantize_rtn(
    weight: torch.Tensor,  # [out, in]
    scheme: QuantScheme,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # q int8 [out, in], scales [out, in / group] in scale_dtype
    out, cols = weight.shape
    g = scheme.group(cols)
    groups = weight.float().reshape(out, cols // g, g)
    scales = scales_for(groups.reshape(-1, g), scheme, scale_dtype).reshape(out, cols // g)
    q = quantize_with(groups.reshape(-1, g), scales.reshape(-1), scheme).reshape(out, cols)
    return q, scales


def dequantize(
    q: torch.Tensor,  # [out, in] int8
    scales: torch.Tensor,  # [out, in / group]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [out, in] in `dtype`
    """q * scale, exact in fp32 (a 4/8-bit integer times a bf16 or fp32 scale needs at most 24 bits when the scale
    is bf16), then rounded once to `dtype`: in bf16 this is compressed-tensors' decompression bit for bit."""
    g = q.shape[1] // scales.shape[1]
    return (q.float() * scales.float().repeat_interleave(g, dim=1)).to(dtype)
