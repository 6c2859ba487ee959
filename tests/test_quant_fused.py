"""The target's native forward (kernels/decoder.c) on int8/int4 weight-only models: each quantized matmul is one
call of qgemm.c's vs_qlinear, the kernel QuantLinear calls on the per-layer path. The norms and SiLU around it are
decoder.c's, which equal the torch path to rounding (as for dense models), so the per-layer path is matched to
rounding; bit for bit are: a quantized matmul against gemm.c where both chains are the same sum (per-channel
power-of-two scales), any row count against one-token steps, packed batches against each sequence alone, every
kernel path against the first, and greedy speculation against plain decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import no_native_reason, tiny_config
from test_kernel_paths import ISAS, _forwards, _packed_and_alone, isa  # noqa: F401 (isa: the fixture forcing each kernel path)

from verispec.cache import KVCache
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.kernels import native
from verispec.model.transformer import Transformer
from verispec.errors import ConfigError
from verispec.quant.act8 import quantize_rows, w4a8_linear
from verispec.quant.linear import QuantLinear
from verispec.quant.rtn import dequantize, quantize_rtn
from verispec.quant.scheme import QuantScheme

BF16 = torch.bfloat16
pytestmark = pytest.mark.skipif(not native.qavailable(), reason=no_native_reason())
SCHEMES = {"w4a16-g32": QuantScheme.named("w4a16", 32), "w8a16": QuantScheme.named("w8a16"),
           "w4a8-g32": QuantScheme.named("w4a8", 32)}
PROJ = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def _quantized(seed: int, scheme: QuantScheme | None, dtype: torch.dtype, pow2: int = 0, **kw) -> Transformer:
    """A random tiny model with every projection a QuantLinear (RTN by `scheme`, scales in `dtype`), prepared as
    load_model does. pow2 = 4 or 8: per-channel int4/int8 with random power-of-two scales, and scheme None gives
    the dense model of the same seed holding q * scale (exact), whose gemm.c chain is then the same sum."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**kw))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model = model.to(dtype)
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for part, names in PROJ:
            for name in names:
                lin = getattr(getattr(layer, part), name)
                if pow2:
                    half = 2 ** (pow2 - 1)
                    q = torch.randint(-half, half, lin.weight.shape, generator=g, dtype=torch.int8)
                    scales = 2.0 ** -torch.randint(3, 7, (lin.out_features, 1), generator=g).float()
                else:
                    q, scales = quantize_rtn(lin.weight, scheme, dtype)
                if scheme is None:
                    with torch.no_grad():
                        lin.weight.copy_(dequantize(q, scales, dtype))
                else:
                    quant = QuantLinear(q, scales.to(dtype), pow2 or scheme.bits, lin.bias, scheme.act_bits)
                    setattr(getattr(layer, part), name, quant)
    return model.eval().fuse_projections().pack_weights()


@pytest.mark.parametrize("family", [dict(), dict(model_type="qwen2"), dict(model_type="qwen3")],
                         ids=["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_native_forward_runs_quantized_models_as_the_per_layer_path(family, scheme, dtype):
    model = _quantized(1, SCHEMES[scheme], dtype, **family)
    assert model.quantized and model.fused is not None and model.fused.decoder.quantized
    tokens = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert model.forward_path == "native"
    native_out = _forwards(model, tokens, 21)
    fused, model.fused = model.fused, None
    torch_out = _forwards(model, tokens, 21)  # QuantLinears through native.qlinear
    model.fused = fused
    assert torch.equal(native_out[1], native_out[2])  # a verify step gives each token what one-token steps give
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for got, want in zip(native_out[:3], torch_out[:3]):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **tol)
    for layer in (0, 1, 2):
        torch.testing.assert_close(native_out[3][layer].float(), torch_out[3][layer].float(), **tol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_quantized_matmuls_equal_dense_ones_where_the_chains_agree(isa, bits, dtype):
    """Per-channel power-of-two scales: qgemm.c's sum times the scale is gemm.c's sum over q * scale, exactly, so
    the quantized model's native forward equals the dense one's bit for bit (weights, biases, rounding points)."""
    quant = _quantized(2, QuantScheme.named("w8a16"), dtype, pow2=bits, model_type="qwen2")
    dense = _quantized(2, None, dtype, pow2=bits, model_type="qwen2")
    assert quant.fused.decoder.quantized and not dense.fused.decoder.quantized
    tokens = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    got, want = _forwards(quant, tokens, 11), _forwards(dense, tokens, 11)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    assert all(torch.equal(got[3][i], want[3][i]) for i in (0, 1, 2))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_every_row_count_gives_what_one_token_steps_give_on_every_path(isa, scheme, dtype):
    model = _quantized(3, SCHEMES[scheme], dtype, model_type="qwen3")
    tokens = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=24)
        model(tokens[:, :10], cache=cache)
        steps = []
        for i in range(10, 19):
            steps.append(model(tokens[:, i : i + 1], cache=cache)[0])
        steps = torch.cat(steps, 1)
        for m in range(1, 10):
            cache.truncate(10)
            assert torch.equal(model(tokens[:, 10 : 10 + m], cache=cache)[0], steps[:, :m]), m
    with native.use(ISAS[0]), torch.inference_mode():
        cache.truncate(10)
        assert torch.equal(model(tokens[:, 10:], cache=cache)[0], steps), f"{isa} differs from {ISAS[0]}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packed_batch_rows_equal_each_sequence_alone(isa, scheme):
    model = _quantized(5, SCHEMES[scheme], BF16)
    with torch.inference_mode():
        assert model.forward_path == "native"
    logits, hidden, alone_logits, alone_hidden, _, _ = _packed_and_alone(model)
    assert torch.equal(logits, alone_logits)
    assert torch.equal(hidden, alone_hidden)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_speculation_equals_plain_through_the_native_forward(isa, scheme):
    target = _quantized(2, SCHEMES[scheme], BF16)
    with torch.inference_mode():
        assert target.forward_path == "native"
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [5, 17, 3, 44, 9, 60, 2, 5, 17, 3]
    plain = decode(target, prompt, params).token_ids
    other = _quantized(7, SCHEMES[scheme], BF16)
    for drafter in (ModelDrafter(target), ModelDrafter(other), NgramDrafter()):
        for k in (1, 4, 8):
            assert decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=k)).token_ids == plain


