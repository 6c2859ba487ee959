"""Parity of verispec's Transformer with Hugging Face transformers (Llama, Llama-3 RoPE, Mistral, Qwen2, Qwen3).

Tiny random fp32 models are built with transformers, saved with `save_pretrained` and loaded with
`verispec.model.load_model` (and the other way round with `save_model` -> `from_pretrained`). Weights are drawn
with std 0.2 (as in conftest) so attention is not uniform and RoPE / biases / norms visibly move the logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import tiny_model

from verispec.cache import KVCache
from verispec.config import SamplingParams
from verispec.decode import decode
from verispec.model import Transformer, load_model, save_model

VOCAB = 128
SEQ = 20
CHUNKS = (12, 3, 5)
ATOL = 1e-5

HF_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    # No special tokens: neither HF generate nor verispec decode may stop before max_new_tokens.
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    # head_dim 16, theta 5e5: wavelengths 6.3, 33.5, 178, ... -> one unscaled, one smoothed, the rest scaled.
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}

# name -> (config class, model class, config overrides)
CASES = {
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


def _hf_model(config_cls: str, model_cls: str, seed: int = 0, **overrides):
    cfg = getattr(transformers, config_cls)(**{**HF_BASE, **overrides})
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # tied weights appear once
            p.normal_(std=0.2)
    return hf


def _ids(n: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(HF model, verispec model loaded from its save_pretrained directory)."""
    config_cls, model_cls, overrides = CASES[request.param]
    hf = _hf_model(config_cls, model_cls, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_model(path)


@torch.no_grad()
def test_logits_match_hf_without_cache(pair):
    """A full forward without a cache gives HF's logits within 1e-5 at every position."""
    hf, vs = pair
    ids = _ids()
    ref = hf(ids).logits
    out, _ = vs(ids)
    assert out.shape == ref.shape == (1, SEQ, VOCAB)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@torch.no_grad()
def test_logits_match_hf_with_chunked_cache(pair):
    """Feeding 12 + 3 + 5 tokens through a KVCache gives HF's full-sequence logits for each chunk."""
    hf, vs = pair
    ids = _ids()
    ref = hf(ids).logits
    cache = KVCache.for_model(vs)
    start = 0
    for n in CHUNKS:
        out, _ = vs(ids[:, start : start + n], cache=cache)
        torch.testing.assert_close(out, ref[:, start : start + n], atol=ATOL, rtol=0)
        start += n
        assert cache.length == start


@torch.no_grad()
def test_greedy_generation_matches_hf(pair):
    """verispec's plain greedy decode emits exactly HF generate(do_sample=False)'s 20 tokens."""
    hf, vs = pair
    prompt = _ids(8, seed=2)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = None
    ref = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20, min_new_tokens=20
    )[0, prompt.shape[1] :].tolist()
    assert len(ref) == 20
    out = decode(vs, prompt[0].tolist(), SamplingParams(max_tokens=20))
    assert out.token_ids == ref
    assert out.finish_reason == "length"


@torch.no_grad()
def test_hidden_layers_match_hf_hidden_states(pair):
    """hidden_layers index like HF hidden_states: 0 = embeddings, l = output of layer l (l < num_layers);
    the last layer is returned before the final norm (HF's last entry is after it)."""
    hf, vs = pair
    ids = _ids()
    ref = hf(ids, output_hidden_states=True).hidden_states
    num_layers = vs.config.num_hidden_layers
    assert len(ref) == num_layers + 1
    _, hidden = vs(ids, hidden_layers=range(num_layers + 1))
    assert sorted(hidden) == list(range(num_layers + 1))
    for layer in range(num_layers):
        torch.testing.assert_close(hidden[layer], ref[layer], atol=ATOL, rtol=0, msg=f"layer {layer}")
    torch.testing.assert_close(vs.model.norm(hidden[num_layers]), ref[num_layers], atol=ATOL, rtol=0)


