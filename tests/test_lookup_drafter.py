"""`lookup:SPEC`: prompt lookup first, a learned drafter otherwise. Exact whichever drafts a round, the inner
drafter's state stays in sync across rounds it did not draft, and bad specs fail clearly."""

from __future__ import annotations

import numpy as np
import pytest
from _markov import tv_limit
from test_block_drafter import GREEDY, KINDS, N_STAT, PROMPTS, make_block, plain, stat_target, target  # noqa: F401
from test_exactness import ALPHA, S_PARAMS, S_PROMPT, SV, check_pair, exact_pair_joints

from verispec.config import EngineConfig, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import (
    BlockDrafter, DraftRequest, LookupFirstDrafter, ModelDrafter, NgramDrafter, build_drafter,
)
from verispec.drafters.ngram import SuffixIndex, lookup
from verispec.engine import Engine
from verispec.errors import ConfigError

# Repeats, so that suffix matches exist in some rounds and not in others.
LOOPY = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 11, 12, 13]



@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_suffix_index_drafts_what_the_scan_drafts(min_n, max_n):
    """The incremental index against the stateless scan, after every change a sequence goes through: growth by a
    few tokens, a cut back (a nested round rejected), a changed tail, a shorter restart; small vocabularies so that
    n-grams repeat, budgets from 1 to 9."""
    rng = np.random.default_rng(min_n * 10 + max_n)
    index = SuffixIndex(max_n, min_n)
    tokens: list[int] = []
    for step in range(600):
        op = rng.integers(0, 10)
        if op < 6 or len(tokens) < 4:  # grow
            tokens = tokens + rng.integers(0, 5, rng.integers(1, 5)).tolist()
        elif op < 8:  # cut back
            tokens = tokens[: rng.integers(1, len(tokens))]
        elif op < 9:  # change a token inside (the whole sequence differs from there)
            tokens = list(tokens)
            tokens[rng.integers(0, len(tokens))] = int(rng.integers(0, 5))
        else:
            tokens = tokens[: rng.integers(1, 4)]
        index.sync(tokens)
        assert index.tokens == tokens
        for k in (1, 3, 9):
            assert index.lookup(k) == lookup(np.asarray(tokens, dtype=np.int64), max_n, min_n, k), (step, k)
        draft, n = index.match(3)
        if draft:  # the suffix of n tokens occurred before, and no longer one did
            assert min_n <= n <= max_n and _occurs(tokens[len(tokens) - n :], tokens[:-1])
            assert n == max_n or n == len(tokens) - 1 or not _occurs(tokens[len(tokens) - n - 1 :], tokens[:-1])
        else:
            assert n == 0
    index.truncate(0)
    assert index.tokens == [] and index.starts == {}


def _occurs(pattern: list[int], seq: list[int]) -> bool:
    return any(seq[i : i + len(pattern)] == pattern for i in range(len(seq) - len(pattern) + 1))


def test_drafts_name_their_match_length():
    """The policy's acceptance estimates are kept per Draft.kind: ngram's drafts say how long a suffix they
    continue, lookup's say they are lookup's (not the inner drafter's)."""
    seq = [1, 2, 3, 9, 2, 3, 8, 3]  # suffix [3]: a 1-token match (the 2-gram [8, 3] is new), continued by [8, 3]
    ngram = NgramDrafter(max_n=3)
    (d1,) = ngram.propose([DraftRequest(0, seq, 2, GREEDY, None)])
    (d3,) = ngram.propose([DraftRequest(1, seq + [9, 2], 2, GREEDY, None)])  # [3, 9, 2] occurred: a 3-token match
    assert (d1.tokens, d1.kind) == ([8, 3], "n1") and (d3.tokens, d3.kind) == ([3, 8], "n3")
    assert d3.truncated(1).kind == "n3" and d3.keep([0]).kind == "n3"

    class Inner(NgramDrafter):  # stands for a learned drafter: anything that drafts without a match
        pass
    first = LookupFirstDrafter(Inner(max_n=1), min_n=3)
    assert first.propose([DraftRequest(2, seq + [9, 2], 2, GREEDY, None)])[0].kind == "lookup-n3"
    assert first.propose([DraftRequest(3, seq, 2, GREEDY, None)])[0].kind == "n1"  # the inner drafter's own


