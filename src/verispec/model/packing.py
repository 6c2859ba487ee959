"""Inference matmuls on CPU through weights packed once at load, for verispec's own kernels.

A plain `F.linear` re-packs the weight on every call, and its result for a row depends on how many rows share the
call (oneDNN and MKL pick kernels by shape): a verify step would not compute what one-token steps compute. Where
verispec.kernels.native runs (CPUs with AVX2 + FMA), each weight is packed once into gemm.c's layout in its own
dtype (fp32 or bf16, fp32 accumulation; an fp32 weight that holds bf16 values, as a bf16 checkpoint loaded in fp32
does, is packed in bf16: the same results from half the bytes). Every row is then computed in one fixed order
whatever the row count, on every instruction set the kernels are built for.

Packing is for frozen weights at inference (no autograd): `linear` falls back to `F.linear` whenever a gradient is
wanted, the input is in another dtype or off the CPU, or the weight was changed or moved after packing. Where the
kernels cannot run nothing is packed and the model keeps `F.linear` (native.FALLBACK_NOTE says what that means
for exactness).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import native


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16)
            and native.available())


def _narrowest(w: torch.Tensor) -> torch.Tensor:
    """fp32 weights that are exactly bf16 values (a checkpoint saved in bf16, loaded in fp32) as bf16: the native
    kernel computes in fp32 either way, so the products and sums are the same, from half the bytes."""
    if w.dtype == torch.float32:
        narrow = w.to(torch.bfloat16)
        if torch.equal(narrow.float(), w):
            return narrow
    return w


def pack_nbytes(weight: torch.Tensor) -> int:
    """Memory a pack of this weight takes (a copy in its own dtype; bf16 where an fp32 weight holds bf16 values)."""
    return weight.numel() * weight.element_size() if packing_supported(weight) else 0


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def weight_version(t: torch.Tensor) -> int | None:
    # Tensors made under inference_mode keep no version counter (and cannot be changed outside it).
    return None if t.is_inference() else t._version


class PackedWeight:
    """A packed copy of one weight [out, in], valid while that weight's storage and version are unchanged."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = native.pack(_narrowest(weight.detach()))
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        self._ptr, self._version = weight.data_ptr(), weight_version(weight)
        self._bias: tuple[int, int | None, torch.Tensor] | None = None  # (ptr, version, padded fp32 copy)

    def valid_for(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self._ptr and weight_version(weight) == self._version

    def usable(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        return (
            self.valid_for(weight)
            and weight.dtype == x.dtype == self.dtype
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def native_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The kernel's fp32, padded copy of `bias`, made once and remade if the bias changes."""
        if bias is None:
            return None
        key = (bias.data_ptr(), weight_version(bias))
        if self._bias is None or self._bias[:2] != key:
            self._bias = (*key, native.pad_bias(bias.detach()))
        return self._bias[2]


def pack(weight: torch.Tensor | None) -> PackedWeight | None:
    return PackedWeight(weight) if weight is not None and packing_supported(weight) else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:  # x [..., in] -> [..., out]
    if packed is None or not packed.usable(weight, x):
        return F.linear(x, weight, bias)
    return native.linear(x, packed.packed, packed.native_bias(bias))


class PackedLinear(nn.Module):
    """Stands in for a frozen `nn.Linear` at inference. It holds the same Parameter objects, so state-dict names,
    tied weights and `.weight` are unchanged; only the matmul is different."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight
        self.bias = lin.bias
        self.packed = pack(lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed is not None}"
