"""Stop, EOS, length and context semantics under multi-token acceptance (reliability.md §3.4, §5 A9, B1-B5).

A speculative round commits up to k + 1 tokens at once; the earliest of {EOS, completed stop string,
max_tokens, context end} must win and nothing after it may leak: not into token_ids, text, the stream or the
statistics. The target here is a tiny random model whose LM head is restricted to tokens that decode to clean
printable text, so every stop string taken from its output is well defined (no U+FFFD from split UTF-8 bytes).
"""

from __future__ import annotations

import pytest
import torch
from _drafters import CorruptedOracle
from conftest import tiny_model

from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode, decode_stream
from verispec.drafters import ModelDrafter, NgramDrafter
from verispec.errors import ConfigError
from verispec.model.tokenizer import IncrementalDetokenizer
from verispec.stopping import StopChecker

PROMPT_TEXT = "def add(a, b):\n    return a + b\n"
N_PLAIN = 40


def clean_token_ids(tokenizer) -> list[int]:
    out = []
    for i in range(tokenizer.vocab_size):
        s = tokenizer.decode([i])
        if i not in tokenizer.eos_token_ids and s and "\ufffd" not in s and s.isprintable():
            out.append(i)
    return out


@pytest.fixture(scope="module")
def target(tokenizer):
    """A random model whose greedy output is diverse, printable text: LM-head rows of tokens that do not
    decode to clean text are zeroed (their logit is 0) and the others scaled up, so argmax always picks a
    clean token."""
    m = tiny_model(1, 0.5, vocab_size=tokenizer.vocab_size)
    keep = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
    keep[clean_token_ids(tokenizer)] = True
    with torch.no_grad():
        m.lm_head.weight[~keep] = 0.0
        m.lm_head.weight[keep] *= 4.0
    return m


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(PROMPT_TEXT)


