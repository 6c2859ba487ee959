"""The target's forward as one native call (kernels/decoder.c) where it applies: a packed CPU model at inference
over caller-owned KV caches (fp32, or bf16 for a bf16 model: Transformer.kv_dtype). Elsewhere (CUDA, training, no
cache, a changed weight) the model keeps the torch path of model/layers.py, which the native forward equals to
rounding."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.kernels import native
from verispec.model.packing import PackedLinear, PackedWeight
from verispec.quant.linear import QuantLinear


_version = operator.attrgetter("_version")


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _matmul(dense: tuple[torch.Tensor | None, PackedWeight | None, torch.Tensor | None], quant: QuantLinear | None,
            ) -> tuple[native.Packed | native.QPacked, torch.Tensor | None, list[torch.Tensor]]:
    """One matmul of a layer for decoder.c: (its pack, its pad_bias()ed bias, the tensors it was made from), from a
    dense (weight, pack, bias) or a QuantLinear (whose frozen buffers are watched all the same)."""
    if quant is not None:
        bias = None if quant.bias is None else native.pad_bias(quant.bias)
        return quant.qpacked(), bias, [t for t in (quant.qweight, quant.scales, quant.bias) if t is not None]
    weight, packed, bias = dense
    if packed is None or weight is None:
        raise ValueError("the native forward needs every matmul packed (Transformer.pack_weights)")
    if not packed.valid_for(weight):  # e.g. packed, then .to(another dtype) without packing again
        raise ValueError("a matmul's pack was made from another tensor than its weight: pack_weights again")
    return packed.packed, packed.native_bias(bias), [t for t in (weight, bias) if t is not None]


def _quant(module: torch.nn.Module | None) -> QuantLinear | None:
    return module if isinstance(module, QuantLinear) else None


def _linear(lin: torch.nn.Module) -> tuple[native.Packed | native.QPacked, torch.Tensor | None, list[torch.Tensor]]:
    """_matmul of a PackedLinear or QuantLinear module."""
    return _matmul((getattr(lin, "weight", None), getattr(lin, "packed", None), getattr(lin, "bias", None)),
                   _quant(lin))


def layer_weights(layer: torch.nn.Module) -> tuple[native.DecoderLayerWeights, list[torch.Tensor]]:
    """A packed DecoderLayer (model.layers) for decoder.c, and the tensors its description was made from."""
    attn, mlp = layer.self_attn, layer.mlp
    mats = [_matmul((attn.qkv_weight, attn.qkv_packed, attn.qkv_bias), attn.qkv_quant), _linear(attn.o_proj),
            _matmul((mlp.gate_up_weight, mlp.gate_up_packed, None), mlp.gate_up_quant), _linear(mlp.down_proj)]
    (qkv, qkv_bias, _), (o_pack, o_bias, _), (gate_up, _, _), (down_pack, _, _) = mats
    weights = native.DecoderLayerWeights(
        qkv, o_pack, gate_up, down_pack,
        _fp32(layer.input_layernorm.weight), _fp32(layer.post_attention_layernorm.weight),
        qkv_bias=qkv_bias, o_bias=o_bias,
        q_norm=None if attn.q_norm is None else _fp32(attn.q_norm.weight),
        k_norm=None if attn.k_norm is None else _fp32(attn.k_norm.weight))
    sources = [t for _, _, made_from in mats for t in made_from]
    sources += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    sources += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
    return weights, sources


class _Watched:
    """usable() is false as soon as any tensor a native description was made from changes or moves (its packs are
    then stale) or a gradient is wanted."""

    def _watch(self, sources: list[torch.Tensor]) -> None:
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


def _writable(cache: KVCache, bf16: bool) -> bool:
    """Whether decoder.c writes this cache: on the CPU, fp32, or bf16 for a model whose activations are bf16 (its
    keys and values are bf16 values, exact there)."""
    return cache.k.device.type == "cpu" and (cache.k.dtype == torch.float32 or bf16 and cache.k.dtype == torch.bfloat16)


class _Bindings:
    """One native.Decoder's descriptions of one-sequence KV caches (Decoder.bind), made once per cache and reused by
    every later forward over it. Kept per cache object, weakly (an entry dies with its cache, so a binding never
    keeps a cache alive), and made anew when the cache's tensors are replaced, moved or reshaped (a tiered cache's
    every forward). An entry keeps tensors its cache has since replaced only until the cache is bound anew."""

    def __init__(self, decoder: native.Decoder) -> None:
        self.decoder = decoder
        # per cache: (its k and v, their binding, their addresses and shapes then)
        self._entries: weakref.WeakKeyDictionary[KVCache, tuple] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._entries)

    def current(self, cache: KVCache) -> native.BoundCache | None:
        """The cache's binding if its tensors are still the same objects at the same addresses and shapes."""
        entry = self._entries.get(cache)
        if entry is None:
            return None
        k, v = cache.k, cache.v
        if entry[0] is k and entry[1] is v and entry[3] == (k.data_ptr(), v.data_ptr(), k.shape, v.shape):
            return entry[2]
        return None

    def bind(self, cache: KVCache) -> native.BoundCache:
        """Describe a one-sequence cache (k, v [L, 1, Hkv, S, D]) the caller found writable (_writable)."""
        k, v = cache.k, cache.v
        bound = self.decoder.bind(k[:, 0], v[:, 0])
        self._entries[cache] = (k, v, bound, (k.data_ptr(), v.data_ptr(), k.shape, v.shape))
        return bound


