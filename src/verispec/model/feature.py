"""Feature drafters: one decoder layer over the target's hidden states and the next token's embedding, drafting
autoregressively from its own output states (EAGLE-3, arXiv 2503.01840; DeepSeek-V3's MTP module, arXiv
2412.19437 §2.2).

The drafter's sequence has one entry per position j of the target's sequence: entry j reads a feature f_j and
the token x_{j+1}, sits at RoPE position j, and its output state g_j predicts x_{j+2}:

    u_j = W_in [enorm(E[x_{j+1}]) ; fnorm(f_j)]            (2d -> d; E is the target's embedding)
    g_j = DecoderLayer(u_j | entries <= j)                 (pre-norm attention + SwiGLU, residuals)
    q(x_{j+2}) = softmax(lm_head(norm(g_j)))               (the target's LM head, over the draft vocabulary)

For a committed position the feature is the target's: EAGLE-3 fuses a low, a middle and a high layer,
f_j = W_fc [h^a_j ; h^b_j ; h^c_j]; MTP takes the last decoder layer's output h^L_j. Past the committed tokens the
drafter feeds itself: the entry after g_j reads f_{j+1} = g_j (EAGLE's feature recursion, and an MTP module of depth
1 applied recursively as vLLM and SGLang run DeepSeek's). EAGLE-3 is trained with training-time test (the loss
unrolls the recursion, `ttt_forward`); MTP on the committed features only, its paper's single step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verispec.cache import KVCache, PackedBatch
from verispec.cache.packed import causal_mask
from verispec.config import ModelConfig
from verispec.errors import ConfigError
from verispec.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding, native_norm
from verispec.model.packing import PackedLinear, PackedWeight, linear
from verispec.quant.linear import QuantLinear

FEATURE_KINDS = ("eagle", "mtp")


@dataclass(frozen=True)
class FeatureConfig:
    kind: str  # eagle | mtp
    target_layers: tuple[int, ...]  # HF `hidden_states` indices the feature reads (mtp: the last layer alone)
    # Proposals see the latest W..2W committed entries (0: all): the range training sequences showed the layer.
    context_window: int = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(x) for x in self.target_layers))
        if self.kind not in FEATURE_KINDS:
            raise ConfigError(f"feature drafter kind must be one of {FEATURE_KINDS}, got {self.kind!r}")
        if not self.target_layers or (self.kind == "mtp" and len(self.target_layers) != 1):
            raise ConfigError(f"{self.kind} needs {'one target layer' if self.kind == 'mtp' else 'target layers'}, "
                              f"got {self.target_layers}")
        if self.context_window < 0:
            raise ConfigError(f"context_window must be >= 0 (0: the whole context), got {self.context_window}")

    def to_dict(self) -> dict:
        return {**asdict(self), "target_layers": list(self.target_layers)}


def default_layers(kind: str, num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/middle/high layers (its code: 2, L/2, L-3, here as outputs of layers 2, L/2 and L-2, the ones
    the DSpark drafter reads, so both see the same rows); MTP's last layer."""
    return (num_layers,) if kind == "mtp" else (2, num_layers // 2, num_layers - 2)


class FeatureDraftModel(nn.Module):
    """The drafter's own weights; the embedding and LM head come from the target at call time."""

    def __init__(self, target_cfg: ModelConfig, cfg: FeatureConfig) -> None:
        super().__init__()
        self.config, self.target_config = cfg, target_cfg
        d = target_cfg.hidden_size
        if cfg.kind == "eagle":
            self.fc = nn.Linear(d * len(cfg.target_layers), d, bias=False)
        self.embed_norm = RMSNorm(d, target_cfg.rms_norm_eps)
        self.feature_norm = RMSNorm(d, target_cfg.rms_norm_eps)
        self.w_in = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(target_cfg, 0)
        self.norm = RMSNorm(d, target_cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(target_cfg)

    def prepare_inference(self) -> FeatureDraftModel:
        """Inference only: fused q/k/v and gate/up, every matmul on weights packed once (model.packing), as the
        target's layers run; one-row matmuls through F.linear cost several times more on a CPU."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        attn.fuse()
        attn.pack()
        mlp.fuse()
        mlp.pack()
        if not isinstance(self.w_in, QuantLinear):  # an int8/int4 drafter's QuantLinears pack on first use
            self.w_in = PackedLinear(self.w_in)
        if self.config.kind == "eagle" and not isinstance(self.fc, QuantLinear):
            self.fc = PackedLinear(self.fc)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:  # {layer: [..., T, d]} -> [..., T, d]
        """The committed positions' features f_j from the target's hidden states."""
        if self.config.kind == "mtp":
            return hidden[self.config.target_layers[0]].to(self.dtype)
        return self.fc(torch.cat([hidden[layer].to(self.dtype) for layer in self.config.target_layers], dim=-1))

    def inputs(self, embed: nn.Embedding, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """u = W_in [enorm(E[x]) ; fnorm(f)]: tokens [..., T] (x_{j+1}), feats [..., T, d] -> [..., T, d]."""
        e = embed(tokens).to(self.dtype)
        return self.w_in(torch.cat([native_norm(self.embed_norm, e), native_norm(self.feature_norm, feats)], dim=-1))

    def step(
        self,
        u: torch.Tensor,  # [1, T, d] inputs of T new entries
        positions: torch.Tensor,  # [T] their RoPE positions
        cache: KVCache,  # one layer; the new entries' keys/values are written after its `length` rows
        mask: torch.Tensor | None,  # [T, length + T] bool (True = attend); None: causal after the cache
    ) -> torch.Tensor:  # [1, T, d] output states g
        """Run T entries through the layer after the cache's rows and advance the cache past them."""
        t = u.shape[1]
        cos, sin = self.rotary_emb(positions[None], u.dtype)
        causal = mask is None
        if causal:  # None where SDPA's own flags do (see causal_mask)
            mask = causal_mask(cache.length, t, u.device)
        cache.reserve(cache.length + t)
        g = self.layer(u, cos, sin, cache, mask, causal)
        cache.advance(t)
        return g

    def step_packed(
        self,
        u: torch.Tensor,  # [1, N, d] inputs of every cache's new entries, back to back
        caches: list[KVCache],  # one layer each
        lengths: list[int],  # new entries per cache
    ) -> torch.Tensor:  # [1, N, d] output states
        """step() for several sequences at once: each segment causal after its own cache's rows."""
        for cache, n in zip(caches, lengths):
            cache.reserve(cache.length + n)
        batch = PackedBatch.build(caches, lengths, u.device)
        cos, sin = self.rotary_emb(batch.positions(u.device)[None], u.dtype)
        g = self.layer(u, cos, sin, batch, None)
        batch.advance()
        return g

    def logits(self, g: torch.Tensor, head: torch.Tensor, packed: PackedWeight | None = None
               ) -> torch.Tensor:  # [..., d], [V', d] -> [..., V'] fp32
        return linear(native_norm(self.norm, g), head.to(g.dtype), None, packed).float()

    def ttt_forward(
        self,
        embed: nn.Embedding,
        tokens: torch.Tensor,  # [B, T] the sequence
        feats: torch.Tensor,  # [B, T, d] the target's features of every position
        steps: int,  # S: how far the feature recursion is unrolled
    ) -> list[torch.Tensor]:  # S output states [B, T - 1, d]; step s, row j: g^s_j, predicting x_{j+2}
        """Training-time test (EAGLE-3): step 0 is every entry over the target's features; at step s >= 1 entry j
        reads the state step s - 1 produced at j - 1, the way a draft s tokens past the committed ones does. Entry j
        of step s belongs to the draft that starts after position j - s: it sees step 0's entries up to j - s (the
        committed context) and step r's entry at j - s + r for r = 1..s (its own earlier drafts), the diagonal
        mask of EAGLE-3's TTT. Row j of step s drafts what inference drafts s tokens after anchor x_{j-s+1}, up to
        the teacher-forced tokens (which equal the drafts wherever every earlier draft was right)."""
        b, t = tokens.shape
        n = t - 1
        x, f = tokens[:, 1:], feats[:, :-1]  # entry j: token x_{j+1}, feature f_j
        positions = torch.arange(n, device=tokens.device)
        cos, sin = self.rotary_emb(positions[None].expand(b, n), self.dtype)
        attn, layer = self.layer.self_attn, self.layer
        keys, values, outs = [], [], []
        rows = positions[:, None]
        for s in range(steps):
            if s:  # entry j reads g^{s-1}_{j-1}; row 0 has no predecessor (masked out below: it sees nothing new)
                f = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)
            u = self.inputs(embed, x, f)
            h = layer.input_layernorm(u)
            q, k, v = attn._qkv(h, cos, sin)  # [B, H(kv), n, D]
            keys.append(k)
            values.append(v)
            # columns: step r's n entries for r = 0..s
            masks = [positions[None, :] <= rows - s]  # step 0: the committed context up to j - s
            masks += [positions[None, :] == rows - s + r for r in range(1, s + 1)]
            mask = torch.cat(masks, dim=1)  # [n, (s + 1) n]
            o = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                               attn_mask=mask, enable_gqa=attn.num_heads != attn.num_kv_heads)
            a = u + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            outs.append(a + layer.mlp(layer.post_attention_layernorm(a)))
        return outs
