"""Every kernel path this CPU runs (native.ISAS: AVX2 + FMA, AVX-512F, AVX-512 BF16), forced one at a time: each
computes a row alone (batch-invariant), all of them agree bit for bit, they match the fp32 reference, and the
target's native forward (kernels/decoder.c) equals the torch path of model/layers.py to rounding, so greedy bf16
speculation equals plain bf16 decoding on every path. Plus the checks every native wrapper makes before C."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import no_native_reason, tiny_model

from verispec.cache import KVCache, PackedBatch
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import build_drafter
from verispec.drafters.model import ModelDrafter
from verispec.kernels import native

BF16 = torch.bfloat16
needs_native = pytest.mark.skipif(not native.available(), reason=no_native_reason())


def _runnable() -> list[str]:
    return [isa for isa in native.ISAS if isa in native.cpu_features()] if native.available() else []


ISAS = _runnable()


@pytest.fixture(params=ISAS or [None])
def isa(request):
    if request.param is None:
        pytest.skip(no_native_reason())
    with native.use(request.param):
        yield request.param


def test_this_cpu_runs_the_best_path_it_has():
    if not native.available():
        pytest.skip(no_native_reason())
    assert native.isa() == ISAS[-1]
    assert "avx2" in ISAS  # every path builds on AVX2 + FMA


# ---- matmul -------------------------------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("n,k", [(80, 48), (37, 13), (1024, 512), (24, 1)])
@pytest.mark.parametrize("wdtype,xdtype", [(torch.float32, torch.float32), (BF16, BF16), (BF16, torch.float32)])
def test_every_path_computes_the_same_matmul(n, k, wdtype, xdtype):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = torch.randn(64, k, generator=g).to(xdtype)
    bias = native.pad_bias(torch.randn(n, generator=g))
    packed = native.pack(w)
    ref = (x.double() @ w.double().T + bias[:n].double()).float()
    results = {}
    for name in ISAS:
        with native.use(name):
            alone = torch.cat([native.linear(x[i : i + 1], packed, bias) for i in range(20)])
            for m in (1, 2, 5, 6, 7, 9, 12, 13, 20):
                assert torch.equal(native.linear(x[:m], packed, bias), alone[:m]), (name, m)
            results[name] = native.linear(x, packed, bias)
            assert torch.equal(results[name][:20], alone), name
    first = results[ISAS[0]]
    for name, got in results.items():
        assert torch.equal(got, first), f"{name} differs from {ISAS[0]}"
    tol = 1e-5 if xdtype == torch.float32 else 8e-3
    torch.testing.assert_close(first.float(), ref, rtol=tol, atol=tol * k**0.5)


# ---- the target's native forward ----------------------------------------------------------------------------------

FAMILIES = [dict(), dict(model_type="qwen2"), dict(model_type="qwen3"), dict(model_type="llama", attention_bias=True),
            dict(tie_word_embeddings=True)]


def _forwards(model, tokens, split: int):
    """Prefill, one verify step over the rest, and the same positions one token at a time."""
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=tokens.shape[1] + 4)
        prefill, hidden = model(tokens[:, :split], cache=cache, hidden_layers=(0, 1, 2))
        verify = model(tokens[:, split:], cache=cache)[0]
        cache.truncate(split)
        steps = torch.cat([model(tokens[:, i : i + 1], cache=cache)[0] for i in range(split, tokens.shape[1])], 1)
    return prefill, verify, steps, hidden


@needs_native
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: "-".join(f"{v}" for v in f.values()) or "llama")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the zoo target's heads
def test_native_forward_matches_the_torch_path(family, dtype, head_dim):
    model = tiny_model(3, head_dim=head_dim, **family).to(dtype).pack_weights()
    assert model.fused is not None
    tokens = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    native_out = _forwards(model, tokens, 21)
    fused, model.fused = model.fused, None
    torch_out = _forwards(model, tokens, 21)
    model.fused = fused
    assert torch.equal(native_out[1], native_out[2])  # a verify step gives each token what one-token steps give
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for got, want in zip(native_out[:3], torch_out[:3]):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **tol)
    for layer in (0, 1, 2):
        torch.testing.assert_close(native_out[3][layer].float(), torch_out[3][layer].float(), **tol)


# (query heads, key/value heads, head_dim, tokens, prefill rows): tiny_config's heads at three head dims; then a
# 41-row prefill (two key chunks, more than one query chunk) and a 9-row verify with G = 1, 2 and 3 (a group's odd
# query unpaired beside the pairs: on AVX-512 BF16 over a bf16 cache, pair_block2 beside one query's pair_block)
FORWARD_SHAPES = [(None, None, 16, 26, 17), (None, None, 32, 26, 17), (None, None, 64, 26, 17), (4, 2, 64, 50, 41),
                  (3, 3, 64, 50, 41), (3, 1, 128, 50, 41), (4, 2, 48, 50, 41), (4, 2, 80, 50, 41)]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,length,split", FORWARD_SHAPES)
def test_native_forward_is_the_same_on_every_path(isa, dtype, heads, kv_heads, head_dim, length, split):
    groups = {} if heads is None else dict(num_attention_heads=heads, num_key_value_heads=kv_heads)
    model = tiny_model(4, model_type="qwen3", head_dim=head_dim, **groups).to(dtype).pack_weights()
    tokens = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(2))
    prefill, verify, steps, _ = _forwards(model, tokens, split)
    assert torch.equal(verify, steps)
    with native.use(ISAS[0]):
        base = _forwards(model, tokens, split)
    assert torch.equal(prefill, base[0]) and torch.equal(verify, base[1]), f"{isa} differs from {ISAS[0]}"


@needs_native
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (3, 1, 64), (4, 1, 128), (6, 3, 48), (4, 2, 80),
                                              (4, 2, 72), (2, 1, 24)])
@pytest.mark.parametrize("t,cached", [(1, 70), (9, 61), (40, 0), (30, 33)])
def test_attention_is_the_same_on_every_path_and_each_query_as_alone(heads, kv_heads, d, t, cached):
    # head dims on and off the 16- and 64-wide p @ V passes, groups of 1-4 queries per key/value head, more than one
    # key chunk (32) and query chunk (32), and ragged softmax tails: every query as its own one-token step computes it
    gen = torch.Generator().manual_seed(d * 1000 + t * 10 + cached)
    s = cached + t
    ck, cv = (torch.randn(1, kv_heads, s, d, generator=gen) for _ in range(2))
    q = torch.randn(1, t, heads, d, generator=gen).transpose(1, 2)
    outs = {}
    for name in ISAS:
        with native.use(name):
            outs[name] = native.attention(q, ck, cv, True)
            for j in range(t):
                n = cached + j + 1
                alone = native.attention(q[:, :, j : j + 1], ck[:, :, :n], cv[:, :, :n], True)
                assert torch.equal(alone[:, :, 0], outs[name][:, :, j]), (name, j)
    for name in ISAS[1:]:
        assert torch.equal(outs[name], outs[ISAS[0]]), f"{name} differs from {ISAS[0]}"
    k64, v64 = (x.double().repeat_interleave(heads // kv_heads, 1) for x in (ck, cv))
    mask = torch.ones(t, s, dtype=torch.bool).tril(cached)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=mask)
    torch.testing.assert_close(outs[ISAS[0]].double(), ref, rtol=1e-5, atol=1e-5)


def _packed_and_alone(model):
    """Three sequences' new tokens through one packed forward after their own caches, and each run alone:
    (packed logits, packed hidden of layer 2, alone logits, alone hidden, the packed caches' lengths, expected)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in (7, 12, 3)]
    new = [torch.randint(0, 97, (n,), generator=g) for n in (1, 9, 4)]
    with torch.inference_mode():
        caches, alone = [], []
        for p, t in zip(prompts, new):
            c = KVCache.for_model(model, max_len=32)
            model(p[None], cache=c)
            caches.append(c)
            c2 = KVCache.for_model(model, max_len=32)
            model(p[None], cache=c2)
            logits, hidden = model(t[None], cache=c2, hidden_layers=(2,))
            alone.append((logits[0], hidden[2][0]))
        batch = PackedBatch.build(caches, [len(t) for t in new], torch.device("cpu"))
        rows = torch.arange(sum(len(t) for t in new))
        logits, hidden = model.forward_packed(torch.cat(new), batch, rows, hidden_layers=(2,))
    return (logits, hidden[2], torch.cat([a[0] for a in alone]), torch.cat([a[1] for a in alone]),
            [c.length for c in caches], [len(p) + len(t) for p, t in zip(prompts, new)])


@needs_native
def test_packed_batch_rows_equal_each_sequence_alone(isa):
    """The engine's packed forward: each segment after its own cache equals that sequence run alone."""
    model = tiny_model(5).to(BF16).pack_weights()
    logits, hidden, alone_logits, alone_hidden, lengths, expected = _packed_and_alone(model)
    assert lengths == expected
    assert torch.equal(logits, alone_logits)
    assert torch.equal(hidden, alone_hidden)


def test_batched_block_drafter_layers_equal_each_sequence_alone(isa):
    """kernels/blocklayer.c over several sequences' own caches: every draft, confidence and context cache is the
    one each sequence gets alone, bit for bit (its matmuls compute every row alone, attention is per sequence)."""
    from test_block_drafter import PROMPTS, _observed, make_block

    from verispec.drafters import BlockDrafter, DraftRequest

    target = tiny_model(0, 0.2)
    model = make_block(target, head="markov", confidence=True, seed=3).prepare_inference()
    out = {}
    for batched in (True, False):
        drafter = BlockDrafter(model, target)
        reqs = []
        for i, p in enumerate(PROMPTS[:2]):
            _observed(drafter, i, p, target)
            reqs.append(DraftRequest(i, p, 4, SamplingParams(), None))
        drafts = drafter.propose(reqs) if batched else [drafter.propose([r])[0] for r in reqs]
        out[batched] = drafts, [drafter._context(i) for i in range(2)]
    for a, b in zip(out[True][0], out[False][0]):
        assert a.tokens == b.tokens and torch.equal(a.confidence, b.confidence)
    for a, b in zip(out[True][1], out[False][1]):
        assert a.length == b.length and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@needs_native
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_bf16_greedy_speculation_equals_plain_on_every_path(isa, k, head_dim):
    target = tiny_model(2, 0.5, head_dim=head_dim).to(BF16).pack_weights()
    other = tiny_model(5, 0.5, head_dim=head_dim).to(BF16).pack_weights()
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [5, 17, 3, 44, 9, 60, 2, 5, 17, 3]
    plain = decode(target, prompt, params).token_ids
    for drafter in (ModelDrafter(target), ModelDrafter(other), build_drafter("ngram", target=target, dtype=BF16, device=torch.device("cpu"))):
        assert decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=k)).token_ids == plain


