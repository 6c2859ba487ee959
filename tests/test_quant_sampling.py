"""Sampling on a quantized target follows that quantized target's distribution (issue 20's exactness contract):
the position-pairwise statistical test of test_exactness and test_engine, on int4 and int8 targets, through decode()
and through the engine, for the draft-model, prompt-lookup (point-mass q) and self drafters. The negative control
is the dense model the quantized one was made from: a different distribution, which the same check must tell
apart from the quantized one's (so "speculation on a quantized target is exact" is not read off a check that
cannot see the quantization)."""

from __future__ import annotations

import numpy as np
import pytest
from _markov import tv_limit
from conftest import tiny_model
from test_engine import N_STAT, engine_samples
from test_exactness import S_N, S_PARAMS, S_PROMPT, SV, check_pair, exact_pair_joints, failures, sample_runs

from verispec.drafters import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.model.checkpoint import load_model, save_model
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint

# test_exactness's statistical models (8 tokens, one layer). std 0.3 and groups of 64: int4's rounding moves the
# target's (x1, x2) joint by TV 0.10, twice what N_BIG runs resolve, while every pair stays likely (the negative
# control needs the two distributions apart; at int8 they are 0.01 apart and no affordable run tells them apart).
CFG = {"vocab_size": SV, "max_position_embeddings": 16, "num_hidden_layers": 1}
SCHEMES = {"w4a16-g64": QuantizeConfig(scheme="w4a16", group_size=64), "w8a16": QuantizeConfig(scheme="w8a16"),
           "w4a8-g64": QuantizeConfig(scheme="w4a8", group_size=64)}  # int8 activations: the same contract
N_BIG = 12_000  # TV limit 2 sqrt(64 / (2 pi N)) = 0.058


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("stat-dense")
    save_model(tiny_model(0, 0.3, **CFG), d)
    return d


def _quantize(dense_dir, tmp_path_factory, name: str):
    d = tmp_path_factory.mktemp("stat-quant")
    quantize_checkpoint(dense_dir, d, SCHEMES[name], progress=False)
    return load_model(d, "fp32")


@pytest.fixture(scope="module", params=list(SCHEMES))
def quantized(request, dense_dir, tmp_path_factory):
    return _quantize(dense_dir, tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(1, 0.25, **CFG)


@pytest.mark.parametrize("drafter", ["model", "ngram", "self"])
def test_decode_samples_from_the_quantized_target(quantized, draft, drafter):
    make = {"model": lambda: ModelDrafter(draft), "ngram": NgramDrafter, "self": lambda: ModelDrafter(quantized)}
    samples = sample_runs(quantized, make[drafter], S_N // 2)
    assert failures(samples, exact_pair_joints(quantized, S_PROMPT, S_PARAMS)) == []


@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_engine_samples_from_the_quantized_target(quantized, draft, policy):
    samples = engine_samples(quantized, draft, N_STAT, policy)
    assert failures(samples, exact_pair_joints(quantized, S_PROMPT, S_PARAMS)) == []


def test_check_tells_the_int4_target_from_the_dense_one(dense_dir, draft, tmp_path_factory):
    """Negative control: N_BIG requests through the engine on the int4 target pass the check against its exact
    joint, while the same requests on the dense model it was made from fail it (and pass against their own)."""
    target = _quantize(dense_dir, tmp_path_factory, "w4a16-g64")
    dense = load_model(dense_dir, "fp32")
    jq, jd = exact_pair_joints(target, S_PROMPT, S_PARAMS), exact_pair_joints(dense, S_PROMPT, S_PARAMS)
    limit = tv_limit(SV * SV, N_BIG)
    assert 0.5 * np.abs(jq[0] - jd[0]).sum() > 1.5 * limit and min(jq[0].min(), jd[0].min()) * N_BIG > 5
    assert failures(engine_samples(target, draft, N_BIG, "fixed"), jq) == []
    from_dense = engine_samples(dense, draft, N_BIG, "fixed")
    assert failures(from_dense, jd) == []
    tv, pval, _ = check_pair(from_dense[:, [0, 1]], jq[0])
    assert tv >= limit and pval <= 1e-3, (tv, limit, pval)