def _forward_caches(
    decoder: native.Decoder,
    binding,  # the owner's binding(cache) -> native.BoundCache | None
    tokens: torch.Tensor,  # [N] every cache's new tokens, back to back
    caches: Sequence[KVCache],  # one sequence each (k, v [L, 1, Hkv, S, D])
    lengths: Sequence[int],
    trees: Sequence[tuple | None],  # per cache None (causal rows) or FusedForward.tree(...)'s
    logit_rows: torch.Tensor,  # [M] int64
    hidden_layers: tuple[int, ...],
    feats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """decoder.forward over one-sequence caches: through their bindings where every cache is bound and causal, else
    each described afresh (a tree's rows, or a cache that cannot be bound)."""
    bound = [binding(c) if tree is None else None for c, tree in zip(caches, trees)]
    if all(b is not None for b in bound):
        return decoder.forward_bound(tokens, [(b, c.length, n, c.next_position) for b, c, n in
                                              zip(bound, caches, lengths)], logit_rows, hidden_layers, feats)
    rows = [(c.k[:, 0], c.v[:, 0], c.length, n, c.next_position, tree) for c, n, tree in zip(caches, lengths, trees)]
    return decoder.forward(tokens, rows, logit_rows, hidden_layers, feats)


class FusedForward(_Watched):
    """A packed model's weights described once for decoder.c: each matmul dense (model.packing) or int8/int4
    (QuantLinear's qgemm.c pack)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        if not isinstance(model.lm_head, (PackedLinear, QuantLinear)):
            raise ValueError("the native forward needs a packed (or quantized) LM head")
        head, _, head_from = _linear(model.lm_head)
        layers, sources = [], [model.model.embed_tokens.weight, model.model.norm.weight, *head_from]
        for layer in model.model.layers:
            weights, made_from = layer_weights(layer)
            layers.append(weights)
            sources += made_from
        dims = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.vocab_size)
        rope = model.model.rotary_emb
        self.decoder = native.Decoder(dims, cfg.rms_norm_eps, model.model.embed_tokens.weight.detach().contiguous(),
                                      layers, _fp32(model.model.norm.weight), head,
                                      (_fp32(rope.cos), _fp32(rope.sin)))
        self._watch(sources)
        self._bindings = _Bindings(self.decoder)
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # _logit_rows'

    def binding(self, cache: KVCache) -> native.BoundCache | None:
        """The cache's description for decoder.c (_Bindings), or None where this model's forward cannot write it."""
        if (bound := self._bindings.current(cache)) is not None:
            return bound
        if cache.k.dim() != 5 or cache.k.shape[1] != 1 or not self.takes(cache):
            return None
        return self._bindings.bind(cache)

    def _logit_rows(self, seqlen: int, num_logits: int) -> torch.Tensor:  # [num_logits] int64: the last rows
        key = (seqlen, num_logits)
        rows = self._rows.get(key)
        if rows is None:
            rows = torch.arange(seqlen - num_logits, seqlen)
            if seqlen <= 64:  # a decode or verify step's shapes recur; a prefill's rarely
                self._rows[key] = rows
        return rows

    def takes(self, cache: KVCache | PackedBatch | None) -> bool:
        """Whether these caches are ones this model's decoder.c call writes (_writable)."""
        bf16 = self.decoder.dtype == torch.bfloat16
        if isinstance(cache, PackedBatch):
            return all(_writable(s.cache, bf16) and s.cache.k.shape[1] == 1 for s in cache.segments)
        return isinstance(cache, KVCache) and _writable(cache, bf16)

    @staticmethod
    def tree(positions: torch.Tensor | None, mask: torch.Tensor | None, cache: KVCache) -> tuple | None | bool:
        """A segment's draft tree in decoder.c's form, (positions [T], tails, ntail) (native.tree_rows); None for
        causal rows (no mask); False where decoder.c cannot honour the mask (the forward then takes the torch path)."""
        if mask is None:
            return None
        rows = native.tree_rows(mask, cache.length) if positions is not None else None
        return False if rows is None else (positions.reshape(-1), *rows)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        cache: KVCache,
        hidden_layers: Sequence[int],
        num_logits: int,
        tree: tuple | None = None,  # FusedForward.tree(...) of a one-sequence draft tree's forward
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [B, num_logits, V], {layer: [B, T, d]}
        bsz, seqlen = tokens.shape
        if bsz == 1:
            logits, hidden = _forward_caches(self.decoder, self.binding, tokens.reshape(-1).contiguous(), [cache],
                                             [seqlen], [tree], self._logit_rows(seqlen, num_logits),
                                             tuple(hidden_layers))
        else:
            caches = [(cache.k[:, b], cache.v[:, b], cache.length, seqlen, cache.next_position, tree)
                      for b in range(bsz)]
            rows = torch.arange(seqlen - num_logits, seqlen)
            if bsz > 1:
                rows = (rows[None] + seqlen * torch.arange(bsz)[:, None]).reshape(-1)
            logits, hidden = self.decoder.forward(tokens.reshape(-1).contiguous(), caches, rows,
                                                  tuple(hidden_layers))
        cache.advance(seqlen)
        return logits.view(bsz, num_logits, logits.shape[-1]), {i: h.view(bsz, seqlen, h.shape[-1]) for i, h in hidden.items()}

    def forward_packed(
        self,
        tokens: torch.Tensor,  # [N]
        batch: PackedBatch,
        logit_rows: torch.Tensor,  # [M]
        hidden_layers: Sequence[int],
        trees: Sequence[tuple | None] | None = None,  # per segment FusedForward.tree(...), None for causal rows
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [M, V], {layer: [N, d]}
        trees = trees or [None] * len(batch.segments)
        out = _forward_caches(self.decoder, self.binding, tokens.contiguous(), [s.cache for s in batch.segments],
                              [s.length for s in batch.segments], trees, logit_rows.to(torch.int64).contiguous(),
                              tuple(hidden_layers))
        batch.advance()
        return out


class FusedFeature(_Watched):
    """A feature drafter's step (model/feature.py: its input stage, its decoder layer, its final norm and the LM
    head over its draft vocabulary) as one decoder.c call over its fp32 caches: a draft step's ~40 small torch ops
    cost more than its matmuls (EAGLE-3 drafted at 3.2x DSpark's cost a round, reports/trees). Agrees with the
    torch path to rounding, as the target's native forward does."""

    def __init__(self, model: torch.nn.Module, embed: torch.Tensor, head: PackedWeight, head_sources: list) -> None:
        cfg = model.target_config
        weights, sources = layer_weights(model.layer)
        w_in, _, w_in_sources = _linear(model.w_in)
        stage = native.InputStage(_fp32(model.embed_norm.weight), _fp32(model.feature_norm.weight), w_in)
        dims = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.vocab_size)
        rope = model.rotary_emb
        self.decoder = native.Decoder(dims, cfg.rms_norm_eps, embed.detach().contiguous(), [weights],
                                      _fp32(model.norm.weight), head.packed, (_fp32(rope.cos), _fp32(rope.sin)),
                                      dtype=model.dtype, input_stage=stage)
        self._watch(sources + w_in_sources + [embed, model.embed_norm.weight, model.feature_norm.weight,
                                              model.norm.weight, *head_sources])
        self._bindings = _Bindings(self.decoder)

    def binding(self, cache: KVCache) -> native.BoundCache | None:
        """The cache's description for decoder.c (_Bindings), or None where this step cannot write it."""
        if (bound := self._bindings.current(cache)) is not None:
            return bound
        return self._bindings.bind(cache) if cache.k.dim() == 5 and self.takes([cache]) else None

    def step(
        self,
        tokens: torch.Tensor,  # [N] each entry's token x_{j+1}
        feats: torch.Tensor,  # [N, d] each entry's feature f_j
        caches: Sequence[KVCache],  # one layer each; lengths[i] entries go after caches[i]'s rows
        lengths: Sequence[int],
        logit_rows: torch.Tensor,  # [M] rows whose draft-vocabulary logits are wanted
        trees: Sequence[tuple | None] | None = None,  # per cache None (causal) or (positions, *tree_rows(mask, seen))
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [M, V'], output states g [N, d]
        for cache, n in zip(caches, lengths):
            cache.reserve(cache.length + n)
        logits, hidden = _forward_caches(self.decoder, self.binding, tokens, caches, lengths,
                                         trees or [None] * len(caches), logit_rows, (1,), feats)
        for cache, n in zip(caches, lengths):
            cache.advance(n)
        return logits, hidden[1]

    @staticmethod
    def takes(caches: Sequence[KVCache]) -> bool:
        return all(isinstance(c, KVCache) and _writable(c, False) and c.k.shape[1] == 1 for c in caches)