@pytest.mark.parametrize("min_n", [1, 2, 3])
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equals_plain_whoever_drafts(min_n, k, target):
    """A1 with a DSpark-style inner drafter: both kinds of round occur, and the output equals plain greedy (the
    inner block drafter raises if its context misses a round it did not draft)."""
    for prompt in PROMPTS + [LOOPY]:
        ref = decode(target, prompt, GREEDY).token_ids
        drafter = LookupFirstDrafter(BlockDrafter(make_block(target, **KINDS["dspark"]), target), min_n=min_n)
        out = decode(target, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=k))
        assert out.token_ids == ref
    assert drafter.num_lookup > 0 and drafter.num_inner > 0


def test_engine_greedy_with_lookup_first(target, plain):  # noqa: F811
    inner = BlockDrafter(make_block(target, **KINDS["dspark"]), target)
    drafter = LookupFirstDrafter(inner, min_n=1)
    engine = Engine(target, None, EngineConfig(k=4, drafter="l", prefill_chunk=6), drafters={"l": drafter})
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    results = engine.run_until_done()
    assert [results[i].token_ids for i in ids] == plain
    assert drafter.num_lookup > 0 and drafter.num_inner > 0


def test_lookup_first_samples_from_target(stat_target):  # noqa: F811
    """A5: rounds drafted by lookup (point mass) and by the inner block drafter (its q) mix in one run; the
    output pairs follow the target's joint distribution."""
    joints = exact_pair_joints(stat_target, S_PROMPT, S_PARAMS)
    inner = BlockDrafter(make_block(stat_target, block_size=2, std=0.5, **KINDS["dspark"]), stat_target)
    drafter = LookupFirstDrafter(inner, min_n=1, max_n=1)
    engine = Engine(stat_target, None, EngineConfig(k=2, drafter="l", max_running=250, max_queued=N_STAT),
                    drafters={"l": drafter})
    for i in range(N_STAT):
        engine.add_request(S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i), request_id=str(i))
    results = engine.run_until_done()
    assert drafter.num_lookup > 0 and drafter.num_inner > 0
    assert 0 < engine.metrics.num_accepted_tokens < engine.metrics.num_draft_tokens
    samples = np.array([results[str(i)].token_ids for i in range(N_STAT)])
    for cols, joint in (([0, 1], joints[0]), ([1, 2], joints[1])):
        tv, pval, impossible = check_pair(samples[:, cols], joint)
        assert tv < tv_limit(SV * SV, N_STAT) and pval > ALPHA and impossible == 0, (tv, pval)


def test_spec_and_errors(target, tmp_path):  # noqa: F811
    from verispec.model import save_model

    save_model(target, tmp_path / "t")
    d = build_drafter(f"lookup:model:{tmp_path / 't'}", target=target, dtype=target.dtype, device=target.device)
    assert isinstance(d, LookupFirstDrafter) and isinstance(d.inner, ModelDrafter)
    out = decode(target, LOOPY, GREEDY, drafter=d, spec=SpecConfig(k=3))
    assert out.token_ids == decode(target, LOOPY, GREEDY).token_ids
    for bad, msg in (("lookup", "needs an inner drafter"), ("lookup:ngram", "learned one"),
                     ("lookup:nope", "unknown drafter")):
        with pytest.raises(ConfigError, match=msg):
            build_drafter(bad, target=target, dtype=target.dtype, device=target.device)
    with pytest.raises(ConfigError, match="min_n"):
        LookupFirstDrafter(d.inner, min_n=3, max_n=2)
