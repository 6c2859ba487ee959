"""verispec's own CPU kernels, compiled on first use and called through ctypes: the matmul of inference
(`gemm.c`), attention of a few queries over a KV cache (`attention.c`), the greedy DSpark head loop
(`markov.c`), a block drafter's layer in one call (`blocklayer.c`, built on the first two) and the greedy argmax
of logits (`argmax.c`). The matmul and attention compute a row (a token, a query) in one fixed order whatever else
is in the call, so a verify step over 9 tokens gives each token what a one-token step gives it.

The kernels are plain C files built with the system C compiler (`$CC`, else `cc`) into the user cache, one
shared library per source hash; no torch headers, so a build takes about a second. It links OpenMP by its soname,
which resolves to the libgomp torch has already loaded: the kernel and torch share one thread pool instead of
two pools spinning against each other. Where it cannot be used (no AVX2/FMA, no compiler, a failed build,
`VERISPEC_NATIVE=0`) `library()` returns None once and for all, with one warning naming the cause, and callers
keep torch's matmuls.
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
from pathlib import Path

import torch

from verispec.paths import user_cache

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("gemm.c", "attention.c", "markov.c", "blocklayer.c", "argmax.c"))
COLS = 8  # columns per packed block (one AVX2 vector of fp32)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, once decided


def _cpu_ok() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
        os.replace(tmp, out)  # atomic: a concurrent process sees the old file or the new one, never half of one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("VERISPEC_NATIVE", "1") == "0":
        return None
    if not _cpu_ok():
        return None
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = user_cache("kernels") / f"verispec-{digest}.so"
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"verispec: native matmul kernel unavailable ({e}); using torch's matmuls", stacklevel=3)
        return None
    f = lib.vs_linear
    f.restype = ctypes.c_int
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    f.argtypes = [ptr, cint, i64, i64, i64, ptr, cint, ptr, i64, ptr, cint, cint]
    a = lib.vs_attention
    a.restype = ctypes.c_int
    a.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64,
                  ctypes.c_float, cint]
    g = lib.vs_markov_greedy
    g.restype = ctypes.c_int
    g.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, ptr, cint]
    m = lib.vs_argmax
    m.restype = cint
    m.argtypes = [ptr, cint, i64, i64, i64, ptr]
    r = lib.vs_rmsnorm
    r.restype = None
    r.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
    b = lib.vs_block_layer
    b.restype = ctypes.c_int
    b.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ctypes.c_float, ptr, cint, ptr, cint, ptr, cint,
                  ptr, cint, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, cint]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be used (decided once per process)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    return library() is not None


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("verispec native kernels are unavailable here: check available() first")
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [ceil(N / 16) * 2, K, 8], same dtype
    """The kernel's layout: blocks of 8 output columns, each block's K rows of 8 contiguous, N padded to 16."""
    n, k = weight.shape
    n16 = -(-n // 16) * 16
    padded = weight.new_zeros(n16, k)
    padded[:n] = weight
    return padded.view(n16 // COLS, COLS, k).transpose(1, 2).contiguous()


def pad_bias(bias: torch.Tensor) -> torch.Tensor:  # [N] -> fp32 [ceil(N / 16) * 16]
    n16 = -(-bias.shape[0] // 16) * 16
    out = torch.zeros(n16, dtype=torch.float32)
    out[: bias.shape[0]] = bias.float()
    return out


def linear(
    x: torch.Tensor,  # [..., K] fp32 or bf16, CPU, last dim contiguous
    packed: torch.Tensor,  # pack(weight), fp32 or bf16
    n: int,  # output features
    bias: torch.Tensor | None = None,  # pad_bias(b)
) -> torch.Tensor:  # [..., N] in x's dtype
    """y = x @ W^T (+ b) with fp32 accumulation. Each output row is computed in one fixed order whatever the
    number of rows or threads (see gemm.c), so a row's result never depends on the rest of the batch."""
    lib = _required()
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    bf16 = torch.bfloat16
    rc = lib.vs_linear(
        x2.data_ptr(), x.dtype == bf16, m, k, x2.stride(0) if m > 1 else k, packed.data_ptr(), packed.dtype == bf16,
        None if bias is None else bias.data_ptr(), n, y.data_ptr(), x.dtype == bf16, torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("native matmul: out of memory")
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] fp32 or bf16, CPU, last dim contiguous -> [R] int64
    """torch.argmax(x, dim=-1) by the same rule (first maximum; a NaN wins), vectorised (see argmax.c)."""
    lib = _required()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.vs_argmax(x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def markov_greedy(
    base: torch.Tensor,  # [span, V] fp32 block logits U, rows contiguous (V: the draft vocabulary's size)
    w1: torch.Tensor,  # [V1, r] fp32, contiguous (markov_in, a row per token of the full vocabulary)
    w2t: torch.Tensor,  # [r, V] fp32, contiguous (markov_out's weight, transposed; cut to the draft vocabulary)
    anchor: int,
    vocab: torch.Tensor | None = None,  # [V] int64 ascending token ids of the columns; None: all V1 == V tokens
) -> list[int]:  # span token ids
    """Greedy drafts of DSpark's Markov head: x_j = argmax(U_j + W2 W1[x_{j-1}]), x_0 = anchor (see markov.c)."""
    lib = _required()
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
) -> torch.Tensor:  # [B, H, T, D], a view of a contiguous [B, T, H, D]
    """softmax(q k^T / sqrt(D)) v with grouped-query heads (H / Hkv queries per key/value head), fp32."""
    lib = _required()
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    rc = lib.vs_attention(
        q.data_ptr(), b, t, h, d, q.stride(0), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(), hkv, s,
        k.stride(0), k.stride(1), k.stride(2), out.data_ptr(), s - t if causal else -1, d**-0.5,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"native attention failed ({rc}): heads {h}/{hkv}, head_dim {d}")
    return out.transpose(1, 2)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., d] fp32 -> [..., d] fp32
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, as model.layers.RMSNorm in fp32 (up to summation
    order), in one call (blocklayer.c)."""
    lib = _required()
    d = x.shape[-1]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != (d,):
        raise ValueError("native rmsnorm: fp32 x [..., d] and fp32 weight [d] expected")
    x = x.contiguous()
    w = weight.detach().contiguous()
    y = torch.empty_like(x)
    lib.vs_rmsnorm(x.data_ptr(), x.numel() // d if d else 0, d, w.data_ptr(), eps, y.data_ptr())
    return y


def block_layer(
    x: torch.Tensor,  # [G, d] fp32 contiguous: the block's residual stream, updated in place
    ctx: torch.Tensor | None,  # [n, d] fp32 contiguous context features (written to the cache first), or None
    norms: tuple[torch.Tensor, ...],  # fp32 input_layernorm [d], post_attention_layernorm [d], q_norm [D], k_norm [D]
    eps: float,
    weights: tuple[torch.Tensor, ...],  # pack()ed qkv, o_proj, gate_up, down_proj (bf16 or fp32 each)
    dims: tuple[int, int, int, int],  # H, Hkv, D, F (the MLP's intermediate size)
    rope: tuple[torch.Tensor, torch.Tensor],  # fp32 cos, signed sin [n + G, D] for the rows' positions, contiguous
    kv: tuple[torch.Tensor, torch.Tensor],  # this layer's cache k, v [Hkv, S_max, D] fp32, rows contiguous
    start: int,  # cached positions: the rows go to start .. start + n + G - 1
) -> None:
    """A block drafter layer (model/block.py) in one native call: see blocklayer.c."""
    lib = _required()
    g, d = x.shape
    n = 0 if ctx is None else ctx.shape[0]
    h, hkv, hd, ffn = dims
    k, v = kv
    cos, sin = rope
    dense = [x, *norms, cos, sin] + ([] if ctx is None else [ctx])
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in dense) or cos.shape != (n + g, hd):
        raise ValueError("native block layer: x, ctx, norms and rope tables must be contiguous fp32, rope [n + G, D]")
    if k.stride() != v.stride() or k.stride(-1) != 1 or start + n + g > k.shape[1]:
        raise ValueError("native block layer: the cache rows do not fit or k and v differ in layout")
    wq, wo, wgu, wd = weights
    bf16 = torch.bfloat16
    rc = lib.vs_block_layer(
        x.data_ptr(), g, d, None if ctx is None else ctx.data_ptr(), n, *(t.data_ptr() for t in norms), eps,
        wq.data_ptr(), wq.dtype == bf16, wo.data_ptr(), wo.dtype == bf16, wgu.data_ptr(), wgu.dtype == bf16,
        wd.data_ptr(), wd.dtype == bf16, ffn, h, hkv, hd, cos.data_ptr(), sin.data_ptr(), k.data_ptr(),
        v.data_ptr(), k.stride(0), k.stride(1), start, torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"native block layer failed ({rc})")
