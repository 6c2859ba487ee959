"""The target's forward as one native call (kernels/decoder.c) where it applies: a packed CPU model at inference
over caller-owned fp32 KV caches. Elsewhere (CUDA, training, no cache, a changed weight) the model keeps the torch
path of model/layers.py, which the native forward equals to rounding."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.kernels import native
from verispec.model.packing import PackedLinear, PackedWeight


_version = operator.attrgetter("_version")


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


class FusedForward:
    """A packed model's weights described once for decoder.c. `usable()` is false as soon as any weight it was made
    from changes or moves (the packs are then stale) or a gradient is wanted."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        layers, sources = [], [model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight]
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            packs: list[PackedWeight | None] = [attn.qkv_packed, getattr(attn.o_proj, "packed", None),
                                                mlp.gate_up_packed, getattr(mlp.down_proj, "packed", None)]
            if any(p is None for p in packs):
                raise ValueError("the native forward needs every matmul packed (Transformer.pack_weights)")
            qkv, o, gate_up, down = packs
            layers.append(native.DecoderLayerWeights(
                qkv.packed, o.packed, gate_up.packed, down.packed,
                _fp32(layer.input_layernorm.weight), _fp32(layer.post_attention_layernorm.weight),
                qkv_bias=qkv.native_bias(attn.qkv_bias), o_bias=o.native_bias(attn.o_proj.bias),
                q_norm=None if attn.q_norm is None else _fp32(attn.q_norm.weight),
                k_norm=None if attn.k_norm is None else _fp32(attn.k_norm.weight)))
            sources += [attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight,
                        layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            sources += [t for t in (attn.qkv_bias, attn.o_proj.bias) if t is not None]
            sources += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
        if not isinstance(model.lm_head, PackedLinear) or model.lm_head.packed is None:
            raise ValueError("the native forward needs a packed LM head")
        dims = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.vocab_size)
        rope = model.model.rotary_emb
        self.decoder = native.Decoder(dims, cfg.rms_norm_eps, model.model.embed_tokens.weight.detach().contiguous(),
                                      layers, _fp32(model.model.norm.weight), model.lm_head.packed.packed,
                                      (_fp32(rope.cos), _fp32(rope.sin)))
        self._sources = sources
        self._versioned = [t for t in sources if not t.is_inference()]  # inference tensors keep no version
        self._key = self._state()

    def _state(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # map over C-level getters: this runs before every forward (~60 tensors)
        return tuple(map(torch.Tensor.data_ptr, self._sources)), tuple(map(_version, self._versioned))

    def usable(self) -> bool:
        if torch.is_grad_enabled() and any(t.requires_grad for t in self._sources):
            return False
        return self._state() == self._key

    @staticmethod
    def takes(cache: KVCache | PackedBatch | None) -> bool:
        """Whether these caches are ones decoder.c writes: CPU fp32 KVCaches."""
        if isinstance(cache, PackedBatch):
            return all(s.cache.k.dtype == torch.float32 and s.cache.k.device.type == "cpu" and s.cache.k.shape[1] == 1
                       for s in cache.segments)
        return isinstance(cache, KVCache) and cache.k.dtype == torch.float32 and cache.k.device.type == "cpu"

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        cache: KVCache,
        hidden_layers: Sequence[int],
        num_logits: int,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [B, num_logits, V], {layer: [B, T, d]}
        bsz, seqlen = tokens.shape
        caches = [(cache.k[:, b], cache.v[:, b], cache.length, seqlen) for b in range(bsz)]
        rows = torch.arange(seqlen - num_logits, seqlen)
        if bsz > 1:
            rows = (rows[None] + seqlen * torch.arange(bsz)[:, None]).reshape(-1)
        logits, hidden = self.decoder.forward(tokens.reshape(-1).contiguous(), caches, rows, tuple(hidden_layers))
        cache.advance(seqlen)
        return logits.view(bsz, num_logits, logits.shape[-1]), {i: h.view(bsz, seqlen, h.shape[-1]) for i, h in hidden.items()}

    def forward_packed(
        self,
        tokens: torch.Tensor,  # [N]
        batch: PackedBatch,
        logit_rows: torch.Tensor,  # [M]
        hidden_layers: Sequence[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [M, V], {layer: [N, d]}
        caches = [(s.cache.k[:, 0], s.cache.v[:, 0], s.cache.length, s.length) for s in batch.segments]
        out = self.decoder.forward(tokens.contiguous(), caches, logit_rows.to(torch.int64).contiguous(),
                                   tuple(hidden_layers))
        batch.advance()
        return out
