"""Block drafters: one forward pass proposes a whole block (DFlash), optionally with DSpark's sequential head
and confidence head (algorithms.md §1.1-1.3, §3.1).

Context: the target's hidden states at a few layers, concatenated, projected (`fc`) and normalised, become keys
and values in every draft layer (through that layer's own k/v projections). The block input is
[anchor, MASK x (gamma - 1)] at positions anchor_pos + 0..gamma-1; attention inside the block is bidirectional and
sees every context position before the anchor. Slot k predicts the token at anchor_pos + k + 1. The target's
embedding and LM head are shared and frozen (not part of the drafter's weights).

Heads on top of the block logits U_k:
- none (parallel, DFlash): q_k = softmax(U_k), all positions independent.
- markov (DSpark): q_k = softmax(U_k + W2 W1[x_{k-1}]), x_0 = the anchor: sampled left to right, so each q_k
  is exact for the token actually drawn.
- rnn (DSpark's option): q_k = softmax(U_k + W2 tanh(o_k)), with [g_k; c_k; o_k] = A [s_{k-1}; W1[x_{k-1}]; h_k]
  and s_k = sigmoid(g_k) * s_{k-1} + (1 - sigmoid(g_k)) * tanh(c_k), s_0 = 0: a gated state carries the whole
  drafted prefix, not only x_{k-1}; sampled left to right like the Markov head.
- confidence (DSpark): c_k = sigmoid(w . [h_k ; W1[x_{k-1}]]), P(x_k accepted | x_1..x_{k-1} accepted), known
  before x_k is drawn. A parallel drafter may carry one too (the ablation compares heads under the same loss).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.cache import KVCache
from verispec.config import ModelConfig
from verispec.errors import ConfigError
from verispec.kernels import native
from verispec.model.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope, fuse_linears, native_norm
from verispec.model.packing import PackedLinear, PackedWeight, linear, pack, weight_version
from verispec.quant.linear import QuantLinear

SEQUENTIAL_HEADS = ("markov", "rnn")  # DSpark's heads, drafted left to right
HEADS = ("none", *SEQUENTIAL_HEADS)


@dataclass(frozen=True)
class BlockConfig:
    target_layers: tuple[int, ...]  # target hidden-state layers used as context (HF indexing; not the last)
    block_size: int = 8  # gamma
    num_layers: int = 2
    head: str = "none"  # none | markov | rnn
    markov_rank: int = 64
    confidence: bool = False
    mask_token_id: int = 3
    # Proposals see the latest W..2W context positions (W = context_window; 0: every position). A drafter
    # trained on W-token prompts and W-token continuations saw exactly that range, and attends worse over more.
    context_window: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(x) for x in self.target_layers))
        if self.head not in HEADS:
            raise ConfigError(f"block head must be one of {HEADS}, got {self.head!r}")
        if self.block_size < 1 or self.num_layers < 1 or not self.target_layers:
            raise ConfigError("block_size, num_layers and target_layers must be positive / non-empty")
        if self.context_window < 0:
            raise ConfigError(f"context_window must be >= 0 (0: the whole context), got {self.context_window}")

    def to_dict(self) -> dict:
        return {**asdict(self), "target_layers": list(self.target_layers)}


class _BlockLayer(nn.Module):
    """A pre-norm decoder layer whose attention also sees the projected context as keys/values."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nq, self.nkv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nq * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.nq * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.register_buffer("qkv_weight", None, persistent=False)  # set by fuse()
        self.qkv_packed: PackedWeight | None = None
        self.kv_packed: PackedWeight | None = None
        self.qkv_quant: QuantLinear | None = None  # set by fuse() where the projections are quantized (quant.drafter)
        self.kv_quant: QuantLinear | None = None  # its k/v rows (views)
        # (sources, their key, args): see native_args
        self._args: tuple[tuple[torch.Tensor, ...], tuple, native.BlockLayerArgs] | None = None

    def fuse(self) -> None:
        """Inference only: q/k/v become one matmul (k/v one for the context), gate/up one, all packed where
        supported (model.packing); the parameters stay, as views of the fused weights. Quantized projections fuse
        into one QuantLinear the same way (no dense weight: native_forward takes their int packs)."""
        if isinstance(self.q_proj, QuantLinear):
            self.qkv_quant = QuantLinear.concat([self.q_proj, self.k_proj, self.v_proj])
            qkv, rows = self.qkv_quant, self.nq * self.head_dim
            self.kv_quant = QuantLinear(qkv.qweight[rows:], qkv.scales[rows:], qkv.bits, act_bits=qkv.act_bits)
            self.mlp.fuse()
            return
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)[0]
        self.qkv_packed = pack(self.qkv_weight)
        self.kv_packed = pack(self.qkv_weight[self.nq * self.head_dim :])
        self.o_proj = PackedLinear(self.o_proj)
        self.mlp.fuse()
        self.mlp.pack()

    def _project(self, x: torch.Tensor, with_q: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        if self.qkv_quant is not None:
            sizes = [self.nq * self.head_dim, self.nkv * self.head_dim, self.nkv * self.head_dim]
            q, k, v = self.qkv_quant(x).split(sizes, dim=-1) if with_q else (None, *self.kv_quant(x).chunk(2, dim=-1))
        elif self.qkv_weight is None:
            q = self.q_proj(x) if with_q else None
            k, v = self.k_proj(x), self.v_proj(x)
        elif with_q:
            q, k, v = linear(x, self.qkv_weight, None, self.qkv_packed).split(
                [self.nq * self.head_dim, self.nkv * self.head_dim, self.nkv * self.head_dim], dim=-1)
        else:
            q = None
            k, v = linear(x, self.qkv_weight[self.nq * self.head_dim :], None, self.kv_packed).chunk(2, dim=-1)
        shape = (b, t, -1, self.head_dim)
        return None if q is None else q.view(shape), k.view(shape), v.view(shape)

    def _rope_kv(self, k, v, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T, Hkv, D] -> [B, Hkv, T, D]
        return apply_rope(self.k_norm(k), cos, sin).transpose(1, 2), v.transpose(1, 2)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:  # x [B, T, d] -> [B, Hkv, T, D]
        _, k, v = self._project(x, with_q=False)
        return self._rope_kv(k, v, cos, sin)

    def native_packs(self, x: torch.Tensor) -> tuple[native.Packed | native.QPacked, ...] | None:
        """The packed qkv, o, gate/up and down weights for native_forward, or None unless every one is a valid
        native pack for an fp32 input like x (fused and packed at load, unchanged since; a quantized layer's
        QuantLinears pack on first use, and again after they move)."""
        if x.dtype != torch.float32 or self.head_dim > 512 or self.head_dim % 8:
            return None
        if self.qkv_quant is not None:
            quant = (self.qkv_quant, self.o_proj, self.mlp.gate_up_quant, self.mlp.down_proj)
            if not native.qavailable() or not all(isinstance(q, QuantLinear) and q.qweight.device.type == "cpu"
                                                  and q.bias is None for q in quant):
                return None
            return tuple(q.qpacked() for q in quant)
        if self.qkv_weight is None:
            return None
        pairs = ((self.qkv_weight, self.qkv_packed), (self.o_proj.weight, getattr(self.o_proj, "packed", None)),
                 (self.mlp.gate_up_weight, self.mlp.gate_up_packed),
                 (self.mlp.down_proj.weight, getattr(self.mlp.down_proj, "packed", None)))
        if any(p is None or w is None or not p.usable(w, x) for w, p in pairs):
            return None
        return tuple(p.packed for _, p in pairs)

    def _native_sources(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors native_args' kernel arguments come from: the matmul weights (dense, or the int packs'
        sources) and the four norms; a None where a layer is not fused for the native path."""
        if self.qkv_quant is not None:
            quant = (self.qkv_quant, self.o_proj, self.mlp.gate_up_quant, self.mlp.down_proj)
            if not all(isinstance(q, QuantLinear) for q in quant):
                return (None,)
            weights = tuple(t for q in quant for t in (q.qweight, q.scales))
        else:
            weights = (self.qkv_weight, self.o_proj.weight, self.mlp.gate_up_weight, self.mlp.down_proj.weight)
        return (*weights, self.input_layernorm.weight, self.post_attention_layernorm.weight, self.q_norm.weight,
                self.k_norm.weight)

    def native_args(self, x: torch.Tensor) -> native.BlockLayerArgs | None:
        """native_packs(x) with the norms, eps and dims, checked and described for the kernel once
        (native.BlockLayerArgs) and kept while the same source tensors hold the same storage and version (as
        native_packs' own check; held, so that a freed tensor's address reused by a new one never matches), or
        None where native_packs is."""
        sources = self._native_sources()
        if x.dtype != torch.float32 or x.device.type != "cpu" or any(t is None for t in sources):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in sources)):
            return None
        key = (*((t.data_ptr(), weight_version(t), t.dtype) for t in sources), self.input_layernorm.eps)
        if self._args is not None and self._args[1] == key and all(a is b for a, b in zip(self._args[0], sources)):
            return self._args[2]
        packs = self.native_packs(x)
        if packs is None:
            return None
        norms = tuple(t.detach() for t in sources[-4:])
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms):
            return None
        args = native.BlockLayerArgs(norms, self.input_layernorm.eps, packs,
                                     (self.nq, self.nkv, self.head_dim, self.mlp.down_proj.in_features))
        self._args = (sources, key, args)
        return args

    def native_forward(
        self,
        x: torch.Tensor,  # [G, d] fp32 block, updated in place
        args: native.BlockLayerArgs,  # native_args(x)
        cos: torch.Tensor, sin: torch.Tensor,  # [n + G, D] fp32, positions of the new context rows and the block
        cache: KVCache, index: int,  # one sequence's context cache and this layer's index in it
        new_ctx: torch.Tensor | None,  # [n, d] fp32 context features to write before the block's rows
        bf16_matmuls: bool = False,  # matmul inputs rounded to bf16 (BlockDraftModel.bf16_matmuls)
    ) -> None:
        """forward() for one sequence over its context cache, in one native call (kernels/blocklayer.c)."""
        native.block_layer(x, new_ctx, args, (cos, sin), (cache.k[index, 0], cache.v[index, 0]), cache.length,
                           bf16_matmuls)

    def native_forward_batch(
        self,
        x: torch.Tensor,  # [B * G, d] fp32: B sequences' blocks back to back, updated in place
        args: native.BlockLayerArgs,  # native_args(x)
        cos: torch.Tensor, sin: torch.Tensor,  # [sum(ns) + B * G, D] fp32: per sequence its new context rows and block
        caches: list[KVCache], index: int,  # the sequences' context caches and this layer's index in them
        new_ctx: torch.Tensor | None,  # [sum(ns), d] fp32 context features, each sequence's ns[b] rows in turn
        ns: list[int],
        bf16_matmuls: bool = False,
    ) -> None:
        """native_forward for several sequences in one call: the matmuls over all their rows at once."""
        native.block_layers(x, new_ctx, ns, args, (cos, sin), [(c.k[index, 0], c.v[index, 0]) for c in caches],
                            [c.length for c in caches], bf16_matmuls)

    def forward(
        self,
        x: torch.Tensor,  # [B, G, d] block
        cos, sin,  # [B, n + G, 1, D] positions of the new context rows (if any) and the block
        ctx: tuple[torch.Tensor, torch.Tensor] | tuple[KVCache, int],  # context keys/values [B, Hkv, S, D]
        # (RoPE applied), or a context cache and this layer's index in it
        ctx_mask: torch.Tensor | None,  # [B, 1, G, S + G] bool or None (everything visible)
        new_ctx: torch.Tensor | None = None,  # [1, n, d] context features to write to the cache (before the block)
    ) -> torch.Tensor:
        b, g, _ = x.shape
        xn = self.input_layernorm(x)
        n = 0 if new_ctx is None else new_ctx.shape[1]
        if n:  # one projection for both: rows are independent, the context rows' queries are not used
            xn = torch.cat([new_ctx.to(xn.dtype), xn], dim=1)
        q, k, v = self._project(xn, with_q=True)
        q = apply_rope(self.q_norm(q[:, n:]), cos[:, n:], sin[:, n:]).transpose(1, 2)
        k, v = self._rope_kv(k, v, cos, sin)
        # Attention runs in the context's dtype: fp32 for a bf16 drafter on CPU, where bf16 attention is slow.
        if isinstance(ctx[0], KVCache):  # new context rows, then the block's keys/values (uncommitted)
            cache, index = ctx
            k, v = cache.write(index, k.to(cache.k.dtype), v.to(cache.v.dtype))
        else:  # block_hidden passes new context rows only with a context cache
            ctx_k, ctx_v = ctx
            k = torch.cat([ctx_k, k.to(ctx_k.dtype)], dim=2)
            v = torch.cat([ctx_v, v.to(ctx_v.dtype)], dim=2)
        q = q.to(k.dtype)
        if ctx_mask is None and native.attention_supported(q, k, v):
            out = native.attention(q, k, v, causal=False)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx_mask, enable_gqa=self.nq != self.nkv)
        x = x + self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(b, g, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDraftModel(nn.Module):
    """The drafter's own weights; embedding and LM head come from the target at call time."""

    def __init__(self, target_cfg: ModelConfig, cfg: BlockConfig) -> None:
        super().__init__()
        self.config, self.target_config = cfg, target_cfg
        d = target_cfg.hidden_size
        self.fc = nn.Linear(d * len(cfg.target_layers), d, bias=False)
        self.hidden_norm = RMSNorm(d, target_cfg.rms_norm_eps)
        self.layers = nn.ModuleList(_BlockLayer(target_cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, target_cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(target_cfg)
        r = cfg.markov_rank
        if cfg.head != "none" or cfg.confidence:  # W1: the confidence head reads it too
            self.markov_in = nn.Embedding(target_cfg.vocab_size, r)
        if cfg.head != "none":
            self.markov_out = nn.Linear(r, target_cfg.vocab_size, bias=False)  # W2
            nn.init.zeros_(self.markov_out.weight)  # starts as the parallel drafter
        if cfg.head == "rnn":
            self.rnn_cell = nn.Linear(2 * r + d, 3 * r)  # A: [s; W1[x]; h] -> gate, candidate, output
        if cfg.confidence:
            self.confidence_head = nn.Linear(d + cfg.markov_rank, 1)

    def prepare_inference(self) -> BlockDraftModel:
        """Inference only: fused, packed matmuls for the block layers and the context projection, which also lets
        one-sequence proposals run each layer natively (kernels/blocklayer.c). The head loop's one-row layers stay
        on F.linear (oneDNN packs were slower there: zoo/dspark Markov head 129 us against 153 us); with the native
        kernels the greedy head loop is one call (kernels/markov.c)."""
        for layer in self.layers:
            layer.fuse()
        if not isinstance(self.fc, QuantLinear):
            self.fc = PackedLinear(self.fc)
        return self

    @property
    def dtype(self) -> torch.dtype:  # the activations' dtype (a quantized fc has no dense weight to ask)
        return self.norm.weight.dtype

    # ---- context ----------------------------------------------------------------------------------------------
    def context_features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:  # {layer: [..., T, d]} -> [..., T, d]
        h = torch.cat([hidden[layer] for layer in self.config.target_layers], dim=-1)
        return self._norm(self.hidden_norm, self.fc(h.to(self.dtype)))

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x), through the native kernel at inference on CPU in fp32 (layers.native_norm) unless turned off."""
        return native_norm(norm, x) if self.use_native else norm(x)

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [B, Hkv, T, D] of context features [B, T, d] at positions [B, T]."""
        cos, sin = self.rotary_emb(positions, feats.dtype)
        return [layer.kv(feats, cos, sin) for layer in self.layers]

    def append_context(self, cache: KVCache, feats: torch.Tensor, start: int, cache_start: int = 0) -> None:
        """Write context features [1, T, d] for positions start..start+T-1 into a per-sequence cache whose first
        entry is position cache_start (a sliding window's start)."""
        self.append_contexts([cache], feats, [start], [feats.shape[1]], [cache_start])

    def append_contexts(
        self, caches: list[KVCache],
        feats: torch.Tensor,  # [1, sum(rows), d] each sequence's features back to back
        starts: list[int], rows: list[int], cache_starts: list[int],  # per sequence: first position, count, window
    ) -> None:
        """append_context for several sequences' caches, their rows projected in one pass per layer."""
        for cache, start, cache_start in zip(caches, starts, cache_starts):
            if cache_start + cache.length != start:
                raise ValueError(f"context cache holds positions {cache_start}..{cache_start + cache.length - 1}, "
                                 f"new features start at {start}")
        positions = torch.cat([torch.arange(s, s + n, device=feats.device) for s, n in zip(starts, rows)])[None]
        kv = self.context_kv(feats, positions)  # per layer [1, Hkv, sum(rows), D]
        offset = 0
        for cache, n in zip(caches, rows):
            cache.reserve(cache.length + n)
            for i, (k, v) in enumerate(kv):
                cache.write(i, k[:, :, offset : offset + n], v[:, :, offset : offset + n])
            cache.advance(n)
            offset += n

    # ---- block ------------------------------------------------------------------------------------------------
    def block_hidden(
        self,
        embed: nn.Embedding,
        anchors: torch.Tensor,  # [B] anchor token ids
        anchor_pos: torch.Tensor,  # [B] anchor positions
        ctx: list[tuple[torch.Tensor, torch.Tensor]] | KVCache,  # per layer (k, v) [B, Hkv, S, D], or one
        # sequence's context cache (B = 1): the block's keys/values are written after its entries, not committed
        ctx_mask: torch.Tensor | None = None,  # [B, 1, 1 or G, S] bool: which context positions each block sees
        new_ctx: torch.Tensor | None = None,  # [1, n, d] context features (context_features) of the n positions
        # before the anchor that the context cache lacks: written to it and committed in this forward
        ctx_start: int = 0,  # the position of the context cache's first entry (a sliding window's start)
    ) -> torch.Tensor:  # [B, G, d] final-normed block states
        g = self.config.block_size
        n = 0 if new_ctx is None else new_ctx.shape[1]
        if n and not (isinstance(ctx, KVCache) and ctx_start + ctx.length + n == int(anchor_pos[0])):
            raise ValueError("new context rows must end at the anchor of one sequence's context cache")
        if isinstance(ctx, KVCache):  # the new context rows and the block's keys/values go after its entries
            ctx.reserve(ctx.length + n + g)
        tokens = torch.full((anchors.shape[0], g), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, 0] = anchors
        x = embed(tokens).to(self.dtype)
        layers = self._native_args(x, ctx, ctx_mask)
        if layers is not None:  # one sequence over its cache: one native call per layer
            feats = None if not n else new_ctx[0].to(torch.float32).contiguous()
            first = int(anchor_pos[0]) - n  # positions first .. first + n + G - 1: rows of the fp32 tables
            rope = self.rotary_emb
            cos, sin = rope.cos[first : first + n + g], rope.sin[first : first + n + g]  # [n + G, D]
            for i, layer in enumerate(self.layers):
                layer.native_forward(x[0], layers[i], cos, sin, ctx, i, feats, self.bf16_matmuls)
        else:
            positions = anchor_pos[:, None] + torch.arange(-n, g, device=anchors.device)[None]
            cos, sin = self.rotary_emb(positions, x.dtype)
            mask = None
            if ctx_mask is not None:  # the block always sees itself
                own = torch.ones(*ctx_mask.shape[:2], g, g, dtype=torch.bool, device=ctx_mask.device)
                mask = torch.cat([ctx_mask.expand(-1, -1, g, -1), own], dim=-1)
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, (ctx, i) if isinstance(ctx, KVCache) else ctx[i], mask, new_ctx)
        if n:
            ctx.advance(n)
        return self._norm(self.norm, x)

    def block_hidden_batch(
        self,
        embed: nn.Embedding,
        anchors: torch.Tensor,  # [B] anchor token ids
        anchor_pos: torch.Tensor,  # [B] anchor positions
        caches: list[KVCache],  # each sequence's context cache: the block's keys/values go after its entries
        new_ctx: torch.Tensor | None,  # [sum(ns), d] context features each sequence's cache lacks before its anchor
        ns: list[int],  # ... how many rows of them are each sequence's (written and committed in this forward)
        ctx_starts: list[int],  # the position of each cache's first entry (a sliding window's start)
        layers: list[native.BlockLayerArgs],  # per layer, from native_batch(caches)
    ) -> torch.Tensor:  # [B, G, d] final-normed block states
        """block_hidden for several sequences over their own caches, one native call per layer (no padding, no
        mask)."""
        g, b = self.config.block_size, len(caches)
        positions = anchor_pos.tolist()
        for cache, start, n, p in zip(caches, ctx_starts, ns, positions):
            if start + cache.length + n != p:
                raise ValueError("new context rows must end at each sequence's anchor")
            cache.reserve(cache.length + n + g)
        tokens = torch.full((b, g), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, 0] = anchors
        x = embed(tokens).to(self.dtype).reshape(b * g, -1).contiguous()
        rows = torch.cat([torch.arange(p - n, p + g) for p, n in zip(positions, ns)])  # every row's position
        cos, sin = self.rotary_emb.cos[rows].contiguous(), self.rotary_emb.sin[rows].contiguous()
        feats = None if new_ctx is None else new_ctx.to(torch.float32).contiguous()
        for i, layer in enumerate(self.layers):
            layer.native_forward_batch(x, layers[i], cos, sin, caches, i, feats, ns, self.bf16_matmuls)
        for cache, n in zip(caches, ns):
            cache.advance(n)
        return self._norm(self.norm, x.view(b, g, -1))

    def native_batch(self, caches: list[KVCache]) -> list[native.BlockLayerArgs] | None:
        """Each layer's native arguments where block_hidden_batch takes these sequences (fp32 CPU caches, no
        gradient, every layer natively packed for fp32 activations), else None."""
        if not self.use_native or torch.is_grad_enabled() or self.dtype != torch.float32:
            return None
        if any(c.k.dtype != torch.float32 or c.k.device.type != "cpu" for c in caches):
            return None
        probe = torch.empty(1, self.norm.weight.shape[0])  # the packs' checks read an input's dtype and device
        layers = [layer.native_args(probe) for layer in self.layers]
        return None if any(a is None for a in layers) else layers  # type: ignore[return-value]

    # Where a proposal takes kernels/blocklayer.c: sequences over their own context caches (one alone, or a batch
    # through block_hidden_batch), fp32 activations and cache, no gradient, every layer fused and natively packed
    # at load. Elsewhere (training, other devices) the torch layers, a batch's contexts padded and masked; the two
    # agree to rounding (tests/test_block_drafter.py).
    use_native = True
    # A bf16 drafter computing in fp32 on CPU (drafters.block.load_block_drafter) rounds its native layers' matmul
    # inputs to bf16, as the bf16 drafter would: its bf16 weights then take the vdpbf16ps path, twice the FMA rate.
    bf16_matmuls = False

    def _native_args(self, x, ctx, mask) -> list[native.BlockLayerArgs] | None:
        if not (self.use_native and mask is None and isinstance(ctx, KVCache) and x.shape[0] == 1):
            return None
        if ctx.k.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return None
        layers = [layer.native_args(x) for layer in self.layers]
        return None if any(a is None for a in layers) else layers  # type: ignore[return-value]

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:  # [...] token ids -> [..., V]
        return self.markov_out(self.markov_in(prev))

    def head_bias(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:  # [N, G, d], [N, G] -> [N, G, V]
        """The sequential head's bias B_k for every position, teacher-forced: prev[:, k] is x_{k-1} (the anchor
        first). The RNN head is unrolled over the block, as inference runs it one position at a time."""
        if self.config.head == "markov":
            return self.markov_bias(prev)
        state, out = None, []
        for k in range(h.shape[1]):
            u, state = self.rnn_step(state, h[:, k], prev[:, k])
            out.append(u)
        return self.markov_out(torch.stack(out, dim=1))

    def rnn_step(
        self, state: torch.Tensor | None, h: torch.Tensor, prev: torch.Tensor  # [N, r] or None (s_0 = 0), [N, d], [N]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tanh(o_k) [N, r] (B_k = W2 of it), s_k [N, r]
        emb = self.markov_in(prev).to(h.dtype)
        if state is None:
            state = emb.new_zeros(emb.shape)
        gate, cand, out = self.rnn_cell(torch.cat([state, emb, h], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        return torch.tanh(out), g * state + (1 - g) * torch.tanh(cand)

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:  # [..., d], [...] -> [...]
        return self.confidence_head(torch.cat([h, self.markov_in(prev).to(h.dtype)], dim=-1)).squeeze(-1)

    # confidence_logit(h, prev) = h . w_h + t[prev] with (w_h, t) = confidence_terms(): the block-state weights for
    # every position at once and a per-previous-token table (the W1 term and the bias), so a sequential head loop
    # indexes instead of running a layer per position.
    def confidence_terms(self) -> tuple[torch.Tensor, torch.Tensor]:  # w_h [d], t [V]
        w = self.confidence_head.weight[0]
        d = w.shape[0] - self.config.markov_rank
        return w[:d], self.markov_in.weight.to(w.dtype) @ w[d:] + self.confidence_head.bias[0]
