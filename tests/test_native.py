"""verispec's native CPU kernels (verispec.kernels.native): matmul, attention and the greedy DSpark head loop agree
with torch, and each row's result is bit for bit independent of the rest of the call (row count, thread count),
which makes a verify step compute exactly what one-token steps compute, in fp32 and in bf16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import no_native_reason, tiny_model
from verispec.cache import KVCache
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters.model import ModelDrafter
from verispec.kernels import native

needs_native = pytest.mark.skipif(not native.available(), reason=no_native_reason())
BF16 = torch.bfloat16


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _weights(n: int, k: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- matmul -----------------------------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 9, 12, 13, 20, 64])
@pytest.mark.parametrize("n,k", [(80, 48), (37, 13), (1024, 512)])
def test_linear_matches_torch(m, n, k):
    w, x = _weights(n, k), torch.randn(m, k)
    b = torch.randn(n)
    torch.testing.assert_close(native.linear(x, native.pack(w)), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(native.linear(x, native.pack(w), native.pad_bias(b)), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)
    wb, xb = w.to(BF16), x.to(BF16)
    got = native.linear(xb, native.pack(wb))
    assert got.dtype == BF16
    # fp32 accumulation rounded once to bf16: at most one bf16 step from torch's bf16 matmul
    torch.testing.assert_close(got.float(), F.linear(xb, wb).float(), rtol=8e-3, atol=8e-3 * k**0.5)
    # fp32 input on bf16 weights: the fp32 product of the same values
    torch.testing.assert_close(native.linear(x, native.pack(wb)), F.linear(x, wb.float()), rtol=1e-5, atol=1e-4)


@needs_native
def test_linear_takes_strided_and_batched_inputs():
    w = _weights(40, 24)
    xt = torch.randn(24, 9).t()  # rows not contiguous
    torch.testing.assert_close(native.linear(xt, native.pack(w)), F.linear(xt, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 24)
    torch.testing.assert_close(native.linear(x3, native.pack(w)), F.linear(x3, w), rtol=1e-5, atol=1e-5)
    assert native.linear(torch.randn(0, 24), native.pack(w)).shape == (0, 40)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_linear_rows_are_independent_of_the_batch(dtype, two_threads):
    """Each row alone, with one thread, equals the same row inside calls of 2..40 rows on two threads: bit for bit."""
    w = _weights(200, 96, dtype)
    packed = native.pack(w)
    x = torch.randn(40, 96).to(dtype)
    torch.set_num_threads(1)
    alone = torch.cat([native.linear(x[i : i + 1], packed) for i in range(40)])
    torch.set_num_threads(2)
    for m in (2, 6, 7, 9, 12, 13, 40):
        assert torch.equal(native.linear(x[:m], packed), alone[:m]), m


def _isas() -> list[str]:
    return [isa for isa in native.ISAS if isa in native.cpu_features()] if native.available() else []


@needs_native
@pytest.mark.parametrize("isa", _isas())
def test_bf16_rounding_is_round_to_nearest_even(isa):
    """The kernel's fp32 -> bf16 rounding of its outputs agrees with torch's, ties and specials included: each
    output is hi + lo of two bf16 inputs (exact in fp32), rounded once by the store."""
    vals = torch.tensor([1.0, 1.00390625, 1.01171875, 1.0 + 2**-9 + 2**-12, -2.5 - 2**-8, 3.0e38, -3.4e38,
                         float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.5e-38])
    hi = vals.to(BF16)
    lo = torch.where(hi.float().isfinite(), vals - hi.float(), torch.zeros(())).to(BF16)
    x = torch.stack([hi, lo], dim=1)  # [n, 2] bf16
    with native.use(isa):
        got = native.linear(x, native.pack(torch.ones(1, 2, dtype=BF16)))[:, 0]
    want = (hi.float() + lo.float()).to(BF16)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok]), (got, want)
    assert not torch.equal(want, hi)  # the case is not vacuous: some sums round away from hi


@needs_native
@pytest.mark.parametrize("isa", _isas())
def test_denormals_are_kept_except_by_vdpbf16ps(isa):
    """gemm.c's one documented difference between paths: vdpbf16ps flushes denormal inputs to zero."""
    x = torch.tensor([[1e-40, 1.0]]).to(BF16)
    with native.use(isa):
        got = native.linear(x, native.pack(torch.ones(1, 2, dtype=BF16))).float().item()
    want = 1.0 if isa == "avx512bf16" else (x.float().sum()).item()
    assert got == want


# ---- attention --------------------------------------------------------------------------------------------------

def _reference_attention(q, k, v, causal: bool) -> torch.Tensor:  # fp64, [B, H, T, D]
    t, s = q.shape[2], k.shape[2]
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t) if causal else None
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)


