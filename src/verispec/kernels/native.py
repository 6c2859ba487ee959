"""verispec's own CPU kernels, compiled on first use and called through ctypes: the matmul of inference
(`gemm.c`) and its int8/int4 weight-only form (`qgemm.c`), attention of a few queries over a KV cache
(`attention.c`), the greedy DSpark head loop (`markov.c`), a block drafter's layer in one call (`blocklayer.c`), the target's whole forward in one call
(`decoder.c`) and the greedy argmax of logits (`argmax.c`). The matmul and attention compute a row (a token, a
query) in one fixed order whatever else is in the call, so a verify step over 9 tokens gives each token what a
one-token step gives it.

The sources are built once per instruction set (ISAS: AVX2 + FMA; AVX-512F; AVX-512 BF16, whose vdpbf16ps
takes bf16 inputs on bf16 weights) and the best one this CPU runs is chosen at run time (`VERISPEC_KERNELS=avx2`
or another name forces one; `use()` switches within a process). All of them give the same results bit for bit
(gemm.c says why), so the choice changes speed, never tokens. CPUs with AMX also have AVX-512 BF16 and take that
path: no AMX tile code ships, as neither CPU this project runs on has AMX to test it.

The kernels are plain C files built with the system C compiler (`$CC`, else `cc`) into the user cache, one
shared library per source hash and instruction set; no torch headers, so a build takes seconds. It links OpenMP by
its soname, which resolves to the libgomp torch has already loaded: the kernels and torch share one thread pool.
Where they cannot be used (no AVX2/FMA, no compiler, a failed build, `VERISPEC_NATIVE=0`) `library()` returns None
once and for all, with one warning naming the cause and what exactness then means, and callers keep torch.

Every wrapper checks what it hands to C (device, dtype, contiguity, shapes against the packed weight) and raises
ValueError on a mismatch: a wrong pointer here is a read past the end of a buffer, not an exception.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.paths import user_cache

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gemm.c", "attention.c", "markov.c", "blocklayer.c", "decoder.c", "argmax.c"))
QSOURCES = (Path(__file__).with_name("qgemm.c"),)  # a library of its own per ISA, built on first qlinear
# included by the sources: part of the build hash
HEADERS = tuple(Path(__file__).with_name(h) for h in ("vecmath.h", "simd.h", "weights.h", "attention.h"))
PROBE = Path(__file__).with_name("cpu.c")
BLOCK = 16  # output columns per packed block (gemm.c)
# Instruction sets, slowest first, with their compiler flags and the CPU features they need (cpu.c's bits).
ISAS = ("avx2", "avx512", "avx512bf16")
_ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma"),
    "avx512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    "avx512bf16": ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                   "-mavx512vnni"),
}
# cpu.c's bits each needs; every CPU with AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4 on) has VNNI too
_ISA_NEEDS = {"avx2": 0b11, "avx512": 0b111111, "avx512bf16": 0b11111111}
# -ffp-contract=off: a*b + c stays two roundings in every build, as torch computes it, so no build fuses what
# another does not.
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
FALLBACK_NOTE = ("matmuls and attention fall back to torch, whose result for a row can depend on how many rows "
                 "share the call: speculative output still follows the target, but greedy bf16 (rarely fp32) "
                 "speculation can differ from plain decoding where two tokens nearly tie")

_lock = threading.RLock()
_state: dict[str, object] = {}  # "lib": the active library or None, once decided; "features": cpu.c's bits
_libs: dict[str, ctypes.CDLL] = {}  # every variant loaded so far, by ISA
_qlibs: dict[str, ctypes.CDLL] = {}  # qgemm.c's, by ISA
_qaddrs: dict[str, int] = {}  # the address of each one's vs_qlinear, for decoder.c


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    return cc


def _build(out: Path, sources: tuple[Path, ...], flags: tuple[str, ...]) -> None:
    cc = _compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(tmp, out)  # atomic: a concurrent process sees the old file or the new one, never half of one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _digest(files: tuple[Path, ...], extra: bytes = b"") -> str:
    """16 hex digits of the files' contents (and `extra`)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in files) + extra).hexdigest()[:16]


