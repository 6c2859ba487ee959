"""The Python API (verispec.api.LLM): loading a checkpoint, picking a drafter by name, text and token-id
prompts, lists of prompts, streaming, and the plain baseline; speculative greedy output equals plain output
through it."""

from __future__ import annotations

import pytest
from conftest import tiny_model

import verispec
from verispec.api import LLM
from verispec.config import SamplingParams
from verispec.decode import GenerationResult, StreamEvent
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.errors import CheckpointError, ConfigError
from verispec.metrics import SpecStats
from verispec.model import save_model

TEXT = "def add(a, b):\n    return a + b\n"
PARAMS = SamplingParams(max_tokens=24)


@pytest.fixture
def draft_dir(tmp_path, tokenizer):
    """A second checkpoint (different weights, same tokenizer) to draft with."""
    m = tiny_model(5, 0.2, vocab_size=tokenizer.vocab_size)
    save_model(m, tmp_path / "draft")
    tokenizer.save(tmp_path / "draft")
    return tmp_path / "draft"


def drafter_spec(name: str, draft_dir) -> str | None:
    specs = {"none": None, "ngram": "ngram", "ngram:2": "ngram:2", "self": "model",
             "model-dir": f"model:{draft_dir}"}
    return specs[name]


def check_result(res, tokenizer, max_tokens: int) -> None:
    assert isinstance(res, GenerationResult)
    assert isinstance(res.stats, SpecStats)
    assert isinstance(res.text, str) and res.text == tokenizer.decode(res.token_ids)
    assert res.finish_reason in ("stop", "length")
    assert 1 <= len(res.token_ids) <= max_tokens
    assert res.stats.num_output_tokens == len(res.token_ids)
    d = res.to_dict()
    assert set(d) == {"text", "token_ids", "finish_reason", "stop_reason", "stats"}
    assert d["stats"]["num_output_tokens"] == len(res.token_ids)


@pytest.mark.parametrize("name", ["none", "ngram", "ngram:2", "self", "model-dir"])
def test_generate_text_prompt_equals_plain(name, checkpoint_dir, draft_dir, tokenizer):
    """LLM(checkpoint, drafter=...) builds the named drafter; a text prompt gives one GenerationResult whose
    greedy tokens and text equal the plain (plain=True) run's."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter=drafter_spec(name, draft_dir), k=4)
    expected_type = {"none": type(None), "ngram": NgramDrafter, "ngram:2": NgramDrafter, "self": ModelDrafter,
                     "model-dir": ModelDrafter}[name]
    assert isinstance(llm.drafter, expected_type)
    if name == "self":
        assert llm.drafter.model is llm.target
    if name == "model-dir":
        assert llm.drafter.model is not llm.target
    out = llm.generate(TEXT, PARAMS)
    assert isinstance(out, list) and len(out) == 1
    res = out[0]
    check_result(res, tokenizer, PARAMS.max_tokens)
    assert res.prompt_token_ids == tokenizer.encode(TEXT)
    base = llm.generate(TEXT, PARAMS, plain=True)[0]
    assert base.stats.num_drafts == 0
    assert (res.token_ids, res.text, res.finish_reason) == (base.token_ids, base.text, base.finish_reason)
    if name != "none":
        assert res.stats.num_drafts > 0 or name.startswith("ngram")


def test_token_id_prompt_equals_text_prompt(checkpoint_dir, tokenizer):
    """A token-id prompt (list or tuple of ints) is one prompt, and gives the same result as the text it
    encodes."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter="ngram", k=2)
    ids = tokenizer.encode(TEXT)
    by_text = llm.generate(TEXT, PARAMS)[0]
    for prompt in (ids, tuple(ids)):
        out = llm.generate(prompt, PARAMS)
        assert len(out) == 1
        assert out[0].prompt_token_ids == ids
        assert (out[0].token_ids, out[0].text) == (by_text.token_ids, by_text.text)