@pytest.mark.parametrize("in_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("out_dtype", [torch.float32, BF16])
def test_w4a8_kernel_equals_the_torch_reference_bit_for_bit(isa, in_dtype, out_dtype):
    """qgemm.c's int8-activation matmul and quant.act8's torch reference (the path off the native kernels) compute
    the same chain: equal bit for bit on every kernel path, at every row count and tile shape (1-4, 5-9 and chunks
    of 8 past 9 rows; AVX2's 4), for groups of 32 and 128, a group of K not a multiple of 8, an all-zero group,
    rows past 32 (split over threads), and with a bias."""
    g = torch.Generator().manual_seed(0)
    for n, k, group in ((48, 64, 32), (40, 256, 128), (33, 20, 20)):
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        scales = torch.rand(n, k // group, generator=g) / 50
        bias = torch.randn(n, generator=g)
        packed = native.qpack(q, scales, group, 4, act_bits=8)
        x = torch.randn(41, k, generator=g).to(in_dtype)
        x[2, :group] = 0
        for m in (1, 3, 4, 5, 9, 10, 13, 41):
            for b in (None, bias):
                got = native.qlinear(x[:m].contiguous(), packed, b, out_dtype)
                want = w4a8_linear(x[:m], q, scales, b).to(out_dtype) if out_dtype == in_dtype else \
                    w4a8_linear(x[:m].float(), q, scales, b).to(out_dtype)
                assert torch.equal(got, want), (n, k, group, m)
                assert torch.equal(got[-1], native.qlinear(x[m - 1 : m].contiguous(), packed, b, out_dtype)[0])


def test_w4a8_rounds_activations_per_group_as_specified():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0, 127.0, 63.5, 0.0, 0.0]])
    q, s = quantize_rows(x, 4)
    assert torch.equal(s, torch.tensor([[2.0 / 127, 1.0]]))
    assert torch.equal(q[0, 1], torch.tensor([127.0, 64.0, 0.0, 0.0]))  # 63.5 rounds half to even
    assert torch.equal(q[0, 0], torch.round(torch.tensor([1.0, -2.0, 0.5, 0.0]) / (2.0 / 127)))
    assert torch.equal(quantize_rows(torch.zeros(1, 4), 4)[0], torch.zeros(1, 1, 4))  # amax 0: all zero, no NaN


def test_w4a8_needs_int4_weights_in_groups():
    with pytest.raises(ValueError, match="int8 activations"):
        native.qpack(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1), 32, 8, act_bits=8)
    with pytest.raises(ConfigError, match="w8a8"):
        QuantScheme(bits=8, group_size=32, act_bits=8)


def test_a_changed_quantized_buffer_falls_back_to_the_torch_path():
    model = _quantized(6, SCHEMES["w8a16"], torch.float32)
    with torch.inference_mode():
        assert model.forward_path == "native"
    model.model.layers[1].mlp.down_proj.scales.mul_(2)
    with torch.inference_mode():
        assert model.forward_path == "torch"