@needs_native
def test_a_changed_weight_falls_back_to_the_torch_path():
    model = tiny_model(6)
    tokens = torch.tensor([[3, 9, 27, 81 % 97]])
    with torch.inference_mode():
        assert model.forward_path == "native"
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(2)
    with torch.inference_mode():
        assert model.forward_path == "torch"
        got = model(tokens, cache=KVCache.for_model(model, max_len=8))[0]
        fused, model.fused = model.fused, None
        want = model(tokens, cache=KVCache.for_model(model, max_len=8))[0]
        model.fused = fused
    assert torch.equal(got, want)


# ---- what the wrappers refuse before C sees it ----------------------------------------------------------------------

@needs_native
def test_wrappers_refuse_what_would_be_read_past_a_buffer():
    w = torch.randn(40, 24)
    packed = native.pack(w)
    with pytest.raises(ValueError, match="24"):
        native.linear(torch.randn(3, 25), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.linear(torch.randn(3, 24, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="bias"):
        native.linear(torch.randn(3, 24), packed, torch.zeros(40))  # not pad_bias()ed
    with pytest.raises(ValueError, match="2-D"):
        native.pack(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="argmax"):
        native.argmax(torch.randn(3, 8, dtype=torch.float64))
    q, kv = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="attention"):
        native.attention(q.to(BF16), kv, kv, causal=True)  # a bf16 q read as fp32 would run past its end
    with pytest.raises(ValueError, match="attention"):
        native.attention(q, kv[..., :8], kv[..., :8], causal=True)
    with pytest.raises(ValueError, match="does not fit"):
        native.attention(torch.randn(1, 4, 9, 16), kv, kv, causal=True)  # 9 new tokens over 5 keys


@needs_native
def test_the_native_forward_refuses_bad_tokens_and_caches():
    model = tiny_model(7)
    decoder = model.fused.decoder
    cache = KVCache.for_model(model, max_len=8)
    k, v = cache.k[:, 0], cache.v[:, 0]
    rows = torch.tensor([0])
    with pytest.raises(ValueError, match="token ids"):
        decoder.forward(torch.tensor([97]), [(k, v, 0, 1)], rows)
    with pytest.raises(ValueError, match="overflow"):
        decoder.forward(torch.tensor([1, 2]), [(k, v, 7, 2)], rows)
    with pytest.raises(ValueError, match="cache 0"):
        decoder.forward(torch.tensor([1]), [(k[:1], v[:1], 0, 1)], rows)
    with pytest.raises(ValueError, match="rows"):
        decoder.forward(torch.tensor([1, 2]), [(k, v, 0, 1)], rows)
    with pytest.raises(ValueError, match="logit rows"):
        decoder.forward(torch.tensor([1]), [(k, v, 0, 1)], torch.tensor([1]))
    with pytest.raises(ValueError, match="hidden"):
        decoder.forward(torch.tensor([1]), [(k, v, 0, 1)], rows, hidden_layers=(3,))
    bf16_cache = KVCache(2, 2, 16, 8, dtype=BF16)  # not one decoder.c writes: the model takes the torch path
    with torch.inference_mode():
        got = model(torch.tensor([[1, 2]]), cache=bf16_cache)[0]
    assert got.shape == (1, 2, 97) and bf16_cache.length == 2


# ---- choosing a path ------------------------------------------------------------------------------------------------

def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=300)


@needs_native
def test_verispec_kernels_forces_a_path():
    res = _python("from verispec.kernels import native; print(native.isa())", VERISPEC_KERNELS="avx2")
    assert res.returncode == 0 and res.stdout.split() == ["avx2"], res.stderr


def test_a_cpu_without_avx2_falls_back_with_one_warning():
    res = _python("import warnings; warnings.simplefilter('always'); from verispec.kernels import native; "
                  "native._state['features'] = 0; print(native.available(), native.available())")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
    assert res.stderr.count("no AVX2 + FMA") == 1 and "differ from plain decoding" in res.stderr
