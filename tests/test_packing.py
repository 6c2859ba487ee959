"""Packed CPU matmuls (verispec.model.packing, native packs): same results as F.linear, same state dict,
and a plain F.linear wherever a packed weight would be wrong (gradients, changed or moved weights, other dtypes).
The native kernels themselves are tested in test_native."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import no_native_reason, tiny_config
from verispec.cache import KVCache
from verispec.model import Transformer, load_model, save_model
from verispec.model.packing import PackedLinear, packing_supported

needs_packing = pytest.mark.skipif(not packing_supported(torch.zeros(1, 1)), reason=no_native_reason())


def _linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(48, 80, bias=bias).eval()


def _models(pack: bool = True) -> tuple[Transformer, Transformer]:
    """The same random weights, as built (plain modules) and as load_model prepares them (fused, packed)."""
    torch.manual_seed(0)
    plain = Transformer(tiny_config(tie_word_embeddings=True))
    for p in plain.parameters():
        nn.init.normal_(p, std=0.2)
    prepared = Transformer(tiny_config(tie_word_embeddings=True))
    prepared.load_state_dict(plain.state_dict())
    prepared.eval().fuse_projections()
    return plain.eval(), prepared.pack_weights() if pack else prepared


@needs_packing
@pytest.mark.parametrize("shape", [(1, 48), (9, 48), (2, 5, 48), (3, 300, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear(shape, bias):
    lin = _linear(bias)
    packed = PackedLinear(lin)
    assert packed.packed is not None
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a slice of a transposed tensor) gives the same result
    xt = torch.randn(48, 9).t()
    torch.testing.assert_close(packed(xt), F.linear(xt, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_the_parameters():
    lin = _linear()
    packed = PackedLinear(lin)
    assert packed.weight is lin.weight and packed.bias is lin.bias
    assert set(packed.state_dict()) == {"weight", "bias"}


@needs_packing
def test_gradients_flow_through_the_plain_path():
    """The packed op has no autograd: with a gradient wanted, the result and the gradient are F.linear's."""
    lin = _linear()
    packed = PackedLinear(lin)
    x = torch.randn(4, 48, requires_grad=True)
    packed(x).square().sum().backward()
    want = x.grad.clone()
    x.grad = None
    F.linear(x, lin.weight, lin.bias).square().sum().backward()
    torch.testing.assert_close(want, x.grad)
    assert lin.weight.grad is not None


@needs_packing
def test_changed_weight_is_not_served_stale():
    lin = _linear()
    packed = PackedLinear(lin)
    x = torch.randn(3, 48)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: same storage, new version
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias))
        lin.weight.data = torch.randn(80, 48)  # new storage behind the same Parameter
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias))


def test_float64_is_not_packed():
    lin = _linear().double()
    packed = PackedLinear(lin)
    assert packed.packed is None
    x = torch.randn(2, 48, dtype=torch.float64)
    torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)


@pytest.mark.skipif(not packing_supported(torch.zeros(1, 1, dtype=torch.bfloat16)), reason=no_native_reason())
def test_bf16_pack_is_a_bf16_matmul():
    """fp32 accumulation of the bf16 operands, rounded to bf16: at most one bf16 rounding step from bf16 F.linear
    at several rows; at one row (native: the same sequential fp32 sum; oneDNN packs: F.linear itself) equal."""
    lin = _linear().to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.packed is not None
    x = torch.randn(9, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = packed(x), F.linear(x, lin.weight, lin.bias)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(packed(x[:1]), F.linear(x[:1], lin.weight, lin.bias), rtol=0, atol=0)


@needs_packing
def test_prepared_model_keeps_its_state_dict_and_tied_head():
    plain, prepared = _models()
    assert prepared.packed
    assert prepared.lm_head.weight is prepared.model.embed_tokens.weight
    a, b = plain.state_dict(), prepared.state_dict()
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@needs_packing
@pytest.mark.parametrize("new_tokens", [1, 2, 9])
def test_prepared_model_matches_plain_model(new_tokens):
    """Logits after a cached prefix, for a decode step (1), a short and a full verify step (2, 9)."""
    plain, prepared = _models()
    tokens = torch.randint(0, plain.config.vocab_size, (1, 20 + new_tokens), generator=torch.Generator().manual_seed(1))
    outs = []
    with torch.inference_mode():
        for m in (plain, prepared):
            cache = KVCache.for_model(m, max_len=64)
            m(tokens[:, :20], cache=cache)
            outs.append(m(tokens[:, 20:], cache=cache)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


@needs_packing
def test_moving_a_packed_model_to_bf16_falls_back():
    """After .to(bf16) the stale fp32 packs are ignored: bit for bit what the same model unpacked computes."""
    _, fused = _models(pack=False)
    _, packed = _models()
    tokens = torch.arange(12)[None]
    with torch.inference_mode():
        want = fused.to(torch.bfloat16)(tokens)[0]
        got = packed.to(torch.bfloat16)(tokens)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_packing
def test_load_model_packs_unless_asked_not_to(tmp_path):
    plain, _ = _models()
    save_model(plain, tmp_path / "m")
    assert load_model(tmp_path / "m").packed
    assert not load_model(tmp_path / "m", pack=False).packed
    assert load_model(tmp_path / "m", dtype="bf16").packed == packing_supported(torch.zeros(1, 1, dtype=torch.bfloat16))


@needs_packing
def test_no_packing_when_the_packs_would_not_fit(monkeypatch):
    """The packs are fp32 copies: a model whose packs would take over a quarter of the memory stays unpacked."""
    import verispec.model.transformer as transformer

    plain, _ = _models(pack=False)
    need = 4 * sum(p.numel() for name, p in plain.named_parameters() if name.endswith("proj.weight"))
    need += 4 * plain.lm_head.weight.numel()
    monkeypatch.setattr(transformer, "physical_memory", lambda: 4 * need - 4)
    assert not _models(pack=False)[1].pack_weights().packed
    monkeypatch.setattr(transformer, "physical_memory", lambda: 4 * need)
    assert _models(pack=False)[1].pack_weights().packed