@pytest.fixture(scope="module")
def plain(target, prompt, tokenizer):
    """Plain greedy reference (drafter=None, ignore_eos)."""
    return decode(target, prompt, SamplingParams(max_tokens=N_PLAIN, ignore_eos=True), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def prefix_text(target, prompt, tokenizer):
    """prefix_text(n): the text a plain run that stops after n tokens returns."""
    cache: dict[int, str] = {0: ""}

    def get(n: int) -> str:
        if n not in cache:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            cache[n] = decode(target, prompt, params, tokenizer=tokenizer).text
        return cache[n]

    return get


def run_stream(target, prompt, params, **kw):
    """decode_stream to the end: (result, concatenated token ids, concatenated text deltas)."""
    events = list(decode_stream(target, prompt, params, **kw))
    assert all(e.result is None for e in events[:-1]) and events[-1].result is not None
    ids = [t for e in events for t in e.token_ids]
    text = "".join(e.text for e in events)
    return events[-1].result, ids, text


def first_occurrences(seq: list[int]) -> list[int]:
    return [i for i, t in enumerate(seq) if t not in seq[:i]]


def test_reference_is_clean_and_diverse(plain, tokenizer):
    """Guard: the reference is long, printable, detokenizes consistently, and has many first-occurrence
    tokens."""
    assert len(plain.token_ids) == N_PLAIN
    assert "\ufffd" not in plain.text and plain.text == tokenizer.decode(plain.token_ids)
    assert len(first_occurrences(plain.token_ids)) >= 20


# ------------------------------------------------------------------------------------------------------------
# B1: EOS at every position of an accepted block


@pytest.mark.parametrize("k", [4, 8])
def test_eos_at_every_block_position(k, target, prompt, tokenizer, plain, prefix_text):
    """B1 (transformers #47912 trick): declare the token at position i of the plain output to be EOS.
    Self-drafting then accepts that EOS at offset i mod (k+1) of a block (offset k = the bonus token). The
    output ends exactly at it (EOS id included as the last token id), finish_reason "stop", EOS text excluded,
    nothing after it, and the stream concatenates to the result."""
    seq = plain.token_ids
    positions = first_occurrences(seq)
    assert {i % (k + 1) for i in positions} == set(range(k + 1)), "the reference misses a block offset"
    for i in positions:
        eos = seq[i]
        res, ids, text = run_stream(target, prompt, SamplingParams(max_tokens=N_PLAIN),
                                    drafter=ModelDrafter(target), spec=SpecConfig(k=k), tokenizer=tokenizer,
                                    eos_token_ids=(eos,))
        assert res.token_ids == seq[: i + 1], i
        assert (res.finish_reason, res.stop_reason) == ("stop", eos), i
        assert res.text == prefix_text(i), i
        assert ids == res.token_ids and text == res.text, i
        # Every emitted token but the bonus tokens of complete rounds was an accepted draft token; the draft
        # tokens after the EOS are not counted as accepted.
        assert res.stats.num_output_tokens == i + 1
        assert res.stats.num_rounds == i // (k + 1) + 1
        assert res.stats.num_accepted_tokens == (i + 1) - (i + 1) // (k + 1)


# ------------------------------------------------------------------------------------------------------------
# B2: stop strings inside a block and across two rounds


def token_text_ends(tokenizer, prompt, seq) -> list[int]:
    """ends[j] = length of the output text once token j has been added (the loop's incremental detokenizer).
    """
    det = IncrementalDetokenizer(tokenizer, prompt)
    ends, n = [], 0
    for t in seq:
        n += len(det.add(t))
        ends.append(n)
    return ends


def stop_cases(text: str, ends: list[int]) -> list[tuple[str, int, int]]:
    """(stop string, start char, completing token j) for stop strings whose first occurrence in `text` ends
    inside token j's text (at its last char or its first one) and starts at the beginning of token j, j-1 or
    j-2, so some span tokens committed in two different rounds."""
    cases = {}
    for j in range(1, 30):
        lo, hi = ends[j - 1], ends[j]
        if hi == lo:
            continue
        for t, b in ((j, hi), (j, lo + 1), (j - 1, lo + 1), (j - 2, hi)):
            a = ends[t - 1] if t >= 1 else 0
            s = text[a:b]
            if s and text.find(s) == a:
                cases[(s, a, j)] = None
    return list(cases)


def first_token_of_char(ends: list[int], a: int) -> int:
    return next(t for t, e in enumerate(ends) if e > a)


@pytest.mark.parametrize("k", [4, 8])
def test_stop_strings_inside_and_across_blocks(k, target, prompt, tokenizer, plain):
    """B2: a stop string completing at each offset of a block, and one split across two rounds: text truncated
    before it, finish_reason "stop", stop_reason the string, token_ids end at the token that completed it, and
    the streamed deltas (with their hold-back) concatenate to exactly the result text."""
    seq, text = plain.token_ids, plain.text
    ends = token_text_ends(tokenizer, prompt, seq)
    assert ends[-1] == len(text)
    block = k + 1  # self-drafting: round r commits tokens [r (k+1), (r+1)(k+1))
    cases = stop_cases(text, ends)
    offsets = {j % block for _, _, j in cases}
    split = [c for c in cases if first_token_of_char(ends, c[1]) // block != c[2] // block]
    assert offsets == set(range(block)) and len(split) >= 2, "reference does not cover the cases"
    for s, a, j in cases:
        res, ids, streamed = run_stream(
            target, prompt, SamplingParams(max_tokens=N_PLAIN, ignore_eos=True, stop=(s,)),
            drafter=ModelDrafter(target), spec=SpecConfig(k=k), tokenizer=tokenizer)
        assert (res.finish_reason, res.stop_reason) == ("stop", s), (s, j)
        assert res.text == text[:a], (s, j)
        assert res.token_ids == seq[: j + 1], (s, j)
        assert ids == res.token_ids and streamed == res.text, (s, j)
        assert res.stats.num_output_tokens == j + 1


def test_earliest_of_several_stop_strings_wins(target, prompt, tokenizer, plain):
    """B2/B4: with several stop strings the one whose occurrence comes first wins, even when a later one is
    listed first; and an EOS before a stop string in the same block wins over it."""
    seq, text = plain.token_ids, plain.text
    ends = token_text_ends(tokenizer, prompt, seq)
    (s1, a1, j1), *_, (s2, _, j2) = stop_cases(text, ends)
    assert j1 < j2
    res = decode(target, prompt, SamplingParams(max_tokens=N_PLAIN, ignore_eos=True, stop=(s2, s1)),
                 drafter=ModelDrafter(target), spec=SpecConfig(k=8), tokenizer=tokenizer)
    assert (res.stop_reason, res.text, res.token_ids) == (s1, text[:a1], seq[: j1 + 1])

    i = next(i for i in first_occurrences(seq) if 2 <= i < j2)  # EOS before the stop string completes
    res = decode(target, prompt, SamplingParams(max_tokens=N_PLAIN, stop=(s2,)), drafter=ModelDrafter(target),
                 spec=SpecConfig(k=8), tokenizer=tokenizer, eos_token_ids=(seq[i],))
    assert (res.finish_reason, res.stop_reason, res.token_ids) == ("stop", seq[i], seq[: i + 1])


def forced_model(tokenizer, token: int):
    """A model whose greedy output is `token` forever: residual dimension 0 is a constant 100 (embeddings set,
    every layer's writes to it zeroed), and only `token`'s LM-head row reads it."""
    m = tiny_model(0, 0.2, vocab_size=tokenizer.vocab_size)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 100.0
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        m.model.norm.weight[0] = 1.0
        m.lm_head.weight[:, 0] = 0.0
        m.lm_head.weight[token, 0] = 10.0
    return m


def test_stop_string_before_an_incomplete_utf8_char(tokenizer):
    """B2/B4 edge: a token whose text is a stop string followed by the first byte of a multi-byte character
    (here "c" + 0xC3, the BPE merge "cÃ" from "café"). The stop string is complete after that token, so
    generation must stop there: finish_reason "stop", stop_reason "c", text "" and token_ids [that token].
    Currently the incremental detokenizer holds the text back (it ends in U+FFFD), the stop check never sees
    it, and the text is flushed at the end without a stop check: finish_reason "length" and the stop string
    left in the text (and with an EOS right after, stop_reason is the EOS instead of the earlier stop string).
    """
    c_partial = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "c\ufffd")
    # At the StopChecker level: the block ends at max_tokens, or continues with an EOS.
    chk = StopChecker(SamplingParams(max_tokens=1, stop=("c",)), 1, 100, (0,), tokenizer, None)
    e = chk.extend([c_partial])
    assert "c" not in chk.text
    assert (e.token_ids, e.finish_reason, e.stop_reason, e.text) == ([c_partial], "stop", "c", "")
    chk = StopChecker(SamplingParams(max_tokens=10, stop=("c",)), 1, 100, (0,), tokenizer, None)
    e = chk.extend([c_partial, 0])
    assert (e.token_ids, e.finish_reason, e.stop_reason, e.text) == ([c_partial], "stop", "c", "")
    # Through the loop, plain and speculative: the model emits that token forever.
    m = forced_model(tokenizer, c_partial)
    prompt = tokenizer.encode("def f")
    for kw in ({}, {"drafter": ModelDrafter(m), "spec": SpecConfig(k=4)}):
        res = decode(m, prompt, SamplingParams(max_tokens=3, stop=("c",)), tokenizer=tokenizer, **kw)
        assert "c" not in res.text, res.text
        assert (res.finish_reason, res.stop_reason, res.token_ids) == ("stop", "c", [c_partial])


# ------------------------------------------------------------------------------------------------------------
# B3: max_tokens exactness


@pytest.mark.parametrize("kind", ["self", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_max_tokens_is_exact(k, kind, target, prompt, tokenizer, plain, prefix_text):
    """B3: for max_tokens in 1..2k+1 exactly max_tokens tokens come out (never more, never fewer),
    finish_reason "length", num_output_tokens == len(token_ids), and tokens and text equal the plain run's."""
    for m in range(1, 2 * k + 2):
        drafter = ModelDrafter(target) if kind == "self" else NgramDrafter()
        res, ids, streamed = run_stream(target, prompt, SamplingParams(max_tokens=m, ignore_eos=True),
                                        drafter=drafter, spec=SpecConfig(k=k), tokenizer=tokenizer)
        assert len(res.token_ids) == m and res.finish_reason == "length" and res.stop_reason is None, m
        assert res.token_ids == plain.token_ids[:m]
        assert res.stats.num_output_tokens == len(res.token_ids)
        assert res.text == prefix_text(m) and ids == res.token_ids and streamed == res.text


# ------------------------------------------------------------------------------------------------------------
# B4: precedence


def test_precedence_eos_versus_max_tokens(target, prompt, tokenizer, plain):
    """B4 through the loop (self-draft, k=8, one block reaches max_tokens): EOS before max_tokens -> "stop" at
    the EOS; EOS exactly at max_tokens -> "stop" with max_tokens tokens; EOS one past max_tokens -> "length"
    and no EOS."""
    seq = plain.token_ids
    firsts = set(first_occurrences(seq))
    m = next(m for m in range(4, 9) if {m - 3, m - 1, m} <= firsts)
    cases = {m - 3: ("stop", m - 2), m - 1: ("stop", m), m: ("length", m)}  # eos position -> (reason, length)
    for i, (reason, length) in cases.items():
        res = decode(target, prompt, SamplingParams(max_tokens=m), drafter=ModelDrafter(target),
                     spec=SpecConfig(k=8), tokenizer=tokenizer, eos_token_ids=(seq[i],))
        assert res.stats.num_rounds == 1  # the whole answer is one verified block
        assert (res.finish_reason, len(res.token_ids)) == (reason, length), i
        assert res.token_ids == seq[:length]
        assert res.stop_reason == (seq[i] if reason == "stop" else None)


def test_stop_checker_earliest_event_wins(tokenizer):
    """B4 at the StopChecker level, for blocks longer than the remaining budget (an engine that does not clip
    drafts to max_tokens): vLLM's [EOS, 5, EOS, 7, 43, 5] -> [EOS]; an EOS inside the budget wins over a block
    that crosses max_tokens; an EOS past max_tokens is cut off with "length"; a stop string completing on the
    max_tokens-th token gives "stop"."""
    eos = 0
    chk = StopChecker(SamplingParams(max_tokens=10), 3, 100, (eos,), None)
    e = chk.extend([eos, 5, eos, 7, 43, 5])
    assert (e.token_ids, e.finish_reason, e.stop_reason) == ([eos], "stop", eos)

    chk = StopChecker(SamplingParams(max_tokens=3), 3, 100, (eos,), None)
    e = chk.extend([7, eos, 8, 9, 10])
    assert (e.token_ids, e.finish_reason, e.stop_reason, chk.output) == ([7, eos], "stop", eos, [7, eos])

    chk = StopChecker(SamplingParams(max_tokens=3), 3, 100, (eos,), None)
    assert chk.extend([7]).finish_reason is None
    e = chk.extend([8, 9, eos, 10])
    assert (e.token_ids, e.finish_reason, chk.output) == ([8, 9], "length", [7, 8, 9])

    chk = StopChecker(SamplingParams(max_tokens=3), 3, 6, (eos,), None)  # context end after 3 tokens
    e = chk.extend([7, 8, 9, 10])
    assert (e.token_ids, e.finish_reason) == ([7, 8, 9], "length")

    ids = tokenizer.encode("abc xyz")
    assert tokenizer.decode(ids) == "abc xyz"
    chk = StopChecker(SamplingParams(max_tokens=len(ids), stop=("yz",)), 1, 100, (eos,), tokenizer, None)
    e = chk.extend(ids + [eos])
    assert (e.token_ids, e.finish_reason, e.stop_reason) == (ids, "stop", "yz")
    assert chk.text == e.text == "abc x"


# ------------------------------------------------------------------------------------------------------------
# B5: context end


def ids_prompt(n: int, vocab: list[int]) -> list[int]:
    """A periodic prompt (period 5), so prompt lookup drafts right up to the context end."""
    return [vocab[(7 * (i % 5) + 3) % len(vocab)] for i in range(n)]


@pytest.mark.parametrize("kind", ["self", "ngram"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_context_limit_argument(k, kind, target, tokenizer):
    """B5: prompt length = context_limit - m for m in 1..k+1 (context_limit passed to decode): no crash,
    exactly m tokens, finish_reason "length", and the same tokens as plain decoding under the same limit."""
    limit = 32
    vocab = clean_token_ids(tokenizer)
    for m in range(1, k + 2):
        p = ids_prompt(limit - m, vocab)
        base = decode(target, p, SamplingParams(max_tokens=64, ignore_eos=True), context_limit=limit)
        drafter = ModelDrafter(target) if kind == "self" else NgramDrafter()
        res = decode(target, p, SamplingParams(max_tokens=64, ignore_eos=True), context_limit=limit,
                     drafter=drafter, spec=SpecConfig(k=k))
        assert (len(res.token_ids), res.finish_reason) == (m, "length"), m
        assert res.token_ids == base.token_ids and len(base.token_ids) == m


@pytest.mark.parametrize("k", [1, 4, 8])
def test_model_max_positions(k, tokenizer):
    """B5 with the model's own limit (max_position_embeddings=24, no context_limit argument): self-draft
    (whose own cache has the same capacity) and ngram never overrun a KV cache; exactly m tokens, "length"."""
    small = tiny_model(3, 0.5, vocab_size=tokenizer.vocab_size, max_position_embeddings=24)
    limit = 24
    for m in range(1, k + 2):
        p = ids_prompt(limit - m, list(range(tokenizer.vocab_size)))
        base = decode(small, p, SamplingParams(max_tokens=64, ignore_eos=True))
        for drafter in (ModelDrafter(small), NgramDrafter()):
            res = decode(small, p, SamplingParams(max_tokens=64, ignore_eos=True), drafter=drafter,
                         spec=SpecConfig(k=k))
            assert (len(res.token_ids), res.finish_reason) == (m, "length"), m
            assert res.token_ids == base.token_ids


@pytest.mark.parametrize(
    "bad", ["at-limit", "over-limit", "empty", "negative-id", "id-equal-vocab", "huge-id"]
)
def test_invalid_prompts_raise_config_error(bad, target, tokenizer):
    """B5/D: a prompt of >= context_limit tokens, an empty prompt, or token ids outside [0, V) raise
    ConfigError before any work (also through the stream generator)."""
    v = tokenizer.vocab_size
    limit = 32
    p = {
        "at-limit": [5] * limit,
        "over-limit": [5] * (limit + 3),
        "empty": [],
        "negative-id": [5, -1, 6],
        "id-equal-vocab": [5, v, 6],
        "huge-id": [5, 10**9],
    }[bad]
    with pytest.raises(ConfigError):
        decode(target, p, SamplingParams(max_tokens=4), context_limit=limit, drafter=NgramDrafter())
    with pytest.raises(ConfigError):
        next(decode_stream(target, p, SamplingParams(max_tokens=4), context_limit=limit))


def test_stop_strings_need_a_tokenizer(target):
    """Stop strings without a tokenizer raise ConfigError (they cannot be matched on token ids)."""
    with pytest.raises(ConfigError):
        decode(target, [5, 6, 7], SamplingParams(max_tokens=4, stop=("x",)))


def test_prompt_at_model_limit_raises(tokenizer):
    """A prompt as long as the model's own context (no context_limit argument) raises ConfigError."""
    small = tiny_model(3, 0.5, vocab_size=tokenizer.vocab_size, max_position_embeddings=24)
    with pytest.raises(ConfigError):
        decode(small, [5] * 24, SamplingParams(max_tokens=4))
    with pytest.raises(ConfigError):  # a context_limit above the model's does not lift the model's limit
        decode(small, [5] * 24, SamplingParams(max_tokens=4), context_limit=64)


# ------------------------------------------------------------------------------------------------------------
# A9: metrics recomputed from the emitted tokens


def recomputed_stats(rounds) -> dict:
    """Accepted-and-emitted draft tokens per round = leading draft tokens equal to the emitted ones (a greedy
    recovered token always differs from the draft token it replaces)."""
    width = max(len(d) for d, _ in rounds)
    matched = []
    for draft, committed in rounds:
        m = 0
        while m < min(len(draft), len(committed)) and draft[m] == committed[m]:
            m += 1
        matched.append(m)
    drafted = [m for (d, _), m in zip(rounds, matched) if d]
    return {
        "num_drafts": len(drafted),
        "num_draft_tokens": sum(len(d) for d, _ in rounds),
        "num_accepted_tokens": sum(drafted),
        "accepted_per_pos": [sum(1 for m in drafted if m > j) for j in range(width)],
        "num_output_tokens": sum(len(c) for _, c in rounds),
    }, matched


def token_roles(max_tokens: int, k: int, pattern) -> tuple[dict[int, str], dict[int, int]]:
    """For the oracle drafter under greedy verification: the role of each output index ("accepted" draft
    token, "recovered" token at a rejection, "bonus" token) and its offset within its round's committed block.
    """
    roles, offsets, gen, drafted = {}, {}, 0, 0
    while gen < max_tokens:
        budget = min(k, max_tokens - gen - 1)
        bad = pattern[drafted % len(pattern)] if budget > 0 else None
        drafted += budget > 0
        a = bad if bad is not None and bad < budget else budget
        for o in range(a + 1):
            roles[gen + o] = "accepted" if o < a else ("bonus" if a == budget and budget > 0 else "recovered")
            offsets[gen + o] = o
        gen += a + 1
    return roles, offsets


@pytest.mark.parametrize("end", ["eos-accepted", "eos-recovered", "eos-bonus", "stop-string", "length"])
def test_metrics_match_emitted_tokens(end, target, prompt, tokenizer, plain):
    """A9 (vLLM #56101): in a corrupted-oracle run (k=4) that ends on EOS mid-block (as an accepted draft
    token, as the recovered token at a rejection, or as the bonus token), on a stop string completed by an
    accepted token mid-block, or on max_tokens, the statistics recomputed from the emitted tokens equal the
    reported ones exactly (accepted draft tokens after the stop are not counted), and the committed tokens of
    all rounds add up to len(token_ids)."""
    k = 4
    seq = plain.token_ids
    firsts = first_occurrences(seq)
    pattern = [None, 2, None, 0, 3, 1]
    roles, offsets = token_roles(N_PLAIN, k, pattern)
    kw: dict = {}
    params = SamplingParams(max_tokens=N_PLAIN)
    if end.startswith("eos"):
        role = end.split("-")[1]
        # the latest first-occurrence token with that role (accepted: strictly inside its block)
        i = max(i for i in firsts if roles[i] == role and (role != "accepted" or 0 < offsets[i] < k - 1))
        kw = {"eos_token_ids": (seq[i],)}
    elif end == "stop-string":
        ends = token_text_ends(tokenizer, prompt, seq)
        candidates = [c for c in stop_cases(plain.text, ends) if roles[c[2]] == "accepted" and offsets[c[2]]]
        s, _, i = max(candidates, key=lambda c: c[2])
        params = SamplingParams(max_tokens=N_PLAIN, ignore_eos=True, stop=(s,))
    else:
        params = SamplingParams(max_tokens=22, ignore_eos=True)
        i = 21
    assert i >= 5, "pick a stop past the first round"
    drafter = CorruptedOracle(len(prompt), seq, tokenizer.vocab_size, pattern)
    res = decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=k), tokenizer=tokenizer, **kw)
    assert res.token_ids == seq[: i + 1]
    assert res.finish_reason == ("length" if end == "length" else "stop")
    expected, matched = recomputed_stats([(d, c) for d, _, c in drafter.rounds])
    s = res.stats
    got = {
        "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_pos": s.accepted_per_pos,
        "num_output_tokens": s.num_output_tokens,
    }
    assert got == expected
    assert sum(len(c) for _, _, c in drafter.rounds) == len(res.token_ids) == s.num_output_tokens
    assert s.tau == 1.0 + expected["num_accepted_tokens"] / expected["num_drafts"]
    assert s.num_rounds == len(drafter.rounds)
    last_draft, _, last_committed = drafter.rounds[-1]
    if end in ("eos-recovered", "eos-bonus"):
        assert matched[-1] == len(last_committed) - 1  # the EOS itself was not an accepted draft token
    if end in ("eos-accepted", "stop-string"):
        assert matched[-1] == len(last_committed) < len(last_draft)  # trimmed inside the accepted prefix
