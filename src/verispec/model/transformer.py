"""The decoder-only transformer shared by targets and model drafters (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from verispec.cache import KVCache, PackedBatch, causal_mask
from verispec.config import ModelConfig
from verispec.kernels import native
from verispec.model.fused import FusedForward
from verispec.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from verispec.model.packing import PackedLinear, pack_nbytes, packing_supported, physical_memory
from verispec.quant.linear import QuantLinear


@contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """Switch oneDNN (mkldnn) matmuls on or off for one forward. A process-wide flag: forwards must not run
    concurrently in several threads (the reference loop and the engine run them on one)."""
    previous = torch.backends.mkldnn.enabled
    if previous == enabled:
        yield
        return
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class Transformer(nn.Module):
    """`forward` never owns the cache: the caller passes one in and decides what to keep (truncate)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused: FusedForward | None = None  # set by pack_weights where the native forward applies
        self._packed = False  # pack_weights packed the matmuls

    def fuse_projections(self) -> Transformer:
        """Inference only: q/k/v and gate/up projections become one matmul each (weights shared, not copied)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def pack_weights(self) -> Transformer:
        """Inference only, after fuse_projections: CPU matmuls use weights packed once (model.packing), which makes
        a forward over 2-16 rows cost little more than one over a single row. The packs are copies of the matmul
        weights on top of the model (pack_nbytes): a model whose packs would take over a quarter of this machine's
        memory is left unpacked, as is one where packing is unsupported."""
        dense_head = not isinstance(self.lm_head, QuantLinear)  # a QuantLinear: qgemm.c packs it itself
        weights = [p for name, p in self.named_parameters() if name.endswith("proj.weight")]
        weights += [self.lm_head.weight] if dense_head else []
        extra = sum(pack_nbytes(w) for w in weights)
        memory = physical_memory()
        if not packing_supported(self.model.embed_tokens.weight) or (memory is not None and extra > memory // 4):
            return self
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        if dense_head:
            self.lm_head = PackedLinear(self.lm_head)
        self._packed = True
        cfg = self.config
        # decoder.c runs QuantLinears through qgemm.c: where that kernel is not built, they keep the per-layer path.
        if cfg.head_dim % 8 == 0 and cfg.head_dim <= 256 and (not self.quantized or native.qavailable()):
            self.fused = FusedForward(self)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, d] in the model's dtype: the tensor itself, or a quantized head dequantized
        (once; the drafters that score a draft vocabulary's rows read it)."""
        head = self.lm_head
        return head.dense(self.dtype) if isinstance(head, QuantLinear) else head.weight

    @property
    def quantized(self) -> bool:
        """Whether some matmuls hold int8/int4 weights (verispec.quant, loaded from a quantized checkpoint)."""
        return any(isinstance(m, QuantLinear) for m in self.modules())

    @property
    def packed(self) -> bool:
        """Whether pack_weights packed this model's matmuls (false where packing is unsupported)."""
        return self._packed

    @property
    def matmuls(self) -> str:
        """Which matmuls this model runs: "native" packs (model.packing) or "torch" (F.linear)."""
        return "native" if self.packed else "torch"

    @property
    def forward_path(self) -> str:
        """"native" where a CPU forward over a KV cache is one decoder.c call (model.fused), else "torch"."""
        return "native" if self.fused is not None and self.fused.usable() else "torch"

    @property
    def kv_dtype(self) -> torch.dtype:
        """What its KV caches hold (KVCache.for_model). On CPU attention runs in fp32 (bf16 attention there is several
        times slower: one query over 400 keys 340 vs 45 us); a bf16 model's keys and values are bf16 values, so where
        decoder.c runs its forward (it reads bf16 as the fp32 values they are; AVX-512 BF16 sums its scores straight
        off the bf16 rows) the cache holds them in bf16, exact and half the bytes a step streams; elsewhere fp32,
        which the torch path would otherwise convert every layer."""
        dtype = self.model.embed_tokens.weight.dtype
        if dtype != torch.bfloat16 or self.device.type != "cpu":
            return dtype
        return dtype if self.fused is not None and self.fused.decoder.dtype == torch.bfloat16 else torch.float32

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]; default: cache.next_position + arange(T)
        cache: KVCache | None = None,
        hidden_layers: Sequence[int] = (),
        num_logits: int | None = None,
        attn_mask: torch.Tensor | None = None,  # [T, cached + T] bool, True = attend; default causal
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run T new tokens after the cache's committed entries and commit them to the cache.

        Returns logits [B, T', V] for the last T' = num_logits positions (all T by default; 0 skips the LM head)
        and {layer: hidden [B, T, d]} for each requested layer, indexed as Hugging Face `hidden_states`:
        0 is the embedding output and l the output of decoder layer l (the last one before the final norm).
        `attn_mask` (with `positions`) runs a draft tree (cache.tree_mask, cache.tree_positions), natively where the
        mask lets every row see the cache (FusedForward.tree), else on the torch path.
        """
        # On CPU, oneDNN's bf16 matmul costs about the same for 1 to 8 rows, while the plain BLAS path is
        # linear in rows but twice as fast for one (measured at 49M: 3.5 / 5.6 / 10.7 ms for 1 / 2 / 4 rows
        # against 7.0 / 7.0 / 7.9). Pick by row count.
        if (self.fused is not None and (positions is None) == (attn_mask is None) and cache is not None
                and self.fused.takes(cache) and self.fused.usable()
                and (attn_mask is None or tokens.shape[0] == 1)):
            tree = FusedForward.tree(positions, attn_mask, cache)
            if tree is not False:
                n = tokens.shape[1] if num_logits is None else num_logits
                return self.fused.forward(tokens, cache, hidden_layers, n, tree)
        few_rows = tokens.numel() <= 2 and tokens.device.type == "cpu"
        with _onednn(enabled=not few_rows):
            return self._forward(tokens, positions, cache, hidden_layers, num_logits, attn_mask)

    def _forward(self, tokens, positions, cache, hidden_layers, num_logits, attn_mask=None):
        bsz, seqlen = tokens.shape
        start = cache.length if cache is not None else 0  # rows before the new ones (the mask's columns)
        if positions is None:
            first = cache.next_position if cache is not None else 0  # a compressed cache's run ahead of its rows
            positions = torch.arange(first, first + seqlen, device=tokens.device).expand(bsz, seqlen)
        x = self.model.embed_tokens(tokens)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        causal = attn_mask is None
        mask = causal_mask(start, seqlen, tokens.device) if causal else attn_mask
        wanted = set(hidden_layers)
        hidden = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.model.layers, start=1):
            x = layer(x, cos, sin, cache, mask, causal)
            if i in wanted:
                hidden[i] = x
        if cache is not None:
            cache.advance(seqlen)
        n = seqlen if num_logits is None else num_logits
        if n == 0:
            return x.new_zeros(bsz, 0, self.config.vocab_size), hidden
        logits = self.lm_head(self.model.norm(x[:, seqlen - n :]))
        return logits, hidden

    def forward_packed(
        self,
        tokens: torch.Tensor,  # [N] every request's new tokens, back to back
        batch: PackedBatch,
        logit_rows: torch.Tensor,  # [M] packed rows that need logits
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [M, V], {layer: hidden [N, d]}
        """One forward over a ragged batch, each segment after its own cache's committed entries (see PackedBatch).
        Commits every segment's new tokens to its cache."""
        if self.fused is not None and self.fused.takes(batch) and self.fused.usable():
            own = batch.own_positions or (None,) * len(batch.segments)
            trees = [FusedForward.tree(p, m if p is not None else None, s.cache)
                     for s, m, p in zip(batch.segments, batch.masks, own)]
            if all(t is not False for t in trees):  # else a mask decoder.c cannot honour: the torch path
                return self.fused.forward_packed(tokens, batch, logit_rows, hidden_layers, trees)
        few_rows = tokens.numel() <= 2 and tokens.device.type == "cpu"
        with _onednn(enabled=not few_rows):
            positions = batch.positions(tokens.device)[None]  # [1, N]
            x = self.model.embed_tokens(tokens[None])
            cos, sin = self.model.rotary_emb(positions, x.dtype)
            wanted = set(hidden_layers)
            hidden = {0: x[0]} if 0 in wanted else {}
            for i, layer in enumerate(self.model.layers, start=1):
                x = layer(x, cos, sin, batch, None)
                if i in wanted:
                    hidden[i] = x[0]
            batch.advance()
            if logit_rows.numel() == 0:
                return x.new_zeros(0, self.config.vocab_size), hidden
            return self.lm_head(self.model.norm(x[0, logit_rows])), hidden
