"""Building blocks of the Llama/Qwen/Mistral decoder: RMSNorm, RoPE, attention, SwiGLU MLP.

Module and parameter names follow Hugging Face transformers, so checkpoints map one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from verispec.cache.packed import PackedBatch
from verispec.config import ModelConfig
from verispec.errors import ConfigError
from verispec.kernels import native
from verispec.model.packing import PackedLinear, PackedWeight, linear, pack
from verispec.quant.linear import QuantLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as the reference implementation does.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def native_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """norm(x), in one native call at inference on CPU in fp32 (about ten small torch ops otherwise, ~25 us a row);
    the torch module elsewhere (training, other dtypes and devices). The two agree to summation order."""
    if (x.dtype == norm.weight.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and native.available()):
        return native.rmsnorm(x, norm.weight, norm.eps)
    return norm(x)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:  # [head_dim / 2]
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context limit, computed once in fp32.

    The sin table carries the sign of the rotation (-sin on the first half), so applying RoPE is a flip of the
    two halves and two multiplies: fewer small ops, which dominate a decode step on CPU.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(cfg))  # [T_max, D/2]
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, signed sin [B, T, 1, D] (broadcast over heads)
        return self.cos[positions].to(dtype)[:, :, None], self.sin[positions].to(dtype)[:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, T, H, D]
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] folded into the signed sin table."""
    return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input into one matrix, and re-point
    each linear's parameters at views of it: one matmul instead of several, no extra memory, and the
    state dict keeps its Hugging Face names."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Set by fuse(); buffers so that .to() moves them (after a move they are copies, still correct).
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_packed: PackedWeight | None = None  # set by pack()
        self.qkv_quant: QuantLinear | None = None  # set by fuse() where the projections are quantized

    def fuse(self) -> None:
        if isinstance(self.q_proj, QuantLinear):  # a quantized checkpoint: fused as one QuantLinear (no .weight)
            self.qkv_quant = QuantLinear.concat([self.q_proj, self.k_proj, self.v_proj])
            return
        self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def pack(self) -> None:
        """Inference only, after fuse(): the matmuls this layer runs use packed weights (see model.packing).
        QuantLinears pack themselves on first use."""
        self.qkv_packed = pack(self.qkv_weight)
        if not isinstance(self.o_proj, QuantLinear):  # a PackedLinear too: packing again after .to() repacks
            self.o_proj = PackedLinear(self.o_proj)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, d]
        cos: torch.Tensor,  # [B, T, 1, D]
        sin: torch.Tensor,
        cache,  # KVCache | PackedBatch | None
        mask: torch.Tensor | None,  # [T, S] bool (True = attend) or None for "causal from position 0"
        causal: bool = True,  # False: `mask` is any other pattern (a draft tree's), never taken for a causal one
    ) -> torch.Tensor:  # [B, T, d]
        bsz, seqlen, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)  # [B, H, T, D]
        if isinstance(cache, PackedBatch):  # B == 1: each segment attends to its own cache with its own mask
            out = torch.cat([
                self._attend(q[:, :, s.start : s.start + s.length], k[:, :, s.start : s.start + s.length],
                             v[:, :, s.start : s.start + s.length], s.cache, m, c)
                for s, m, c in zip(cache.segments, cache.masks, cache.causal)
            ], dim=2)
        else:
            out = self._attend(q, k, v, cache, mask, causal)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def _qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bsz, seqlen, _ = x.shape
        nq, nkv = self.num_heads, self.num_kv_heads
        if self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
            qkv = qkv.view(bsz, seqlen, nq + 2 * nkv, self.head_dim)
        elif self.qkv_quant is not None:
            qkv = self.qkv_quant(x).view(bsz, seqlen, nq + 2 * nkv, self.head_dim)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).view(
                bsz, seqlen, nq + 2 * nkv, self.head_dim
            )
        v = qkv[:, :, nq + nkv :]
        if self.q_norm is not None:
            q = apply_rope(self.q_norm(qkv[:, :, :nq]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, :, nq : nq + nkv]), cos, sin)
        else:
            qk = apply_rope(qkv[:, :, : nq + nkv], cos, sin)  # one RoPE for queries and keys together
            q, k = qk[:, :, :nq], qk[:, :, nq:]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q, k, v, cache, mask, causal: bool = True) -> torch.Tensor:  # q [B, H, T, D] -> [B, H, T, D]
        dtype = q.dtype
        if cache is not None:
            k, v = cache.write(self.layer_idx, k, v)  # [B, Hkv, S, D] with S = cached + T, in the cache's dtype
            if k.dtype == torch.bfloat16 and k.device.type == "cpu":  # a bf16 cache (KVCache.for_model): fp32 maths
                k, v = k.float(), v.float()
            q = q.to(k.dtype)
        if not causal and mask is None:
            raise ValueError("a non-causal attention needs its mask")
        if native.attention_supported(q, k, v):
            if causal:
                return native.attention(q, k, v, causal=True).to(dtype)
            # a draft tree's mask, natively where every row sees the whole cache (native.tree_rows), else SDPA
            tree = native.tree_rows(mask, k.shape[2] - q.shape[2]) if mask.dim() == 2 else None
            if tree is not None:
                return native.attention(q, k, v, causal=False, tree=tree).to(dtype)
        gqa = self.num_heads != self.num_kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse()
        self.gate_up_packed: PackedWeight | None = None  # set by pack()
        self.gate_up_quant: QuantLinear | None = None  # set by fuse() where the projections are quantized

    def fuse(self) -> None:
        if isinstance(self.gate_proj, QuantLinear):
            self.gate_up_quant = QuantLinear.concat([self.gate_proj, self.up_proj])
            return
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)[0]

    def pack(self) -> None:
        """Inference only, after fuse(): the matmuls this MLP runs use packed weights (see model.packing)."""
        self.gate_up_packed = pack(self.gate_up_weight)
        if not isinstance(self.down_proj, QuantLinear):  # a PackedLinear too: packing again after .to() repacks
            self.down_proj = PackedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight, None, self.gate_up_packed).chunk(2, dim=-1)
        elif self.gate_up_quant is not None:
            gate, up = self.gate_up_quant(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, mask, causal: bool = True) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, causal)
        return x + self.mlp(self.post_attention_layernorm(x))
