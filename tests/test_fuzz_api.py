"""Hypothesis over the Python API's inputs (issue 19): SamplingParams(...) and LLM.generate on a tiny random model.

SamplingParams from any values (floats with nan/inf/subnormal/huge, huge ints, bools, strings, lists, None) is a
valid object or a ConfigError, never another exception, and a valid one holds the documented ranges. LLM.generate
with arbitrary valid params and token-id prompts (some out of the vocabulary, some empty) returns at most max_tokens
tokens or raises a VerispecError; at temperature 0 the speculative output equals the plain one. Seeded and bounded;
VERISPEC_FUZZ_EXAMPLES scales the run (scripts/fuzz.sh).
"""

from __future__ import annotations

import math
import os
from functools import cache

from conftest import make_tokenizer, tiny_model
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from verispec.api import LLM
from verispec.config import SamplingParams
from verispec.errors import ConfigError, VerispecError

EXAMPLES = int(os.environ.get("VERISPEC_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))

floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
ints = st.integers() | st.sampled_from([-(1 << 63), (1 << 63) - 1, 10**400, -(10**400)])
anything = st.none() | st.booleans() | ints | floats | st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=3)


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `strategy`, sometimes any value of another type."""
    return strategy | anything


@FUZZ
@given(max_tokens=maybe(ints), temperature=maybe(floats), top_k=maybe(ints), top_p=maybe(floats),
       seed=maybe(ints | st.none()), stop=maybe(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)),
       ignore_eos=maybe(st.booleans()))
def test_sampling_params_is_valid_or_config_error(**kw):
    try:
        p = SamplingParams(**kw)
    except ConfigError:
        return
    assert p.max_tokens >= 1
    assert 0 <= p.temperature < math.inf and 0 < p.top_p <= 1 and p.top_k >= 0
    assert isinstance(p.stop, tuple) and all(isinstance(s, str) and s for s in p.stop)


@cache
def llm(drafter: str | None) -> LLM:
    tokenizer = make_tokenizer()
    return LLM(tiny_model(vocab_size=tokenizer.vocab_size), drafter=drafter, k=3, tokenizer=tokenizer)


VOCAB = make_tokenizer().vocab_size
temperatures = st.just(0.0) | st.floats(0, 2) | st.sampled_from([1e-38, 5e-324, 1e-6])
valid_params = st.builds(
    SamplingParams, max_tokens=st.integers(1, 40), temperature=temperatures, top_k=st.integers(0, VOCAB + 5),
    top_p=st.floats(0, 1, exclude_min=True) | st.sampled_from([1e-50, 5e-324]),
    seed=st.none() | st.integers(0, (1 << 63) - 1), stop=st.lists(st.sampled_from(["\n", "a", "de", "):"]), max_size=2),
    ignore_eos=st.booleans(),
)
prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24) | st.lists(st.integers(-3, VOCAB + 3),
                                                                                  max_size=4)


@FUZZ
@given(drafter=st.sampled_from([None, "ngram", "model"]), prompt=prompts, params=valid_params)
def test_generate_is_bounded_and_exact(drafter, prompt, params):
    model = llm(drafter)
    try:
        (result,) = model.generate([prompt], params)
    except VerispecError:
        assert not prompt or not all(0 <= t < VOCAB for t in prompt), "a valid prompt was refused"
        return
    assert 1 <= len(result.token_ids) <= params.max_tokens
    assert all(0 <= t < VOCAB for t in result.token_ids)
    assert result.finish_reason in ("stop", "length")
    if params.greedy and drafter is not None:
        (plain,) = model.generate([prompt], params, plain=True)
        assert result.token_ids == plain.token_ids
