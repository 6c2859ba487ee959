"""Inference matmuls on CPU through weights packed once into oneDNN's blocked layout.

A plain `F.linear` re-packs the weight on every call. At the few rows of a verify step that repacking is most of the
cost: on a 2-vCPU AVX2 machine a forward of the shipped target over 1 / 8 / 16 positions takes 23.9 / 36.7 / 40.6
ms unpacked against 13.6 / 22.2 / 25.6 ms with the weights packed once (`verispec profile --dtype fp32` against
`--no-pack`). Verifying 8 drafts then costs ~1.5 plain steps instead of ~2.6, which is what lets speculation pay
on such a CPU.

bf16 on a CPU without native bf16 (no AVX512-BF16 / AVX-NE-CONVERT, where oneDNN cannot pack bf16 and its bf16
matmul is linear in rows): the pack is the weight's exact fp32 upcast; a multi-row product runs on it with the
input upcast and the output rounded back to bf16, which is a bf16 matmul (bf16 operands, fp32 accumulation, bf16
result) in another summation order. One or two rows stay on bf16 `F.linear`: it reads half the bytes. With
native bf16 nothing is packed; oneDNN's own bf16 path is fast there.

Packing is for frozen weights at inference (the op has no autograd): `linear` falls back to `F.linear` whenever a
gradient is wanted, the input is in another dtype or off the CPU, or the weight was changed or moved after packing.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# The row count oneDNN tunes the layout for: a verify step of 8 drafts is 9 rows, a block drafter's 8-16.
PACK_ROWS = 16
# bf16 packs are used from this many rows: below it bf16 F.linear, reading half the bytes, is as fast or faster
# (2-vCPU AVX2: 7.9 / 11.2 / 14.8 ms for 1 / 2 / 3 rows unpacked, 8.3 / 17.6 / 15.6 packed).
BF16_MIN_ROWS = 3


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and not cpu_has_native_bf16()


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(t: torch.Tensor) -> int | None:
    # Tensors made under inference_mode keep no version counter (and cannot be changed outside it).
    return None if t.is_inference() else t._version


class PackedWeight:
    """A packed fp32 copy of one weight [out, in], valid while that weight's storage and version are unchanged."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), PACK_ROWS)
        self.dtype = weight.dtype
        self._ptr, self._version = weight.data_ptr(), _version(weight)

    def usable(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        return (
            weight.data_ptr() == self._ptr
            and _version(weight) == self._version
            and weight.dtype == x.dtype == self.dtype
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (self.dtype == torch.float32 or x.numel() >= BF16_MIN_ROWS * x.shape[-1])
        )


def pack(weight: torch.Tensor | None) -> PackedWeight | None:
    return PackedWeight(weight) if weight is not None and packing_supported(weight) else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:  # x [..., in] -> [..., out]
    if packed is None or not packed.usable(weight, x):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.float()
    return torch.ops.mkldnn._linear_pointwise(x.float(), packed.packed, b, "none", [], "").to(x.dtype)


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


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear` (inference only); returns how many were packed.
    Weights that cannot be packed here (GPU, bf16 with native support) keep their plain matmul."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_supported(child.weight):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
