"""The int8 / int4 weight-only matmul (kernels/qgemm.c through native.qpack / qlinear): on every kernel path this
CPU runs, each row's output is the same bits whatever the row count (1..16) and thread count, every path agrees,
every output is exactly the chain qgemm.c documents (a scalar C reference, tests/qgemm_ref.c), and it is close to
the dense fp32 product x @ (q * scale)^T. Plus bias, bf16 in and out, odd shapes and what the wrappers refuse."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from verispec.kernels import native

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not native.qavailable(),
                                reason="native kernels need AVX2 + FMA and a C compiler (see native.FALLBACK_NOTE)")
ISAS = [isa for isa in native.ISAS if isa in native.cpu_features()] if native.available() else []

# (bits, group, N, K): groups 32/64/128, per-channel (group = K, padded inside: K odd, or not a multiple of 8 for
# int4), N not a multiple of 16, K a multiple of the group but not of 64, zoo-sized shapes over many thread units.
SHAPES = [(4, 32, 80, 128), (4, 32, 37, 96), (4, 64, 50, 192), (4, 128, 24, 256), (4, 32, 1024, 512),
          (4, 36, 21, 36), (8, 96, 37, 96), (8, 37, 21, 37), (8, 32, 40, 160), (8, 512, 1024, 512)]


def _ref_lib() -> ctypes.CDLL:
    lib = native.build_library("qgemm-ref", (Path(__file__).with_name("qgemm_ref.c"),),
                               ("-O1", "-ffp-contract=off", "-fPIC", "-shared"))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ref_qlinear.restype = None
    lib.ref_qlinear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr]
    return lib


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:  # x [M, K] fp32 -> [M, N] fp32, the chain in C
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], q.shape[0])
    _ref_lib().ref_qlinear(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scales.data_ptr(), group,
                           None if bias is None else bias.data_ptr(), q.shape[0], y.data_ptr())
    return y


def weights(bits: int, group: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scales = (0.5 + torch.rand(n, k // group, generator=g)) / (8 if bits == 4 else 128)
    return q, scales, native.qpack(q, scales, group, bits)


@pytest.mark.parametrize("xdtype", [torch.float32, BF16])  # bf16 x: vdpbf16ps on the AVX-512 BF16 path
@pytest.mark.parametrize("bits,group,n,k", SHAPES)
def test_every_path_and_row_count_computes_the_reference_chain(bits, group, n, k, xdtype):
    q, scales, packed = weights(bits, group, n, k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(1)).to(xdtype)
    want = reference(x, q, scales, group)
    for isa in ISAS:
        with native.use(isa):
            alone = torch.cat([native.qlinear(x[i : i + 1], packed, out_dtype=torch.float32) for i in range(16)])
            assert torch.equal(alone, want), f"{isa}: not the reference chain"
            for m in range(2, 17):
                assert torch.equal(native.qlinear(x[:m], packed, out_dtype=torch.float32), want[:m]), (isa, m)
    dense = x.double() @ (q.double() * scales.double().repeat_interleave(group, 1)).T
    torch.testing.assert_close(want, dense.float(), rtol=1e-5, atol=1e-5 * k**0.5)


def test_the_thread_count_changes_nothing():
    q, scales, packed = weights(4, 32, 1024, 512)
    x = torch.randn(9, 512)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(native.qlinear(x, packed))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 96)])
def test_bias_and_bf16_in_and_out(bits, group):
    q, scales, packed = weights(bits, group, 37, 96)
    bias = torch.randn(37)
    x = torch.randn(5, 96).to(BF16)  # bf16 x is used as its fp32 values
    want = reference(x, q, scales, group, bias)
    for isa in ISAS:
        with native.use(isa):
            assert torch.equal(native.qlinear(x.float(), packed, bias), want), isa
            got = native.qlinear(x, packed, bias)
            assert got.dtype == BF16 and torch.equal(got, want.to(BF16)), isa  # round to nearest even
            assert torch.equal(native.qlinear(x, packed, bias, out_dtype=torch.float32), want), isa
            assert torch.equal(native.qlinear(x.float(), packed, bias, out_dtype=BF16), want.to(BF16)), isa
    tall = torch.randn(20, 96, generator=torch.Generator().manual_seed(2)).to(BF16)  # past 12 rows: prefill tiles
    want_tall = reference(tall, q, scales, group, bias)
    for isa in ISAS:
        with native.use(isa):
            assert torch.equal(native.qlinear(tall, packed, bias, out_dtype=torch.float32), want_tall), isa
            assert torch.equal(native.qlinear(tall, packed, bias), want_tall.to(BF16)), isa
    got = native.qlinear(x.view(5, 1, 96).expand(5, 3, 96).contiguous(), packed, bias)  # leading dims
    assert got.shape == (5, 3, 37) and torch.equal(got[:, 2], want.to(BF16))


def test_qpacked_describes_its_weight():
    _, _, p4 = weights(4, 32, 37, 96)
    _, _, p8 = weights(8, 96, 37, 96)
    assert (p4.n, p4.k, p4.bits, p4.group) == (37, 96, 4, 32)
    assert p4.nbytes == 3 * 3 * (16 * 16 + 64)  # 3 blocks x 3 groups x (16 pairs x 16 bytes + 16 scales)
    assert p8.nbytes == 3 * 1 * (48 * 32 + 64)
    assert p4.nbytes < p8.nbytes < 37 * 96 * 2  # a bf16 weight's bytes


def test_qpack_and_qlinear_refuse_what_the_kernel_cannot_read():
    q, scales, packed = weights(4, 32, 40, 64)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        native.qpack(q, scales, 32, 3)
    with pytest.raises(ValueError, match="group 24 must divide"):
        native.qpack(q, scales, 24, 4)
    with pytest.raises(ValueError, match="group 4 must divide K = 64 and be a multiple of 8"):
        native.qpack(q, torch.ones(40, 16), 4, 4)
    with pytest.raises(ValueError, match="group 7 must divide"):
        native.qpack(torch.zeros(4, 14, dtype=torch.int8), torch.ones(4, 2), 7, 8)  # odd group below K
    with pytest.raises(ValueError, match="int8"):
        native.qpack(q.to(torch.int16), scales, 32, 4)
    with pytest.raises(ValueError, match="int8"):
        native.qpack(q.t(), scales, 32, 4)  # not contiguous
    with pytest.raises(ValueError, match=r"scales \[40, 2\]"):
        native.qpack(q, scales[:, :1].contiguous(), 32, 4)
    with pytest.raises(ValueError, match="scales"):
        native.qpack(q, scales.double(), 32, 4)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        native.qpack(q * 2, scales, 32, 4)
    with pytest.raises(ValueError, match="64"):
        native.qlinear(torch.randn(3, 65), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.qlinear(torch.randn(3, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="contiguous"):
        native.qlinear(torch.randn(64, 3).t(), packed)
    with pytest.raises(ValueError, match="bias"):
        native.qlinear(torch.randn(3, 64), packed, torch.zeros(48))  # a pad_bias()ed bias is not [N]
    with pytest.raises(ValueError, match="float32"):
        native.qlinear(torch.randn(3, 64), packed, torch.zeros(40, dtype=BF16))
    with pytest.raises(ValueError, match="out_dtype"):
        native.qlinear(torch.randn(3, 64), packed, out_dtype=torch.float16)
    bad = native.QPacked(packed.data[:1].contiguous(), packed.n, packed.k, packed.bits, packed.group)
    with pytest.raises(ValueError, match="qpack"):
        native.qlinear(torch.randn(3, 64), bad)
    with pytest.raises(ValueError, match="qpack"):
        native.qlinear(torch.randn(3, 64), native.QPacked(packed.data, 40, 64, 8, 32))  # bits it was not packed for
    with pytest.raises(ValueError, match="group 0"):
        native.qlinear(torch.randn(3, 64), native.QPacked(packed.data, 40, 64, 4, 0))


def _bf16_cases(k: int) -> torch.Tensor:  # [11, k] bf16 rows whose sums (x[r, 0] + x[r, 1]) are rounding cases
    x = torch.zeros(11, k)
    x[:8, 0] = 1.0
    x[:8, 1] = torch.arange(8) * 2.0**-8  # 1 + m/256: halfway between bf16 neighbours for odd m (ties to even)
    x[8, 0] = float("inf")
    x[9, :2] = torch.tensor([float("inf"), float("-inf")])  # NaN
    # -(bf16's largest finite value + half its last step): a finite fp32 tie that rounds to even, -inf in bf16
    x[10, :2] = torch.tensor([-(2 - 2.0**-7) * 2.0**127, -(2.0**119)])
    return x.to(BF16)


def _same_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    nan = want.isnan()
    return bool((got.isnan() == nan).all() and torch.equal(got[~nan], want[~nan]))


def test_bf16_outputs_round_every_case_as_torch():
    """qgemm.c's bf16 stores (full vectors in registers, the tail one by one) round as torch's fp32 -> bf16 does on
    ties, infinities, NaN and overflow, and so do gemm.c's. Each column scales its row's sum by its own power of
    two (a tie stays a tie), so a column out of place shows too."""
    n, k = 40, 32  # two full 16-column vectors (five of 8) and a partial one
    x = _bf16_cases(k)
    col = 2.0 ** (torch.arange(n) % 11 - 5.0)  # no two of any 8 neighbours alike; column 5: scale 1
    w = col[:, None] * torch.ones(n, k)  # powers of two: exact in bf16
    qpacked = native.qpack(torch.ones(n, k, dtype=torch.int8), col[:, None].contiguous(), k, 8)
    dense16, dense32 = native.pack(w.to(BF16)), native.pack(w)
    for isa in ISAS:
        with native.use(isa):
            want = native.qlinear(x, qpacked, out_dtype=torch.float32).to(BF16)
            assert want[1, 5] == 1.0 and want[3, 5] == 1.0 + 2.0**-6 and want[10, 5] == float("-inf")
            assert _same_bf16(native.qlinear(x, qpacked), want), isa
            assert _same_bf16(native.linear(x, dense16), native.linear(x.float(), dense32).to(BF16)), isa
