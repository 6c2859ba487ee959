"""Inference matmuls on CPU through weights packed once at load.

A plain `F.linear` re-packs the weight on every call, and on a CPU without native bf16 its bf16 matmul is linear in
rows. At the few rows of a decode or verify step that is most of a forward's cost. Two packed paths, chosen per
weight when it is packed:

- `native` (CPUs with AVX2 + FMA, where verispec.kernels.native builds): verispec's own kernel over a blocked
  copy of the weight in its own dtype (fp32 or bf16, fp32 accumulation; an fp32 weight that holds bf16 values,
  as a bf16 checkpoint loaded in fp32 does, is packed in bf16: the same results from half the bytes). Every row
  is computed in one fixed order whatever the row count, so a verify step gives each token the matmul results a
  one-token step gives it. The shipped target's matmuls in bf16 on a 2-vCPU AVX2 machine take 3.8 /
  7.3 / 11.2 ms at 1 / 9 / 16 rows in one run (the VM's speed moves between runs): 1.6-2.5x faster than oneDNN's
  packs, 1.2x faster than bf16 `F.linear` at one row and far more above (`python scripts/kernel_cost.py`;
  reports/bench-block).
- `onednn` (elsewhere, where oneDNN packs): the weight packed into oneDNN's blocked layout. For bf16 on a CPU
  without native bf16 (oneDNN cannot pack bf16 there) the pack is the weight's exact fp32 upcast, used from
  BF16_MIN_ROWS rows with the input upcast and the output rounded back to bf16 (a bf16 matmul in another summation
  order); fewer rows stay on bf16 `F.linear`, which reads half the bytes.

With native bf16 (AVX512-BF16, AMX) bf16 weights are not packed: oneDNN's own bf16 path is fast there.

Packing is for frozen weights at inference (neither path has autograd): `linear` falls back to `F.linear` whenever
a gradient is wanted, the input is in another dtype or off the CPU, or the weight was changed or moved after
packing.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import native

# The row count oneDNN tunes the layout for: a verify step of 8 drafts is 9 rows, a block drafter's 8-16.
PACK_ROWS = 16
# bf16 packs are used from this many rows: below it bf16 F.linear, reading half the bytes, is as fast or faster
# (2-vCPU AVX2: 7.9 / 11.2 / 14.8 ms for 1 / 2 / 3 rows unpacked, 8.3 / 17.6 / 15.6 packed).
BF16_MIN_ROWS = 3


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _onednn_packs(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and not cpu_has_native_bf16())


def _native_packs(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if weight.dtype == torch.bfloat16 and cpu_has_native_bf16():
        return False
    return native.available()


def packing_supported(weight: torch.Tensor) -> bool:
    return _native_packs(weight) or _onednn_packs(weight)


def _narrowest(w: torch.Tensor) -> torch.Tensor:
    """fp32 weights that are exactly bf16 values (a checkpoint saved in bf16, loaded in fp32) as bf16: the native
    kernel computes in fp32 either way, so the products and sums are the same, from half the bytes."""
    if w.dtype == torch.float32:
        narrow = w.to(torch.bfloat16)
        if torch.equal(narrow.float(), w):
            return narrow
    return w


def pack_nbytes(weight: torch.Tensor) -> int:
    """Memory a pack of this weight takes: a copy in its own dtype (native) or in fp32 (oneDNN)."""
    if not packing_supported(weight):
        return 0
    return weight.numel() * (weight.element_size() if _native_packs(weight) else 4)


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
        w = weight.detach()
        self.kind = "native" if _native_packs(weight) else "onednn"
        if self.kind == "native":
            self.packed = native.pack(_narrowest(w))
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.float(), PACK_ROWS)
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        self._ptr, self._version = weight.data_ptr(), weight_version(weight)
        self._bias: tuple[int, int | None, torch.Tensor] | None = None  # (ptr, version, padded fp32 copy)

    def usable(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        return (
            weight.data_ptr() == self._ptr
            and weight_version(weight) == self._version
            and weight.dtype == x.dtype == self.dtype
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (self.kind == "native" or self.dtype == torch.float32 or x.numel() >= BF16_MIN_ROWS * x.shape[-1])
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
    if packed.kind == "native":
        return native.linear(x, packed.packed, packed.out_features, packed.native_bias(bias))
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
        kind = self.packed.kind if self.packed is not None else None
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={kind}"