@needs_native
@pytest.mark.parametrize("t,cached", [(1, 0), (1, 37), (3, 5), (9, 40), (20, 0)])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (8, 8, 64), (2, 1, 80), (2, 2, 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_sdpa(t, cached, heads, kv_heads, d, causal):
    gen = torch.Generator().manual_seed(t * 100 + cached)
    cache_k = torch.randn(1, kv_heads, 64, d, generator=gen)  # a cache's storage, longer than what is used
    cache_v = torch.randn(1, kv_heads, 64, d, generator=gen)
    s = cached + t
    q = torch.randn(1, t, heads, d, generator=gen).transpose(1, 2)  # the model's [B, H, T, D] view
    k, v = cache_k[:, :, :s], cache_v[:, :, :s]
    got = native.attention(q, k, v, causal)
    assert got.shape == (1, heads, t, d)
    torch.testing.assert_close(got.double(), _reference_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)


@needs_native
def test_attention_queries_are_independent_of_the_batch(two_threads):
    """Each query against its own prefix of the cache, alone, equals the same query in a call of 9: bit for bit."""
    gen = torch.Generator().manual_seed(0)
    cache_k, cache_v = torch.randn(1, 2, 80, 16, generator=gen), torch.randn(1, 2, 80, 16, generator=gen)
    q = torch.randn(1, 9, 4, 16, generator=gen).transpose(1, 2)
    start = 50
    together = native.attention(q, cache_k[:, :, : start + 9], cache_v[:, :, : start + 9], True)
    for t in range(9):
        s = start + t + 1
        alone = native.attention(q[:, :, t : t + 1], cache_k[:, :, :s], cache_v[:, :, :s], True)
        assert torch.equal(alone[:, :, 0], together[:, :, t]), t


# ---- greedy Markov head -----------------------------------------------------------------------------------------

def _torch_markov_greedy(base, w1, w2, anchor):
    out, prev = [], anchor
    for j in range(base.shape[0]):
        prev = int((base[j] + w2 @ w1[prev]).argmax())
        out.append(prev)
    return out


@needs_native
@pytest.mark.parametrize("vocab,rank", [(97, 8), (5000, 64)])
def test_markov_greedy_matches_torch(vocab, rank, two_threads):
    gen = torch.Generator().manual_seed(vocab)
    base = torch.randn(8, vocab, generator=gen)
    w1, w2 = torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen) * 0.3
    got = native.markov_greedy(base, w1, w2.t().contiguous(), 5)
    assert got == _torch_markov_greedy(base, w1, w2, 5)
    torch.set_num_threads(1)
    assert native.markov_greedy(base, w1, w2.t().contiguous(), 5) == got


@needs_native
def test_markov_greedy_ties_nans_and_bad_tokens():
    vocab, rank = 4096, 4
    w1, w2t = torch.zeros(vocab, rank), torch.zeros(rank, vocab)
    base = torch.zeros(3, vocab)
    base[0, [7, 3000]] = 1.0  # a tie across the threads' halves: the lowest index, as torch.argmax
    base[1, 2500] = float("nan")  # a NaN wins, as in torch.argmax
    base[2, 11] = -1.0  # all others 0: the first of them
    assert native.markov_greedy(base, w1, w2t, 0) == [7, 2500, 0]
    assert [int(base[j].argmax()) for j in range(3)] == [7, 2500, 0]
    with pytest.raises(ValueError, match="out of range"):
        native.markov_greedy(base, w1, w2t, vocab)
    with pytest.raises(ValueError, match="contiguous fp32"):
        native.markov_greedy(base, w1, w2t.t(), 0)


@needs_native
def test_markov_greedy_over_a_draft_vocabulary(two_threads):
    """U and W2^T cut to a draft vocabulary's columns: the kernel returns token ids (not columns) and indexes W1,
    which keeps a row per token, by the token it drafted."""
    gen = torch.Generator().manual_seed(3)
    full, rank = 6000, 16
    ids = torch.randperm(full, generator=gen)[:2500].sort().values
    w1, w2 = torch.randn(full, rank, generator=gen), torch.randn(full, rank, generator=gen) * 0.3
    base = torch.randn(8, ids.numel(), generator=gen)
    out, prev = [], 4321
    for j in range(8):
        prev = int(ids[(base[j] + w2[ids] @ w1[prev]).argmax()])
        out.append(prev)
    got = native.markov_greedy(base, w1, w2[ids].t().contiguous(), 4321, vocab=ids)
    assert got == out
    with pytest.raises(ValueError, match="no vocab map"):
        native.markov_greedy(base, w1, w2[ids].t().contiguous(), 4321)
    with pytest.raises(ValueError, match="int64"):
        native.markov_greedy(base, w1, w2[ids].t().contiguous(), 4321, vocab=ids.int())
    bad = ids + full  # a map that points outside the vocabulary
    with pytest.raises(ValueError, match="out of range"):
        native.markov_greedy(base, w1, w2[ids].t().contiguous(), 4321, vocab=bad)


