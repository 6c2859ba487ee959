"""Weight-only quantized models: int8 per channel (W8A16) and int4 group-wise (W4A16), symmetric.

What is quantized: the decoder layers' q/k/v/o/gate/up/down projections. Embeddings, norms and the LM head stay in
the checkpoint's dtype (bf16), as the seed's recipe keeps them: norms are tiny, the embedding is a lookup (no
matmul to speed up), and the LM head of a small-vocabulary model is a large share of its quality and is tied to the
embedding in the zoo's target, so quantizing it would quantize the embedding too.

Modules, lowest first: scheme (the frozen QuantScheme), rtn (scales and round-to-nearest), bits (int32 packing),
linear (QuantLinear, used by model.layers), format (compressed-tensors "pack-quantized" checkpoints, used by
model.checkpoint), drafter (a block drafter's own Linears quantized, loaded by drafters.block), gptq and
convert (making quantized checkpoints; they use the model). No imports here, so that
model.* can import quant.linear and quant.format without a cycle.
"""
