"""The quantization scheme: the one source of its defaults (bits, group size) for the CLI and the format."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.errors import ConfigError

GROUP_SIZES = (32, 64, 128)  # group-wise scales; None means one scale per output channel
SCHEMES = ("w8a16", "w4a16", "w4a8")
ACT_BITS = (16, 8)  # activations as they are (bf16/fp32), or rounded to int8 per group at run time


@dataclass(frozen=True)
class QuantScheme:
    """Symmetric integer quantization of a Linear's weight [out, in], and of its input where act_bits is 8."""

    bits: int = 4
    """4 or 8: values in [-2^(bits-1), 2^(bits-1) - 1]."""
    group_size: int | None = 128
    """Input columns sharing one scale (32, 64 or 128), or None for one scale per output channel."""
    act_bits: int = 16
    """16: weight-only (the input as it is); 8 (int4 weights only): each row of the input is rounded to int8 per
    group at run time, one scale a group, amax / 127 (quant.act8): the W4A8 integer matmul (kernels/qgemm.c)."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"unsupported num_bits {self.bits}; use 4 or 8")
        if self.act_bits not in ACT_BITS:
            raise ConfigError(f"unsupported activation bits {self.act_bits}; use 8 or 16 (none)")
        if self.act_bits == 8 and (self.bits != 4 or self.group_size is None):
            raise ConfigError("int8 activations take int4 weights in groups (w4a8); w8a8 is unsupported")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ConfigError(f"unsupported group size {self.group_size}; use 32, 64, 128 or channel")

    @classmethod
    def named(cls, name: str, group_size: int | None = None) -> QuantScheme:
        """w8a16: int8, per channel unless a group size is given; w4a16: int4, group 128 unless given; w4a8: w4a16's
        weights with int8 activations per group."""
        if name == "w8a16":
            return cls(bits=8, group_size=group_size or None)
        if name in ("w4a16", "w4a8"):
            return cls(bits=4, group_size=group_size or 128, act_bits=16 if name == "w4a16" else 8)
        raise ConfigError(f"unknown scheme {name!r}; use {' or '.join(SCHEMES)}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group(self, in_features: int) -> int:
        """Columns per scale for a weight with `in_features` columns."""
        return in_features if self.group_size is None else self.group_size

    def hint(self, in_features: int) -> str:
        """What to pass instead, for an error where the group size does not divide a layer's `in_features`."""
        fits = [str(g) for g in GROUP_SIZES if in_features % g == 0]
        return f"; use --group-size {' or '.join(fits)}" if fits else "; use a per-channel scheme (w8a16)"

    @property
    def name(self) -> str:
        return f"w{self.bits}a{self.act_bits}-" + ("channel" if self.group_size is None else f"g{self.group_size}")