def build_library(name: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> ctypes.CDLL:
    """C sources built into one shared library in the user cache (once per source hash and flags), loaded."""
    digest = _digest((*sources, *HEADERS), " ".join(flags).encode())
    path = user_cache("kernels") / f"verispec-{name}-{digest}.so"
    if not path.exists():
        _build(path, sources, flags)
    return ctypes.CDLL(str(path))


def cpu_features() -> set[str]:
    """The instruction sets of ISAS this CPU (and its OS) runs, from cpu.c's probe (built without ISA flags)."""
    if "features" not in _state:
        lib = build_library("probe", (PROBE,), ("-O1", "-fPIC", "-shared"))
        lib.vs_cpu_features.restype = ctypes.c_int
        _state["features"] = lib.vs_cpu_features()
    bits = int(_state["features"])  # type: ignore[arg-type]
    return {isa for isa in ISAS if bits & _ISA_NEEDS[isa] == _ISA_NEEDS[isa]}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint, flt = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    sigs = {
        "vs_linear": (cint, [ptr, cint, i64, i64, i64, ptr, cint, ptr, i64, ptr, cint, cint]),
        "vs_attention": (cint, [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr,
                                i64, flt, cint]),
        "vs_attention_tree": (cint, [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64,
                                     ptr, i64, ptr, ptr, i64, flt, cint]),
        "vs_markov_greedy": (cint, [ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, ptr, cint]),
        "vs_argmax": (cint, [ptr, cint, i64, i64, i64, ptr]),
        "vs_rmsnorm": (None, [ptr, i64, i64, ptr, flt, ptr]),
        "vs_block_layer_batch": (cint, [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, flt, ptr, ptr, i64, i64,
                                        i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, cint, cint]),
        "vs_decoder_forward": (cint, [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, cint, ptr]),
        "vs_isa": (cint, []),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def load_isa(isa: str) -> ctypes.CDLL:
    """The kernel library built for one instruction set (ISAS), built on first use; raises RuntimeError where
    this CPU lacks it or the build fails."""
    if isa not in ISAS:
        raise ValueError(f"unknown kernel instruction set {isa!r} (choose from {', '.join(ISAS)})")
    with _lock:
        if isa not in _libs:
            if isa not in cpu_features():
                raise RuntimeError(f"this CPU does not run the {isa} kernels")
            _libs[isa] = _declare(build_library(isa, SOURCES, (*FLAGS, *_ISA_FLAGS[isa])))
        return _libs[isa]


def _load() -> ctypes.CDLL | None:
    choice = os.environ.get("VERISPEC_KERNELS", "auto")
    if os.environ.get("VERISPEC_NATIVE", "1") == "0" or choice == "off":
        return None
    try:
        runnable = [isa for isa in ISAS if isa in cpu_features()]
        if not runnable:
            warnings.warn(f"verispec: this CPU has no AVX2 + FMA, so no native kernels: {FALLBACK_NOTE}",
                          stacklevel=3)
            return None
        if choice != "auto" and choice not in runnable:
            raise RuntimeError(f"VERISPEC_KERNELS={choice} is not one of this CPU's {', '.join(runnable)}")
        return load_isa(runnable[-1] if choice == "auto" else choice)
    except (OSError, RuntimeError) as e:
        warnings.warn(f"verispec: native kernels unavailable ({e}): {FALLBACK_NOTE}", stacklevel=3)
        return None


def library() -> ctypes.CDLL | None:
    """The active kernel library, or None where the kernels cannot be used (decided once per process)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = None  # a failing _load must not be retried
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return library() is not None


def isa() -> str | None:
    """The instruction set of the active kernels (one of ISAS), or None without them."""
    lib = library()
    return None if lib is None else ISAS[lib.vs_isa() - 1]


def source_digest() -> str:
    """A digest of every kernel source and header (qgemm.c's included): what a measured step cost was measured with,
    so that a cost cached under other kernels is measured again (profile.profile_key)."""
    if "sources" not in _state:
        _state["sources"] = _digest((*SOURCES, *QSOURCES, *HEADERS))
    return _state["sources"]  # type: ignore[return-value]


@contextmanager
def use(name: str) -> Iterator[None]:
    """Run the kernels of one instruction set inside the block (process-wide: tests compare paths with it)."""
    lib = load_isa(name)
    previous = library()
    if previous is None:
        raise RuntimeError("native kernels are disabled in this process")
    _state["lib"] = lib
    try:
        yield
    finally:
        _state["lib"] = previous


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("verispec native kernels are unavailable here: check available() first")
    return lib


def _cpu(t: torch.Tensor, what: str, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    if t.device.type != "cpu" or t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"native {what}: expected a CPU {names} tensor, got {t.dtype} on {t.device}")


@dataclass(frozen=True)
class Packed:
    """A weight [n, k] in gemm.c's layout: bf16 [n16 / 16, k2, 16, 2] or fp32 [n16 / 16, k2, 2, 16]."""

    data: torch.Tensor
    n: int
    k: int

    @property
    def bf16(self) -> bool:
        return self.data.dtype == torch.bfloat16

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack(weight: torch.Tensor) -> Packed:  # [N, K] fp32 or bf16 -> Packed, same dtype
    """gemm.c's layout: blocks of 16 output columns, a column's inputs in pairs (2p, 2p + 1), zero padded."""
    _cpu(weight, "pack", (torch.float32, torch.bfloat16))
    if weight.dim() != 2:
        raise ValueError(f"native pack: expected a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    n16, k2 = -(-n // BLOCK) * BLOCK, -(-k // 2)
    padded = weight.detach().new_zeros(n16, 2 * k2)
    padded[:n, :k] = weight.detach()
    blocks = padded.view(n16 // BLOCK, BLOCK, k2, 2)  # [b, j, p, e]
    order = (0, 2, 1, 3) if weight.dtype == torch.bfloat16 else (0, 2, 3, 1)  # [b, p, j, e] or [b, p, e, j]
    return Packed(blocks.permute(*order).contiguous(), n, k)


def pad_bias(bias: torch.Tensor) -> torch.Tensor:  # [N] -> fp32 [ceil(N / 16) * 16]
    out = torch.zeros(-(-bias.shape[0] // BLOCK) * BLOCK, dtype=torch.float32)
    out[: bias.shape[0]] = bias.detach().float()
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_bias(bias: torch.Tensor | None, n: int, what: str) -> None:
    if bias is not None:
        _cpu(bias, what)
        if not bias.is_contiguous() or bias.numel() != -(-n // BLOCK) * BLOCK:
            raise ValueError(f"native {what}: the bias must be pad_bias() of an [{n}] bias")


def linear(
    x: torch.Tensor,  # [..., K] fp32 or bf16, CPU
    packed: Packed,  # pack(weight [N, K]), fp32 or bf16
    bias: torch.Tensor | None = None,  # pad_bias(b)
) -> torch.Tensor:  # [..., N] in x's dtype
    """y = x @ W^T (+ b) with fp32 accumulation. Each output row is computed in one fixed order whatever the
    number of rows or threads (see gemm.c), so a row's result never depends on the rest of the batch."""
    lib = _required()
    _cpu(x, "linear", (torch.float32, torch.bfloat16))
    k, n = packed.k, packed.n
    if x.shape[-1] != k:
        raise ValueError(f"native linear: input has {x.shape[-1]} features, the packed weight takes {k}")
    _check_bias(bias, n, "linear")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    bf16 = torch.bfloat16
    rc = lib.vs_linear(
        x2.data_ptr(), x.dtype == bf16, m, k, x2.stride(0) if m > 1 else k, packed.data.data_ptr(), packed.bf16,
        None if bias is None else bias.data_ptr(), n, y.data_ptr(), x.dtype == bf16, torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("native matmul: out of memory")
    return y


# ---- weight-only int8 / int4 matmuls (qgemm.c) ----------------------------------------------------------------------

@dataclass(frozen=True)
class QPacked:
    """A weight q [n, k] (int8, or int4 in [-8, 7]) with fp32 scales per output column and group of inputs, in
    qgemm.c's layout: uint8 [n16 / 16, k / group, group bytes + 64] (a block's weights of one group, by 8 inputs
    for int4 and by pair for int8, then the group's 16 scales). act_bits 8 (int4 only): qlinear rounds its input
    to int8 per group of inputs first (W4A8, see qgemm.c); 16: the input as it is."""

    data: torch.Tensor
    n: int
    k: int
    bits: int
    group: int
    act_bits: int = 16

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _qlibrary() -> ctypes.CDLL:
    """qgemm.c built for the active kernels' instruction set (use() and VERISPEC_KERNELS pick its path too); a
    library of its own, so the other kernels neither wait for its build nor rebuild when it changes."""
    name = isa()
    if name is None:
        raise RuntimeError("verispec native kernels are unavailable here: check qavailable() first")
    with _lock:
        if name not in _qlibs:
            lib = build_library(f"q{name}", QSOURCES, (*FLAGS, *_ISA_FLAGS[name]))
            i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
            lib.vs_qlinear.restype = cint
            lib.vs_qlinear.argtypes = [ptr, cint, i64, i64, i64, ptr, cint, i64, cint, ptr, i64, ptr, cint, cint]
            _qlibs[name] = lib
        return _qlibs[name]


def qavailable() -> bool:
    """Whether qlinear runs here: the native kernels do and qgemm.c builds (a failure is warned about once)."""
    if not available():
        return False
    try:
        _qlibrary()
        return True
    except (OSError, RuntimeError) as e:
        if "qfail" not in _state:
            _state["qfail"] = True
            warnings.warn(f"verispec: int8/int4 kernels unavailable ({e})", stacklevel=2)
        return False


def qpack(
    q: torch.Tensor,  # [N, K] int8 (bits 4: values in [-8, 7])
    scales: torch.Tensor,  # [N, K // group] fp32 (group == K: one scale per output channel)
    group: int,  # inputs per scale: divides K; a multiple of 8 (int4) or 2 (int8) unless it is K
    bits: int,  # 4 or 8
    act_bits: int = 16,  # 8: qlinear rounds its input to int8 per group (int4 weights only)
) -> QPacked:
    """qgemm.c's layout: blocks of 16 output columns, each a stream of its groups (weights, then the group's
    scales), pad columns zero; a group spanning K is padded with zero weights to a multiple of 8 (int4) or 2."""
    if bits not in (4, 8):
        raise ValueError(f"native qpack: bits must be 4 or 8, got {bits}")
    if act_bits not in (8, 16) or (act_bits == 8 and bits != 4):
        raise ValueError(f"native qpack: act_bits {act_bits} with {bits}-bit weights (int8 activations take int4)")
    if q.dtype != torch.int8 or q.device.type != "cpu" or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"native qpack: expected a contiguous CPU int8 [N, K] weight, got {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}")
    n, k = q.shape
    align = 8 if bits == 4 else 2  # inputs per load step in qgemm.c
    if n == 0 or k == 0 or group <= 0 or k % group or (group % align and group != k):
        raise ValueError(f"native qpack: group {group} must divide K = {k} and be a multiple of {align} (or K)")
    groups = k // group
    if scales.dtype != torch.float32 or scales.device.type != "cpu" or tuple(scales.shape) != (n, groups) \
            or not scales.is_contiguous():
        raise ValueError(f"native qpack: expected contiguous CPU fp32 scales [{n}, {groups}], got {scales.dtype} "
                         f"{tuple(scales.shape)} on {scales.device}")
    if bits == 4 and n and (q.min() < -8 or q.max() > 7):
        raise ValueError("native qpack: int4 weights must lie in [-8, 7]")
    n16, gp = -(-n // BLOCK) * BLOCK, -(-group // align) * align
    padded = q.new_zeros(n16, groups, gp)
    padded[:n, :, :group] = q.view(n, groups, group)
    if bits == 4:  # a column's int32 per 8 inputs: nibbles of inputs 0, 2, 4, 6, 1, 3, 5, 7 from bit 0 up
        eights = padded.view(n16 // BLOCK, BLOCK, groups, gp // 8, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
        nib = eights.to(torch.int64) & 15
        word = (nib << torch.arange(0, 32, 4)).sum(-1)  # [b, j, g, o] as uint32 values
        word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
        wbytes = word.permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [b, g, o, j] little-endian bytes
    else:
        pairs = padded.view(n16 // BLOCK, BLOCK, groups, gp // 2, 2)  # [b, j, g, p, e]
        wbytes = pairs.view(torch.uint8).permute(0, 2, 3, 4, 1)  # [b, g, p, e, j]
    sc = scales.new_zeros(n16, groups)
    sc[:n] = scales
    sbytes = sc.view(n16 // BLOCK, BLOCK, groups).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 64]
    data = torch.cat([wbytes.reshape(n16 // BLOCK, groups, -1), sbytes], dim=2).contiguous()
    return QPacked(data, n, k, bits, group, act_bits)


def _check_qpacked(packed: QPacked, what: str) -> None:
    """A QPacked's data is what qpack() makes of its n, k, bits and group: qgemm.c reads that many bytes."""
    n, k = packed.n, packed.k
    if packed.bits not in (4, 8) or packed.group <= 0 or k % packed.group:
        raise ValueError(f"native {what}: bits {packed.bits} / group {packed.group} is not a qpack() of K = {k}")
    if packed.act_bits not in (8, 16) or (packed.act_bits == 8 and packed.bits != 4):
        raise ValueError(f"native {what}: act_bits {packed.act_bits} with {packed.bits}-bit weights (int8 "
                         "activations take int4 weights)")
    align = 8 if packed.bits == 4 else 2
    gp = -(-packed.group // align) * align
    want = (-(-n // BLOCK), k // packed.group, gp * BLOCK * packed.bits // 8 + 4 * BLOCK)  # weights, 16 scales
    if tuple(packed.data.shape) != want or packed.data.dtype != torch.uint8 or not packed.data.is_contiguous() \
            or packed.data.device.type != "cpu":
        raise ValueError(f"native {what}: packed data {tuple(packed.data.shape)} is not qpack()'s {want}")


def _qlinear_address() -> int:
    """The address of the active instruction set's vs_qlinear (qgemm.c), which decoder.c calls for int weights."""
    name = isa()
    if name not in _qaddrs:
        _qaddrs[name] = ctypes.cast(_qlibrary().vs_qlinear, ctypes.c_void_p).value  # type: ignore[arg-type,index]
    return _qaddrs[name]  # type: ignore[index]


def qlinear(
    x: torch.Tensor,  # [..., K] fp32 or bf16, CPU, contiguous
    packed: QPacked,  # qpack(q [N, K], scales, group, bits)
    bias: torch.Tensor | None = None,  # fp32 [N]
    out_dtype: torch.dtype | None = None,  # fp32 or bf16; None: x's dtype
) -> torch.Tensor:  # [..., N]
    """y = x @ (q * scale)^T (+ b), fp32 accumulation (bf16 x as its fp32 values). Each output is one fixed chain
    (see qgemm.c), so a row's result never depends on the rest of the batch, the thread count or the ISA path."""
    lib = _qlibrary()
    _cpu(x, "qlinear", (torch.float32, torch.bfloat16))
    k, n = packed.k, packed.n
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"native qlinear: input has {x.shape[-1] if x.dim() else 0} features, the packed weight "
                         f"takes {k}")
    if not x.is_contiguous():
        raise ValueError("native qlinear: the input must be contiguous")
    if bias is not None:
        _cpu(bias, "qlinear bias")
        if bias.shape != (n,) or not bias.is_contiguous():
            raise ValueError(f"native qlinear: the bias must be a contiguous fp32 [{n}], got {tuple(bias.shape)}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"native qlinear: out_dtype must be float32 or bfloat16, got {out_dtype}")
    _check_qpacked(packed, "qlinear")
    m = x.numel() // k
    y = torch.empty(*x.shape[:-1], n, dtype=out_dtype)
    rc = lib.vs_qlinear(x.data_ptr(), x.dtype == torch.bfloat16, m, k, k, packed.data.data_ptr(), packed.bits,
                        packed.group, packed.act_bits, _ptr(bias), n, y.data_ptr(), out_dtype == torch.bfloat16,
                        torch.get_num_threads())
    if rc == -1:
        raise MemoryError("native qlinear: out of memory")
    if rc != 0:
        raise ValueError(f"native qlinear failed ({rc}): bits {packed.bits}, group {packed.group}, K {k}")
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] fp32 or bf16, CPU, last dim contiguous -> [R] int64
    """torch.argmax(x, dim=-1) by the same rule (first maximum; a NaN wins), vectorised (see argmax.c)."""
    out = torch.empty(x.shape[0] if x.dim() else 0, dtype=torch.long)
    _argmax_into(x, out.data_ptr())
    return out


def argmax_ids(x: torch.Tensor) -> list[int]:  # [R, V] as argmax() takes -> R token ids
    """argmax(x) as a host list, straight from the kernel into a ctypes array: a verify step reads its winners as
    Python ints anyway, and an output tensor to fill, view and read back costs more than the argmax of a row."""
    out = (ctypes.c_int64 * (x.shape[0] if x.dim() else 0))()
    _argmax_into(x, out)
    return list(out)


def _argmax_into(x: torch.Tensor, out) -> None:  # out: R int64s (a pointer, or a ctypes array)
    lib = _required()
    _cpu(x, "argmax", (torch.float32, torch.bfloat16))
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"native argmax: expected [rows, cols] with cols > 0, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    lib.vs_argmax(x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], x.stride(0), out)


def markov_greedy(
    base: torch.Tensor,  # [span, V] fp32 block logits U, rows contiguous (V: the draft vocabulary's size)
    w1: torch.Tensor,  # [V1, r] fp32, contiguous (markov_in, a row per token of the full vocabulary)
    w2t: torch.Tensor,  # [r, V] fp32, contiguous (markov_out's weight, transposed; cut to the draft vocabulary)
    anchor: int,
    vocab: torch.Tensor | None = None,  # [V] int64 ascending token ids of the columns; None: all V1 == V tokens
) -> list[int]:  # span token ids
    """Greedy drafts of DSpark's Markov head: x_j = argmax(U_j + W2 W1[x_{j-1}]), x_0 = anchor (see markov.c)."""
    lib = _required()
    for t in (base, w1, w2t):
        _cpu(t, "markov_greedy")
    span, cols = base.shape
    full, rank = w1.shape
    if vocab is None and cols != full:
        raise ValueError(f"markov_greedy: {cols} logit columns for a {full}-token vocabulary and no vocab map")
    if vocab is not None and (vocab.dtype != torch.int64 or not vocab.is_contiguous() or vocab.shape != (cols,)):
        raise ValueError(f"markov_greedy: vocab must be a contiguous int64 ({cols},) tensor")
    for t, shape in ((w1, (full, rank)), (w2t, (rank, cols))):
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
            raise ValueError(f"markov_greedy: expected a contiguous fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if base.dtype != torch.float32 or base.stride(-1) != 1:
        raise ValueError("markov_greedy: block logits must be fp32 with contiguous rows")
    out = torch.empty(span, dtype=torch.int64)
    rc = lib.vs_markov_greedy(base.data_ptr(), span, base.stride(0), cols, w1.data_ptr(), full, w2t.data_ptr(),
                              rank, anchor, None if vocab is None else vocab.data_ptr(), out.data_ptr(),
                              torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"markov_greedy: anchor or token out of range (vocabulary {full}) or out of memory")
    return out.tolist()


def attention_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attention` takes these tensors (fp32 CPU, rows contiguous, k and v in one layout, head_dim a
    multiple of 8 up to 256, no gradient wanted) and the kernel is available."""
    d = q.shape[-1]
    return (
        q.dtype == k.dtype == v.dtype == torch.float32
        and q.device.type == "cpu" and k.device.type == "cpu"
        and d % 8 == 0 and d <= 256
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and k.stride() == v.stride()
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and available()
    )


def attention(
    q: torch.Tensor,  # [B, H, T, D] (any strides with contiguous rows)
    k: torch.Tensor,  # [B, Hkv, S, D], v the same, in one layout (a cache's view)
    v: torch.Tensor,
    causal: bool,  # query t sees keys s <= S - T + t (the new tokens after S - T cached ones); else every key
    tree: tuple[torch.Tensor, torch.Tensor] | None = None,  # tree_rows(mask, seen): that mask instead
) -> torch.Tensor:  # [B, H, T, D], a view of a contiguous [B, T, H, D]
    """softmax(q k^T / sqrt(D)) v with grouped-query heads (H / Hkv queries per key/value head), fp32."""
    lib = _required()
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or not attention_supported(q, k, v):
        raise ValueError("native attention: q [B, H, T, D], k and v [B, Hkv, S, D] in one layout, CPU fp32, rows "
                         "contiguous, D a multiple of 8 up to 256, no gradient")
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or h % hkv or (causal and t > s):
        raise ValueError(f"native attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)} (causal={causal})")
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    args = (q.data_ptr(), b, t, h, d, q.stride(0), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(), hkv, s,
            k.stride(0), k.stride(1), k.stride(2), out.data_ptr())
    if tree is not None:  # tails [T, W] list keys among the last W: every query sees the S - W before them
        tails, ntail = tree
        w = tails.shape[-1]
        if (tails.shape != (t, w) or not t <= w <= s or ntail.shape != (t,) or tails.dtype != torch.int64
                or ntail.dtype != torch.int64 or not (tails.is_contiguous() and ntail.is_contiguous())):
            raise ValueError(f"native attention: a tree's rows must be int64 tails [{t}, W >= {t}] and counts [{t}]")
        rc = lib.vs_attention_tree(*args, s - w, tails.data_ptr(), ntail.data_ptr(), w, d**-0.5,
                                   torch.get_num_threads())
    else:
        rc = lib.vs_attention(*args, s - t if causal else -1, d**-0.5, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"native attention failed ({rc}): heads {h}/{hkv}, head_dim {d}")
    return out.transpose(1, 2)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d] fp32 -> [..., d] fp32
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, as model.layers.RMSNorm in fp32 (up to summation
    order), in one call (blocklayer.c)."""
    lib = _required()
    d = x.shape[-1]
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != (d,)
            or x.device.type != "cpu" or weight.device.type != "cpu"):
        raise ValueError("native rmsnorm: fp32 x [..., d] and fp32 weight [d] expected")
    x = x.contiguous()
    w = weight.detach().contiguous()
    y = torch.empty_like(x)
    lib.vs_rmsnorm(x.data_ptr(), x.numel() // d if d else 0, d, w.data_ptr(), eps, y.data_ptr())
    return y


class BlockLayerArgs:
    """One block drafter layer's fixed arguments to blocklayer.c (its norms, eps, packed weights and dims), checked
    and described once: a proposal calls each layer every round, and checking and describing these on every call
    was ~25 us of Python a layer. The holder (model/block.py) remakes it when a weight or norm changes."""

    def __init__(
        self,
        norms: tuple[torch.Tensor, ...],  # fp32 input_layernorm [d], post_attention_layernorm [d], q_norm, k_norm [D]
        eps: float,
        weights: tuple[Packed | QPacked, ...],  # qkv, o_proj, gate_up, down_proj: pack()ed (bf16 or fp32) or qpack()ed
        dims: tuple[int, int, int, int],  # H, Hkv, D, F (the MLP's intermediate size)
    ) -> None:
        h, hkv, hd, ffn = dims
        d = norms[0].shape[0] if norms and norms[0].dim() == 1 else -1
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in norms) \
                or tuple(t.shape for t in norms) != ((d,), (d,), (hd,), (hd,)):
            raise ValueError("native block layers: norms must be contiguous fp32 [d], [d], [D], [D]")
        want = ((d, (h + 2 * hkv) * hd), (h * hd, d), (d, 2 * ffn), (ffn, d))
        if tuple((p.k, p.n) for p in weights) != want:
            raise ValueError(f"native block layers: packed weights (in, out) {[(p.k, p.n) for p in weights]}, "
                             f"expected {list(want)}")
        for p in weights:
            if isinstance(p, QPacked):
                _check_qpacked(p, "block layer")
        self.norms, self.weights = norms, weights  # held: the kernel reads them through the pointers below
        self.norm_ptrs = tuple(t.data_ptr() for t in norms)
        self.eps, self.dims, self.d = eps, dims, d
        self.descs = (WeightDesc * 4)(*(WeightDesc.of(p) for p in weights))
        self.qlin = _qlinear_address() if any(isinstance(p, QPacked) for p in weights) else None


def block_layer(
    x: torch.Tensor,  # [G, d] fp32 contiguous: the block's residual stream, updated in place
    ctx: torch.Tensor | None,  # [n, d] fp32 contiguous context features (written to the cache first), or None
    layer: BlockLayerArgs,
    rope: tuple[torch.Tensor, torch.Tensor],  # fp32 cos, signed sin [n + G, D] for the rows' positions, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # this layer's cache k, v [Hkv, S_max, D] fp32, rows contiguous
    start: int,  # cached positions: the rows go to start .. start + n + G - 1
    mm_bf16: bool = False,  # round matmul inputs to bf16 (bf16 weights then take the vdpbf16ps path)
) -> None:
    """A block drafter layer (model/block.py) for one sequence in one native call: block_layers with one."""
    block_layers(x, ctx, [0 if ctx is None else ctx.shape[0]], layer, rope, [kv], [start], mm_bf16)


def block_layers(
    x: torch.Tensor,  # [B * G, d] fp32 contiguous: B sequences' block rows back to back, updated in place
    ctx: torch.Tensor | None,  # [sum(ns), d] fp32 contiguous: each sequence's new context features in turn, or None
    ns: list[int],  # per sequence: its new context rows (written to its cache before its block's)
    layer: BlockLayerArgs,
    rope: tuple[torch.Tensor, torch.Tensor],  # fp32 cos, signed sin [sum(ns) + B * G, D]: per sequence its n + G rows
    kvs: list[tuple[torch.Tensor, torch.Tensor]],  # per sequence this layer's cache k, v [Hkv, S_max, D] fp32
    starts: list[int],  # per sequence: cached positions (its rows go to start .. start + n + G - 1)
    mm_bf16: bool = False,
) -> None:
    """block_layer for B sequences in one native call: the matmuls over every sequence's rows at once, attention
    per sequence over its own cache (blocklayer.c's vs_block_layer_batch)."""
    lib = _required()
    b = len(ns)
    d = x.shape[1]
    h, hkv, hd, ffn = layer.dims
    cos, sin = rope
    if not b or len(kvs) != b or len(starts) != b or x.shape[0] % b or any(n < 0 for n in ns) or d != layer.d:
        raise ValueError("native block layers: one cache, start and context count per sequence, B * G block rows "
                         "of the layer's width")
    g = x.shape[0] // b
    ntot = sum(ns)
    dense = [x, cos, sin] + ([] if ctx is None else [ctx])
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in dense) \
            or cos.shape != (ntot + b * g, hd) or sin.shape != cos.shape \
            or (ctx is None) != (ntot == 0) or (ctx is not None and ctx.shape != (ntot, d)):
        raise ValueError("native block layers: x, ctx and rope tables must be contiguous fp32, ctx [sum(ns), d], "
                         "rope [sum(ns) + B * G, D]")
    for (k, v), n, start in zip(kvs, ns, starts):
        for t in (k, v):
            _cpu(t, "block layer cache")
        if (k.stride() != v.stride() or k.shape != v.shape or k.dim() != 3 or k.shape[0] != hkv or k.shape[2] != hd
                or k.stride(-1) != 1 or k.stride(1) < hd or start < 0 or start + n + g > k.shape[1]):
            raise ValueError("native block layers: a cache's rows do not fit or its k and v differ in layout")
    i64s = ctypes.c_int64 * b
    ptrs = ctypes.c_void_p * b
    rc = lib.vs_block_layer_batch(
        x.data_ptr(), b, g, d, None if ctx is None else ctx.data_ptr(), i64s(*ns), *layer.norm_ptrs, layer.eps,
        layer.descs, layer.qlin, ffn, h, hkv, hd, cos.data_ptr(), sin.data_ptr(), ptrs(*(k.data_ptr() for k, _ in kvs)),
        ptrs(*(v.data_ptr() for _, v in kvs)), i64s(*(k.stride(0) for k, _ in kvs)),
        i64s(*(k.stride(1) for k, _ in kvs)), i64s(*starts), mm_bf16, torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"native block layers failed ({rc})")


# ---- the target's forward in one call (decoder.c) -----------------------------------------------------------------

class WeightDesc(ctypes.Structure):  # decoder.c's vs_weight
    _fields_ = [("data", ctypes.c_void_p), ("bf16", ctypes.c_int32), ("bits", ctypes.c_int32),
                ("group", ctypes.c_int64), ("act_bits", ctypes.c_int32)]

    @classmethod
    def of(cls, p: Packed | QPacked) -> WeightDesc:
        if isinstance(p, QPacked):
            return cls(p.data.data_ptr(), 0, p.bits, p.group, p.act_bits)
        return cls(p.data.data_ptr(), p.bf16, 0, 0, 16)


class LayerDesc(ctypes.Structure):  # decoder.c's vs_layer
    _fields_ = [("qkv", WeightDesc), ("o", WeightDesc), ("gate_up", WeightDesc), ("down", WeightDesc),
                ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p), ("ln1", ctypes.c_void_p),
                ("ln2", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class ModelDesc(ctypes.Structure):  # decoder.c's vs_model
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "d", "heads", "kv_heads", "head_dim", "ffn", "vocab",
                                                     "max_pos")] + [
        ("eps", ctypes.c_float), ("act_bf16", ctypes.c_int32), ("embed", ctypes.c_void_p),
        ("embed_bf16", ctypes.c_int32), ("final_norm", ctypes.c_void_p), ("lm_head", WeightDesc),
        ("head_rows", ctypes.c_int64), ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p), ("layer", ctypes.POINTER(LayerDesc)), ("enorm", ctypes.c_void_p),
        ("fnorm", ctypes.c_void_p), ("w_in", WeightDesc)]


class SeqDesc(ctypes.Structure):  # decoder.c's vs_seq
    _fields_ = [("rows", ctypes.c_int64), ("cached", ctypes.c_int64), ("first", ctypes.c_int64),
                ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("layer_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64), ("capacity", ctypes.c_int64),
                ("pos", ctypes.c_void_p), ("tails", ctypes.c_void_p), ("ntail", ctypes.c_void_p),
                ("seen", ctypes.c_int64), ("tail_stride", ctypes.c_int64), ("kv_bf16", ctypes.c_int64)]


def tree_rows(mask: torch.Tensor, seen: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native kernels' form of a non-causal mask over T new rows ([T, S] bool, True = attend, a draft tree's;
    the new rows are the last T of the S): (tails [T, S - seen] int64, the cache rows each new row sees past the
    first `seen`, ascending, padded; ntail [T] int64, how many). None where the kernels cannot honour it: a row that
    does not see every one of the first `seen` entries."""
    t = mask.shape[0]
    if mask.dim() != 2 or not 0 <= seen <= mask.shape[1] - t or not bool(mask[:, :seen].all()):
        return None
    extra = mask[:, seen:].cpu()
    w = extra.shape[1]
    idx = torch.arange(w).expand(t, w)
    tails = torch.sort(torch.where(extra, idx, w), dim=1).values.clamp_max_(w - 1) + seen  # visible rows first
    return tails.contiguous(), extra.sum(1).to(torch.int64)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """A layer's matmuls, each dense (pack()) or weight-only int8/int4 (qpack()), given as (out, in)."""

    qkv: Packed | QPacked  # [(H + 2 Hkv) D, d]
    o: Packed | QPacked  # [d, H D]
    gate_up: Packed | QPacked  # [2 F, d]
    down: Packed | QPacked  # [d, F]
    ln1: torch.Tensor  # fp32 [d]
    ln2: torch.Tensor  # fp32 [d]
    qkv_bias: torch.Tensor | None = None  # pad_bias()ed
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # fp32 [D], both or neither
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class InputStage:
    """A feature drafter's input stage (model/feature.py): row r's input is w_in [enorm(E[x_r]) ; fnorm(f_r)]."""

    enorm: torch.Tensor  # fp32 [d]
    fnorm: torch.Tensor  # fp32 [d]
    w_in: Packed | QPacked  # [d, 2 d]


@dataclass(frozen=True)
class BoundCache:
    """One sequence's KV cache described for decoder.c once (Decoder.bind): its descriptor (rows, cached and first
    set per call, on a copy), its capacity, and the tensors it points at, kept alive with it."""

    desc: SeqDesc
    capacity: int
    tensors: tuple[torch.Tensor, torch.Tensor]  # k, v


class Decoder:
    """A decoder's weights described for decoder.c, checked once here (dtypes, devices, contiguity, every packed
    shape against the dimensions); keeps a reference to every tensor it points at. The activations are in `dtype`
    (default: the embedding's); the LM head may have fewer rows than the vocabulary (a draft vocabulary)."""

    def __init__(self, dims: tuple[int, int, int, int, int, int], eps: float, embed: torch.Tensor,
                 layers: list[DecoderLayerWeights], final_norm: torch.Tensor, lm_head: Packed | QPacked,
                 rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype | None = None,
                 input_stage: InputStage | None = None) -> None:
        d, h, hkv, hd, ffn, vocab = dims
        cos, sin = rope
        dtype = embed.dtype if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"native decoder: activations in fp32 or bf16, got {dtype}")
        _cpu(embed, "decoder embedding", (torch.float32, torch.bfloat16))
        if embed.shape != (vocab, d) or not embed.is_contiguous():
            raise ValueError(f"native decoder: embedding must be a contiguous [{vocab}, {d}]")
        if h % hkv or hd % 8 or hd > 256 or not layers:
            raise ValueError(f"native decoder: unsupported heads {h}/{hkv} or head_dim {hd}")
        for t in (final_norm, cos, sin):
            _cpu(t, "decoder norm/rope")
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != hd or not (cos.is_contiguous()
                                                                                 and sin.is_contiguous()):
            raise ValueError(f"native decoder: rope tables must be contiguous fp32 [positions, {hd}]")
        shapes = {"qkv": (d, (h + 2 * hkv) * hd), "o": (h * hd, d), "gate_up": (d, 2 * ffn), "down": (ffn, d)}
        descs = []
        for i, lw in enumerate(layers):
            for name, want in shapes.items():
                p = getattr(lw, name)
                if (p.k, p.n) != want:
                    raise ValueError(f"native decoder: layer {i} {name} takes (in, out) {(p.k, p.n)}, expected {want}")
                if isinstance(p, QPacked):
                    _check_qpacked(p, f"decoder layer {i} {name}")
            _check_bias(lw.qkv_bias, shapes["qkv"][1], "decoder qkv bias")
            _check_bias(lw.o_bias, d, "decoder o bias")
            norms = [(lw.ln1, d), (lw.ln2, d)] + [(t, hd) for t in (lw.q_norm, lw.k_norm) if t is not None]
            if (lw.q_norm is None) != (lw.k_norm is None) or any(
                    t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != (n,) or not t.is_contiguous()
                    for t, n in norms):
                raise ValueError(f"native decoder: layer {i} norms must be contiguous fp32 [d] (and [D] for q/k)")
            descs.append(LayerDesc(*(WeightDesc.of(getattr(lw, name)) for name in shapes), _ptr(lw.qkv_bias),
                                   _ptr(lw.o_bias), _ptr(lw.ln1), _ptr(lw.ln2), _ptr(lw.q_norm), _ptr(lw.k_norm)))
        if final_norm.shape != (d,) or lm_head.k != d or not 0 < lm_head.n <= vocab:
            raise ValueError("native decoder: final norm [d] and LM head [rows <= vocab, d] expected")
        if isinstance(lm_head, QPacked):
            _check_qpacked(lm_head, "decoder LM head")
        stage = (None, None, WeightDesc())
        if input_stage is not None:
            w_in = input_stage.w_in
            if (w_in.k, w_in.n) != (2 * d, d) or any(
                    t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != (d,) or not t.is_contiguous()
                    for t in (input_stage.enorm, input_stage.fnorm)):
                raise ValueError(f"native decoder: input stage needs fp32 norms [{d}] and w_in [{d}, {2 * d}]")
            if isinstance(w_in, QPacked):
                _check_qpacked(w_in, "decoder input stage")
            stage = (input_stage.enorm.data_ptr(), input_stage.fnorm.data_ptr(), WeightDesc.of(w_in))
        self._keep = (embed, layers, final_norm, lm_head, cos, sin, input_stage)
        self._layers = (LayerDesc * len(descs))(*descs)
        self.desc = ModelDesc(len(layers), d, h, hkv, hd, ffn, vocab, cos.shape[0], eps,
                              dtype == torch.bfloat16, embed.data_ptr(), embed.dtype == torch.bfloat16,
                              final_norm.data_ptr(), WeightDesc.of(lm_head), lm_head.n, cos.data_ptr(),
                              sin.data_ptr(), self._layers, *stage)
        self.dtype, self.staged = dtype, input_stage is not None
        # int weights: qgemm.c's library, built now (a failure raises here, not in a forward)
        self.quantized = any(isinstance(getattr(lw, name), QPacked) for lw in layers for name in shapes) or (
            input_stage is not None and isinstance(input_stage.w_in, QPacked)) or isinstance(lm_head, QPacked)
        if self.quantized:
            _qlinear_address()
        self.num_layers, self.kv_heads, self.head_dim, self.vocab, self.d = len(layers), hkv, hd, vocab, d
        self.head_rows = lm_head.n

    def forward(
        self,
        tokens: torch.Tensor,  # [N] int64: every sequence's new tokens, back to back
        # per sequence: k, v [L, Hkv, S, D] fp32 (or bf16 for a bf16 model: its keys and values are bf16 values),
        # cached, rows[, first position (default cached)[, tree]], where tree
        # is a draft tree's (positions [rows], *tree_rows(mask, seen)) or None for causal rows
        caches: list[tuple],
        logit_rows: torch.Tensor,  # [M] int64 rows of `tokens` that need logits
        hidden_layers: tuple[int, ...] = (),  # 0 = the embedding (or input stage), l = decoder layer l's output
        feats: torch.Tensor | None = None,  # [N, d] fp32: the input stage's features (exactly where it has one)
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [M, head rows], {layer: [N, d]}, model's dtype
        """Every sequence's rows after its cache's `cached` entries, written to the cache (the caller commits)."""
        n = self._check_inputs(tokens, logit_rows, feats)
        seqs = (SeqDesc * max(1, len(caches)))()
        rows = 0
        trees = []  # kept alive until the call returns
        for i, (k, v, cached, count, *rest) in enumerate(caches):
            first = rest[0] if rest else cached
            tree = rest[1] if len(rest) > 1 else None
            self._check_cache(i, k, v)
            self._check_rows(i, cached, count, first, k.shape[2])
            ptrs = (None, None, None, 0, 0)
            if tree is not None:  # tails [rows, W] (tree_rows of a mask over cached + rows columns): the last W
                pos, tails, ntail = (x.to(torch.int64).contiguous() for x in tree)
                w = tails.shape[-1]
                if (pos.shape != (count,) or tails.shape != (count, w) or ntail.shape != (count,)
                        or not count <= w <= cached + count):
                    raise ValueError(f"native decoder: sequence {i}'s tree must give positions [{count}], tails "
                                     f"[{count}, W] with {count} <= W <= {cached + count} and counts [{count}]")
                trees.append((pos, tails, ntail))
                ptrs = (pos.data_ptr(), tails.data_ptr(), ntail.data_ptr(), cached + count - w, w)
            seqs[i] = SeqDesc(count, cached, first, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.shape[2],
                              *ptrs, k.dtype == torch.bfloat16)
            rows += count
        if rows != n:
            raise ValueError(f"native decoder: the caches take {rows} rows, {n} tokens given")
        return self._run(tokens, n, seqs, len(caches), logit_rows, hidden_layers, feats)

    def bind(self, k: torch.Tensor, v: torch.Tensor) -> BoundCache:
        """One sequence's cache k, v [L, Hkv, S, D] checked once (as forward checks each call) for forward_bound."""
        self._check_cache(0, k, v)
        desc = SeqDesc(0, 0, 0, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.shape[2], None, None, None,
                       0, 0, k.dtype == torch.bfloat16)
        return BoundCache(desc, k.shape[2], (k, v))

    def forward_bound(
        self,
        tokens: torch.Tensor,  # [N] int64: every sequence's new tokens, back to back
        seqs: list[tuple[BoundCache, int, int, int]],  # per sequence: its cache (bind()'s), cached, rows, first
        logit_rows: torch.Tensor,  # [M] int64
        hidden_layers: tuple[int, ...] = (),
        feats: torch.Tensor | None = None,  # [N, d] fp32: the input stage's features (exactly where it has one)
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """forward() of causal rows over bound caches: a decode or verify step without re-checking each cache's
        layout every call (this Python ran at 3-5x its warm cost right after a forward's kernels had run). The
        bindings, which `seqs` holds through the call, keep the caches' tensors alive."""
        n = self._check_inputs(tokens, logit_rows, feats)
        rows = 0
        for i, (bound, cached, count, first) in enumerate(seqs):
            self._check_rows(i, cached, count, first, bound.capacity)
            rows += count
        if rows != n:
            raise ValueError(f"native decoder: the caches take {rows} rows, {n} tokens given")
        descs = (SeqDesc * len(seqs))()  # copies: a binding's own descriptor is never written
        for i, (bound, cached, count, first) in enumerate(seqs):
            descs[i] = bound.desc
            descs[i].rows, descs[i].cached, descs[i].first = count, cached, first
        return self._run(tokens, n, descs, len(seqs), logit_rows, hidden_layers, feats)

    def _check_inputs(self, tokens: torch.Tensor, logit_rows: torch.Tensor, feats: torch.Tensor | None) -> int:
        if (tokens.dtype != torch.int64 or tokens.dim() != 1 or not tokens.is_contiguous()
                or tokens.device.type != "cpu"):
            raise ValueError("native decoder: tokens must be a contiguous CPU int64 [N]")
        n = tokens.shape[0]  # token ids and logit rows are range-checked in C (-3, -4), before anything is written
        if (feats is not None) != self.staged:
            raise ValueError("native decoder: features go with an input stage, and only there")
        if feats is not None:
            _cpu(feats, "decoder features")
            if feats.shape != (n, self.d) or not feats.is_contiguous():
                raise ValueError(f"native decoder: features must be a contiguous fp32 [{n}, {self.d}]")
        if logit_rows.dtype != torch.int64 or not logit_rows.is_contiguous() or logit_rows.dim() != 1:
            raise ValueError(f"native decoder: logit rows must be a contiguous int64 [M] in [0, {n})")
        return n

    def _check_cache(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # a bf16 cache holds an fp32 model's keys rounded: only a bf16 model's (bf16 values) go there
        kv_dtypes = (torch.float32, torch.bfloat16) if self.dtype == torch.bfloat16 else (torch.float32,)
        for t in (k, v):
            _cpu(t, "decoder cache", kv_dtypes)
        shape = (self.num_layers, self.kv_heads)
        if (k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or tuple(k.shape[:2]) != shape
                or k.shape[3] != self.head_dim or k.stride(3) != 1 or k.stride(2) != self.head_dim):
            raise ValueError(f"native decoder: cache {i} must be {' or '.join(map(str, kv_dtypes))} [{shape[0]}, "
                             f"{shape[1]}, S, {self.head_dim}] with contiguous rows, k and v in one layout")

    def _check_rows(self, i: int, cached: int, count: int, first: int, capacity: int) -> None:
        if cached < 0 or count < 0 or cached + count > capacity:
            raise ValueError(f"KV cache overflow: {cached + count} positions > capacity {capacity}")
        if first < cached:
            raise ValueError(f"native decoder: cache {i}'s first position {first} is below its {cached} rows")
        if first + count > self.desc.max_pos:
            raise ValueError(f"native decoder: position {first + count - 1} past the RoPE table")

    def _run(self, tokens: torch.Tensor, n: int, seqs: ctypes.Array, nseq: int, logit_rows: torch.Tensor,
             hidden_layers: tuple[int, ...], feats: torch.Tensor | None,
             ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        lib = _required()
        hidden = {layer: torch.empty(n, self.d, dtype=self.dtype) for layer in hidden_layers}
        if any(not 0 <= layer <= self.num_layers for layer in hidden):
            raise ValueError(f"native decoder: hidden layers lie in [0, {self.num_layers}]")
        outs = (ctypes.c_void_p * (self.num_layers + 1))(
            *(hidden[i].data_ptr() if i in hidden else None for i in range(self.num_layers + 1)))
        logits = torch.empty(logit_rows.numel(), self.head_rows, dtype=self.dtype)
        if n == 0:
            if logit_rows.numel():
                raise ValueError("native decoder: logit rows must be a contiguous int64 [M] in [0, 0)")
            return logits, hidden
        rc = lib.vs_decoder_forward(ctypes.byref(self.desc), tokens.data_ptr(), _ptr(feats), n, seqs, nseq, outs,
                                    logit_rows.data_ptr(), logit_rows.numel(), logits.data_ptr(),
                                    torch.get_num_threads(), _qlinear_address() if self.quantized else None)
        if rc == -1:
            raise MemoryError("native decoder: out of memory")
        if rc == -3:
            raise ValueError(f"native decoder: token ids must lie in [0, {self.vocab})")
        if rc == -4:
            raise ValueError(f"native decoder: logit rows must be a contiguous int64 [M] in [0, {n})")
        if rc != 0:
            raise ValueError(f"native decoder failed ({rc})")
        return logits, hidden