# ---- rmsnorm ----------------------------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("shape", [(1, 512), (2, 9, 64), (3, 37), (0, 16)])
def test_rmsnorm_matches_the_torch_module(shape):
    """native.rmsnorm is model.layers.RMSNorm in fp32 up to summation order (the block drafter's norms), each row
    alone: a row's result does not depend on the rows beside it."""
    from verispec.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(len(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    x = torch.randn(*shape, generator=gen) * 3
    got = native.rmsnorm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(got, norm(x), rtol=1e-5, atol=1e-6)
    if x.numel():
        rows = x.reshape(-1, shape[-1])
        assert torch.equal(native.rmsnorm(rows[-1:], norm.weight, norm.eps), got.reshape(-1, shape[-1])[-1:])
    with pytest.raises(ValueError, match="fp32"):
        native.rmsnorm(x.to(BF16), norm.weight, norm.eps)
    with pytest.raises(ValueError, match="fp32"):
        native.rmsnorm(x, norm.weight[:-1], norm.eps)


# ---- the model: a verify step computes what one-token steps compute ---------------------------------------------

@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_verify_step_logits_equal_one_token_steps(dtype):
    model = tiny_model(3).to(dtype).pack_weights()  # packs made for the model's dtype
    assert model.matmuls == "native"
    tokens = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=40)
        model(tokens[:, :21], cache=cache)
        together = model(tokens[:, 21:], cache=cache)[0]  # 9 positions in one forward
        cache.truncate(21)
        alone = torch.cat([model(tokens[:, i : i + 1], cache=cache)[0] for i in range(21, 30)], dim=1)
    assert torch.equal(together, alone)


@needs_native
@pytest.mark.parametrize("k", [1, 4, 8])
def test_bf16_greedy_equals_plain(k):
    """With batch-invariant kernels the bf16 contract is the fp32 one: greedy output token for token."""
    target = tiny_model(2, 0.5).to(BF16).pack_weights()
    drafter_model = tiny_model(5, 0.5).to(BF16).pack_weights()
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [5, 17, 3, 44, 9, 60, 2]
    plain = decode(target, prompt, params).token_ids
    for drafter in (ModelDrafter(target), ModelDrafter(drafter_model)):
        assert decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=k)).token_ids == plain


# ---- a bf16 model's KV cache in bf16 --------------------------------------------------------------------------

def _fp32_cache(model, max_len: int) -> KVCache:
    cfg = model.config
    return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_len, dtype=torch.float32)


@needs_native
@pytest.mark.parametrize("head_dim", [8, 24, 64])
def test_a_bf16_models_cache_is_bf16_and_gives_what_an_fp32_cache_gives(two_threads, head_dim):
    """A bf16 model's keys and values are bf16 values: its cache holds them in bf16 (half the bytes a step streams)
    and the native forward reads them as the fp32 values they are: a prefill, a verify step of 9, and a packed step
    of ragged sequences in one call. At head_dim 8 and 24 every logit and cache entry equals the fp32 cache's bit for
    bit; where the head dim is a multiple of 16 (the zoo's 64) the bf16 cache's scores are attention.c's pair scores
    (the same exact products, summed in vdpbf16ps's order), so the two agree to rounding."""
    from verispec.cache import PackedBatch

    model = tiny_model(3, head_dim=head_dim).to(BF16).pack_weights()
    assert model.kv_dtype == BF16 and KVCache.for_model(model, max_len=4).k.dtype == BF16
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (41, 17, 23)]
    out = {}
    with torch.inference_mode():
        for name, make in (("bf16", lambda: KVCache.for_model(model, max_len=64)),
                           ("fp32", lambda: _fp32_cache(model, 64))):
            caches = [make() for _ in prompts]
            logits = [model(p[:, :-9], cache=c)[0] for p, c in zip(prompts, caches)]  # prefills
            logits.append(model(prompts[0][:, -9:], cache=caches[0])[0])  # a verify step of 9 rows
            lengths = [1, 9, 4]  # one packed step: a decode row, a verify chain, a short chunk
            tokens = torch.cat([p[0, -9:][:n] if i else p[0, -1:] for i, (p, n) in enumerate(zip(prompts, lengths))])
            caches[0].truncate(caches[0].length - 1)  # its last row again, in the packed step
            batch = PackedBatch.build(caches, lengths, torch.device("cpu"))
            logits.append(model.forward_packed(tokens, batch, torch.arange(sum(lengths)))[0])
            out[name] = (logits, caches)
    same = torch.equal if head_dim % 16 else lambda a, b: torch.allclose(a.float(), b.float(), rtol=0.02, atol=0.02)
    for got, want in zip(out["bf16"][0], out["fp32"][0]):
        assert same(got, want)
    for got, want in zip(out["bf16"][1], out["fp32"][1]):
        assert got.k.dtype == BF16 and got.length == want.length
        assert same(got.k[..., : got.length, :].float(), want.k[..., : want.length, :])
        assert same(got.v[..., : got.length, :].float(), want.v[..., : want.length, :])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_prefill_split_over_threads_gives_each_row_a_one_token_steps_logits(dtype):
    """A prefill of more than 32 rows at dims past the tiny models' (several blocks of columns a matmul, norms and
    SiLU split over the threads, the zoo's head_dim): each row's logits equal a one-token step's at its position,
    and a one-thread prefill's, bit for bit."""
    model = tiny_model(2, hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=64)
    model = model.to(dtype).pack_weights()
    tokens = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    out = {}
    try:
        with torch.inference_mode():
            for threads in (2, 1):
                torch.set_num_threads(threads)
                cache = KVCache.for_model(model, max_len=48)
                out[threads] = model(tokens, cache=cache)[0]
            torch.set_num_threads(2)
            cache = KVCache.for_model(model, max_len=48)
            model(tokens[:, :1], cache=cache)
            steps = torch.cat([model(tokens[:, i : i + 1], cache=cache)[0] for i in range(1, 40)], 1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[2], out[1])
    assert torch.equal(out[2][:, 1:], steps)