def test_list_of_prompts(checkpoint_dir, tokenizer):
    """A list of prompts (text and token ids mixed) gives one result per prompt, in order, each equal to the
    result of generating that prompt alone."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter="model", k=3)
    prompts = ["The quick brown fox", tokenizer.encode("class Point:"), "naïve café ✓"]
    out = llm.generate(prompts, PARAMS)
    assert len(out) == 3
    for p, res in zip(prompts, out):
        check_result(res, tokenizer, PARAMS.max_tokens)
        alone = llm.generate(p, PARAMS)[0]
        assert res.prompt_token_ids == alone.prompt_token_ids
        assert (res.token_ids, res.text) == (alone.token_ids, alone.text)
    assert llm.generate([], PARAMS) == []


@pytest.mark.parametrize("name", ["ngram", "self", "model-dir"])
def test_stream_concatenates_to_result(name, checkpoint_dir, draft_dir, tokenizer):
    """LLM.stream yields StreamEvents whose token ids and text deltas concatenate to the final result (carried
    by the last event only), which equals generate()'s result."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter=drafter_spec(name, draft_dir), k=4)
    params = SamplingParams(max_tokens=30, stop=("zzz-not-there",))
    events = list(llm.stream(TEXT, params))
    assert all(isinstance(e, StreamEvent) for e in events)
    assert all(e.result is None for e in events[:-1]) and events[-1].result is not None
    res = events[-1].result
    assert "".join(e.text for e in events) == res.text
    assert [t for e in events for t in e.token_ids] == res.token_ids
    assert len(events) == res.stats.num_rounds
    gen = llm.generate(TEXT, params)[0]
    assert (gen.token_ids, gen.text, gen.finish_reason) == (res.token_ids, res.text, res.finish_reason)


def test_self_draft_stats_through_api(checkpoint_dir):
    """Self-drafting through the API accepts everything: tau == k + 1 and acceptance rate 1.0 (24 = 6 rounds
    of 4)."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter="model", k=3)
    res = llm.generate([5, 6, 7, 8, 9], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(res.token_ids) == 24 and res.finish_reason == "length"
    assert res.stats.tau == 4.0 and res.stats.acceptance_rate == 1.0 and res.stats.num_drafts == 6


def test_seeded_sampling_through_api(checkpoint_dir):
    """Seeded sampling through the API is reproducible; another seed gives another output."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter="model", k=4)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
    a = llm.generate(TEXT, params)[0].token_ids
    assert llm.generate(TEXT, params)[0].token_ids == a
    other = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=12, ignore_eos=True)
    assert llm.generate(TEXT, other)[0].token_ids != a


def test_llm_is_exported_lazily():
    """`from verispec import LLM` gives the API class."""
    assert verispec.LLM is LLM


@pytest.mark.parametrize("spec", ["nope", "nope:arg", "ngram:x", "ngram:3-1"])
def test_bad_drafter_spec_raises_config_error(spec, checkpoint_dir):
    """An unknown drafter name or bad ngram sizes raise ConfigError."""
    with pytest.raises(ConfigError):
        LLM(checkpoint_dir, drafter=spec)


def test_drafter_with_other_vocabulary_is_refused(tmp_path, checkpoint_dir):
    """model:DIR with a different vocabulary raises CheckpointError instead of drafting garbage ids."""
    save_model(tiny_model(5, vocab_size=97), tmp_path / "other")
    with pytest.raises(CheckpointError):
        LLM(checkpoint_dir, drafter=f"model:{tmp_path / 'other'}")


def test_text_prompt_without_tokenizer_raises(tmp_path):
    """Without a tokenizer (a Transformer instance, or a checkpoint without tokenizer.json) a text prompt
    raises ConfigError, while token-id prompts still work and return text=None."""
    m = tiny_model(vocab_size=97)
    save_model(m, tmp_path / "bare")
    for target in (m, tmp_path / "bare"):
        llm = LLM(target, dtype="fp32", drafter="ngram")
        assert llm.tokenizer is None
        with pytest.raises(ConfigError):
            llm.generate("hello", PARAMS)
        with pytest.raises(ConfigError):
            llm.stream("hello", PARAMS)
        res = llm.generate([1, 2, 3, 1, 2], SamplingParams(max_tokens=8))[0]
        assert len(res.token_ids) == 8 and res.text is None


def test_invalid_prompt_through_api_raises(checkpoint_dir):
    """Empty and out-of-vocabulary prompts raise ConfigError through the API too."""
    llm = LLM(checkpoint_dir, dtype="fp32", drafter="ngram")
    for bad in ([[]], [[1, 2, 10**6]], [[-3]]):
        with pytest.raises(ConfigError):
            llm.generate(bad, PARAMS)


def test_one_dtype_default(checkpoint_dir):
    """LLM() and the CLI's generate, serve, bench and profile load the target in one default dtype, the config's
    DEFAULT_DTYPE (bf16); the tests above pass dtype="fp32", where the exactness contract is tested."""
    import inspect

    import torch

    from verispec.cli import build_parser
    from verispec.config import DEFAULT_DTYPE

    assert DEFAULT_DTYPE == "bf16"
    assert inspect.signature(LLM).parameters["dtype"].default == DEFAULT_DTYPE
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["serve"], ["bench"], ["profile"]):
        assert parser.parse_args(argv).dtype == DEFAULT_DTYPE, argv
    assert LLM(checkpoint_dir).target.dtype == torch.bfloat16