@torch.no_grad()
def test_llama3_rope_scaling_is_applied(tmp_path):
    """The Llama-3 case is discriminating: the same weights without rope_scaling give clearly different logits,
    and the scaled verispec model matches HF's scaled one."""
    hf = _hf_model("LlamaConfig", "LlamaForCausalLM", rope_parameters=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path)
    vs = load_model(tmp_path)
    assert vs.config.rope_scaling["rope_type"] == "llama3"
    assert vs.config.rope_theta == 500000.0
    plain = Transformer(vs.config.replace(rope_scaling=None))
    plain.load_state_dict(vs.state_dict())
    ids = _ids(48)
    ref = hf(ids).logits
    torch.testing.assert_close(vs(ids)[0], ref, atol=ATOL, rtol=0)
    assert (plain(ids)[0] - ref).abs().max() > 1e-3


SAVE_CASES = {
    "llama-bias": dict(model_type="llama", attention_bias=True),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-rope": dict(
        model_type="llama", rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    ),
    "mistral": dict(model_type="mistral"),
    "qwen2": dict(model_type="qwen2", attention_bias=True),  # Qwen2 always has q/k/v biases
    "qwen3": dict(model_type="qwen3"),
}


@pytest.mark.parametrize("case", list(SAVE_CASES))
@torch.no_grad()
def test_saved_model_loads_in_transformers(case, tmp_path):
    """save_model writes a checkpoint transformers loads with every tensor used and none missing, giving
    verispec's logits within 1e-5."""
    vs = tiny_model(vocab_size=VOCAB, **SAVE_CASES[case])
    save_model(vs, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    hf.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.tie_word_embeddings == vs.config.tie_word_embeddings
    ids = _ids()
    torch.testing.assert_close(vs(ids)[0], hf(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_qwen3_attention_bias_matches_hf(tmp_path):
    """Qwen3 with attention_bias=True: HF puts a bias on q/k/v *and* o_proj; verispec must use all of them."""
    hf = _hf_model("Qwen3Config", "Qwen3ForCausalLM", attention_bias=True)
    hf.save_pretrained(tmp_path)
    vs = load_model(tmp_path)
    ids = _ids()
    torch.testing.assert_close(vs(ids)[0], hf(ids).logits, atol=ATOL, rtol=0)


@torch.no_grad()
def test_bf16_load_is_close_to_fp32(tmp_path):
    """Loading with dtype=bf16 casts every weight, runs (with its cache of bf16 values, attention in fp32) and stays
    near the fp32 logits."""
    hf = _hf_model("Qwen3Config", "Qwen3ForCausalLM")
    hf.save_pretrained(tmp_path)
    fp32 = load_model(tmp_path)
    bf16 = load_model(tmp_path, dtype="bf16")
    assert bf16.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ids = _ids()
    ref, _ = fp32(ids)
    out, _ = bf16(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert (out.float() - ref).abs().max() < 0.15, (out.float() - ref).abs().max()
    cache = KVCache.for_model(bf16)
    assert cache.k.dtype == bf16.kv_dtype  # bf16 where the native forward reads it, else fp32 (Transformer.kv_dtype)
    chunked = torch.cat([bf16(ids[:, :12], cache=cache)[0], bf16(ids[:, 12:], cache=cache)[0]], dim=1)
    assert (chunked.float() - ref).abs().max() < 0.15


@torch.no_grad()
def test_num_logits_returns_only_last_positions():
    """num_logits=n returns the last n positions' logits (equal to the full forward's), 0 skips the LM head,
    and the cache still commits every token."""
    m = tiny_model(vocab_size=VOCAB)
    ids = _ids(10)
    full, _ = m(ids)
    last, _ = m(ids, num_logits=1)
    assert last.shape == (1, 1, VOCAB)
    torch.testing.assert_close(last, full[:, -1:], atol=ATOL, rtol=0)
    three, _ = m(ids, num_logits=3)
    torch.testing.assert_close(three, full[:, -3:], atol=ATOL, rtol=0)
    cache = KVCache.for_model(m)
    none, _ = m(ids[:, :7], cache=cache, num_logits=0)
    assert none.shape == (1, 0, VOCAB) and cache.length == 7
    step, _ = m(ids[:, 7:], cache=cache, num_logits=1)
    assert step.shape == (1, 1, VOCAB) and cache.length == 10
    torch.testing.assert_close(step, full[:, -1:], atol=ATOL, rtol=0)
