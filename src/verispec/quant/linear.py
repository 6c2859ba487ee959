"""QuantLinear: a frozen Linear whose weight is int8/int4 values with group-wise (or per-channel) scales.

The weight it stands for is q * scale, computed exactly in fp32 (see rtn.dequantize). With act_bits 8 (W4A8) the
input is rounded to int8 per group first and the matmul is quant.act8's, natively or in torch (bit for bit the
same). Its forward otherwise, in order of preference:
- CPU, when the native int4/int8 matmul is built (`native.qlinear`, kernels/qgemm.c): the values are packed once
  with `native.qpack` and every call reads them directly;
- CPU otherwise: the weight is dequantized once (lazily, kept per dtype) into the activation dtype and run through
  verispec's batch-invariant packed matmul (model.packing), so a verify step computes what one-token steps compute;
- elsewhere (CUDA) the same dequantized weight through F.linear.
Inference only: the buffers are frozen and not part of the state dict (quantized checkpoints are read and written by
quant.format, never through state_dict()).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import native
from verispec.model.packing import PackedWeight, linear, pack, weight_version
from verispec.quant.act8 import w4a8_linear
from verispec.quant.rtn import dequantize


class QuantLinear(nn.Module):
    def __init__(
        self,
        qweight: torch.Tensor,  # [out, in] int8, values in [-2^(bits-1), 2^(bits-1) - 1]
        scales: torch.Tensor,  # [out, in / group_size] fp32 or bf16
        bits: int,
        bias: torch.Tensor | None = None,  # [out]
        act_bits: int = 16,  # 8: the input rounded to int8 per group (int4 weights: W4A8)
    ) -> None:
        super().__init__()
        out_features, in_features = qweight.shape
        if qweight.dtype != torch.int8 or scales.dim() != 2 or scales.shape[0] != out_features \
                or in_features % scales.shape[1]:
            raise ValueError(f"QuantLinear: qweight {tuple(qweight.shape)} {qweight.dtype} and scales "
                             f"{tuple(scales.shape)} do not fit")
        self.in_features, self.out_features, self.bits, self.act_bits = in_features, out_features, bits, act_bits
        self.group_size = in_features // scales.shape[1]
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._dense: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, PackedWeight | None]] = {}
        self._qpacked: tuple[tuple, native.QPacked] | None = None  # (sources' key, pack): see qpacked

    @classmethod
    def concat(cls, parts: Sequence[QuantLinear]) -> QuantLinear:
        """One QuantLinear computing `parts` (which read the same input) as one matmul, like model.layers'
        fuse_linears: the parts' buffers become views of the fused one's, so no memory is added."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size or p.in_features != first.in_features
               or p.act_bits != first.act_bits or (p.bias is None) != (first.bias is None) for p in parts):
            raise ValueError("QuantLinear.concat: the parts differ in bits, group size, input size, activations or "
                             "bias")
        fused = cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), first.bits,
                    None if first.bias is None else torch.cat([p.bias for p in parts]), first.act_bits)
        row = 0
        for p in parts:
            n = p.out_features
            p.qweight, p.scales = fused.qweight[row : row + n], fused.scales[row : row + n]
            if p.bias is not None:
                p.bias = fused.bias[row : row + n]
            p._dense, p._qpacked = {}, None
            row += n
        return fused

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        return dequantize(self.qweight, self.scales, dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:  # [out, in] on the buffers' device
        """The dequantized weight in `dtype`, made once (the torch path's matmul weight)."""
        key = (dtype, self.qweight.device)
        if key not in self._dense:
            w = self.dequantize(dtype).to(self.qweight.device)
            self._dense[key] = (w, pack(w) if w.device.type == "cpu" else None)
        return self._dense[key][0]

    def _apply(self, fn, recurse=True):  # .to()/.cuda() move the buffers: caches made from the old ones go
        self._dense, self._qpacked = {}, None
        return super()._apply(fn, recurse)

    def qpacked(self) -> native.QPacked:
        """The weight in qgemm.c's layout (native.qpack), made on first use and again when the int weights or the
        scales are replaced or changed in place (storage and version, as a dense PackedWeight is checked); the
        native forward (model.fused) describes the same pack to decoder.c."""
        key = tuple((t.data_ptr(), weight_version(t)) for t in (self.qweight, self.scales))
        if self._qpacked is None or self._qpacked[0] != key:
            self._qpacked = (key, native.qpack(self.qweight.contiguous(), self.scales.float().contiguous(),
                                               self.group_size, self.bits, self.act_bits))
        return self._qpacked[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and native.qavailable():
            bias = None if self.bias is None else self.bias.float().contiguous()
            y = native.qlinear(x.reshape(-1, self.in_features).contiguous(), self.qpacked(), bias, x.dtype)
            return y.view(*x.shape[:-1], self.out_features)
        if self.act_bits == 8:
            return w4a8_linear(x, self.qweight, self.scales, self.bias)
        self.dense(x.dtype)
        w, packed = self._dense[(x.dtype, self.qweight.device)]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if packed is None:
            return F.linear(x, w, bias)
        return linear(x, w, bias, packed)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"act_bits={self.act_bits}, "
                f"group_size={self.group_size}")