@needs_native
def test_the_torch_path_reads_a_bf16_cache_as_fp32():
    """Where the native forward does not run (here: called past it), attention over a bf16 cache is the fp32 cache's:
    the same values, converted, never bf16 attention."""
    model = tiny_model(6).to(BF16).pack_weights()
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = [model._forward(tokens[:, :8], None, KVCache.for_model(model, max_len=16), (), None)[0]]
        want = [model._forward(tokens[:, :8], None, _fp32_cache(model, 16), (), None)[0]]
    assert torch.equal(got[0], want[0])


def test_only_a_bf16_model_with_the_native_forward_keeps_a_bf16_cache():
    from conftest import tiny_config
    from verispec.model.transformer import Transformer

    assert tiny_model(1).kv_dtype == torch.float32  # fp32 model
    unpacked = Transformer(tiny_config()).to(BF16)  # no native forward: the torch path would convert every layer
    assert unpacked.fused is None and KVCache.for_model(unpacked, max_len=4).k.dtype == torch.float32


@needs_native
def test_an_fp32_models_decoder_refuses_a_bf16_cache():
    model = tiny_model(7)
    cache = KVCache(2, 2, 16, 8, dtype=BF16)
    with pytest.raises(ValueError, match="decoder cache: expected a CPU float32"):
        model.fused.decoder.forward(torch.tensor([1]), [(cache.k[:, 0], cache.v[:, 0], 0, 1)], torch.tensor([0]))


# ---- where the kernels cannot be used -----------------------------------------------------------------------------

def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=120)


def test_disabled_kernels_fall_back_to_torch():
    res = _run("from verispec.kernels import native; from conftest import tiny_model; "
               "print(native.available(), tiny_model().matmuls)", VERISPEC_NATIVE="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "False" and res.stdout.split()[1] == "torch"


def test_a_failed_build_warns_once_and_falls_back(tmp_path):
    res = _run("import warnings; warnings.simplefilter('always'); from verispec.kernels import native; "
               "print(native.available(), native.available())", CC="false", VERISPEC_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert res.stderr.count("native kernels unavailable") == 1 and "false failed" in res.stderr
        assert "differ from plain decoding" in res.stderr  # the warning says what exactness then means


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 5, 8, 13, 64, 8192])
def test_argmax_follows_torchs_rule(dtype, cols):
    """The greedy token of every row equals torch.argmax's: the first maximum (ties everywhere when values are
    rounded), a NaN wins (the first one), an all -inf row gives 0; strided rows too; as a tensor or a host list."""
    g = torch.Generator().manual_seed(cols)
    for trial in range(40):
        x = torch.randn(5, cols, generator=g).to(dtype)
        if trial % 2:
            x = x.round()  # many equal maxima
        if trial % 5 == 1:
            x[1, (trial * 7) % cols] = float("nan")
            x[1, -1] = float("nan")
        if trial % 5 == 2:
            x[2] = float("-inf")
        if trial % 5 == 3:
            x[3, ::2] = float("inf")
        for rows in (x, x[::2], x[:, : max(1, cols // 2)]):
            assert torch.equal(native.argmax(rows), rows.argmax(dim=-1)), (trial, rows.shape)
            assert native.argmax_ids(rows) == rows.argmax(dim=-1).tolist(), (trial, rows.shape)
