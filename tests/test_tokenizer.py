"""Tokenizer round trips, streaming detokenization that never emits half a character, and tokenizer files."""

from __future__ import annotations

import json
import random

import pytest

from verispec.errors import CheckpointError
from verispec.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = {
    "ascii-code": "def add(a, b):\n    return a + b\n\nclass Point:\n\tpass  # done!\n",
    "accented": "naïve café – ünïcödé, déjà vu, Ærøskøbing",
    "cjk": "日本語のテキスト、中文字符和한국어",
    "emoji": "ok 🙂✓ 👍🏽 family: 👨‍👩‍👧 end",
    "mixed": "The quick brown fox 🦊 jumps — naïve 日本 ✓\n",
}
REPLACEMENT = "\ufffd"


@pytest.mark.parametrize("name", list(TEXTS))
def test_encode_decode_round_trip(tokenizer, name):
    """decode(encode(text)) == text for ASCII code, accented Latin, CJK and emoji (incl. ZWJ / skin tone)."""
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def _stream(tokenizer, ids, prompt_ids=None):
    det = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [det.add(i) for i in ids]
    return deltas, det.flush(), det


@pytest.mark.parametrize("name", list(TEXTS))
def test_incremental_deltas_concatenate_to_decode(tokenizer, name):
    """Token by token: no delta contains U+FFFD, the text so far is always a prefix of the full text, and
    deltas + flush == tokenizer.decode(ids)."""
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    deltas, tail, det = _stream(tokenizer, ids)
    assert all(REPLACEMENT not in d for d in deltas), deltas
    so_far = ""
    for d in deltas:
        so_far += d
        assert text.startswith(so_far)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == text
    assert det.text == text
    assert tail == ""  # the text ends on a complete character: nothing was held back at the end


def test_multibyte_tests_really_split_characters(tokenizer):
    """Guard for the tests above: this byte-level tokenizer does split non-ASCII characters across tokens."""
    ids = tokenizer.encode(TEXTS["emoji"] + TEXTS["cjk"])
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize(
    "prompt,output",
    [
        ("def add(a, b):\n", "    return a + b 🙂 done"),
        ("naïve café – 日本語", " ✓ ünïcödé 🙂\n日本"),  # the 4-token context starts mid-character
        ("hello", "<eos> world"),
    ],
)
def test_incremental_with_prompt_context(tokenizer, prompt, output):
    """With the prompt as context the deltas still have no U+FFFD and concatenate to decode(output ids)
    (which, for a prompt ending on a character boundary, is decode(prompt + output) minus the prompt's text)."""
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(output)
    if "日本語" in prompt:
        assert tokenizer.decode(prompt_ids[-4:]).startswith(REPLACEMENT)  # the case is what it claims
    deltas, tail, _ = _stream(tokenizer, ids, prompt_ids)
    assert all(REPLACEMENT not in d for d in deltas), deltas
    expected = tokenizer.decode(ids)
    assert "".join(deltas) + tail == expected
    assert tokenizer.decode(prompt_ids + ids) == tokenizer.decode(prompt_ids) + expected


def test_special_tokens_emit_nothing(tokenizer):
    """An EOS token in the stream decodes to nothing and does not disturb the text around it."""
    eos = tokenizer.eos_token_ids[0]
    a, b = tokenizer.encode("ab 🙂"), tokenizer.encode(" cd")
    deltas, tail, _ = _stream(tokenizer, a + [eos] + b)
    assert deltas[len(a)] == ""
    assert "".join(deltas) + tail == "ab 🙂 cd"


def test_partial_character_is_held_back_until_completed(tokenizer):
    """Tokens that end inside a multi-byte character yield "" until the token completing it arrives; then the
    whole character comes out at once."""
    head = tokenizer.encode("x")
    emoji = tokenizer.encode("🙂")
    assert len(emoji) > 1  # the emoji spans several byte tokens
    det = IncrementalDetokenizer(tokenizer)
    assert det.add(head[0]) == "x"
    for i in emoji[:-1]:
        assert det.add(i) == ""
    assert det.add(emoji[-1]) == "🙂"
    assert det.flush() == ""
    assert det.text == "x🙂"


def test_flush_emits_a_cut_character_as_replacement(tokenizer):
    """A sequence cut in the middle of a character: nothing partial is streamed, and flush (end of generation)
    releases what was held back exactly as tokenizer.decode renders it."""
    ids = tokenizer.encode("a日")
    cut = ids[:-1]
    assert REPLACEMENT in tokenizer.decode(cut)
    deltas, tail, det = _stream(tokenizer, cut)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == "a"
    assert tail.endswith(REPLACEMENT)
    assert "".join(deltas) + tail == tokenizer.decode(cut) == det.text


def test_random_token_streams_concatenate_to_decode(tokenizer):
    """Fuzz: arbitrary token ids (invalid byte sequences included), with or without a clean text prompt as
    context: deltas + flush always equal tokenizer.decode(ids), and no delta except the flush ends in U+FFFD."""
    rng = random.Random(0)
    prompts = [None, tokenizer.encode("x = 1\n"), tokenizer.encode("日本語のテキスト")]
    for trial in range(400):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 16))]
        prompt = prompts[trial % len(prompts)]
        deltas, tail, _ = _stream(tokenizer, ids, prompt)
        assert "".join(deltas) + tail == tokenizer.decode(ids), (ids, prompt)
        assert not any(d.endswith(REPLACEMENT) for d in deltas), (ids, prompt, deltas)


def test_from_dir_without_tokenizer_json(tmp_path):
    """A directory without tokenizer.json is a CheckpointError naming the file."""
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_with_malformed_tokenizer_json(tmp_path):
    """A tokenizer.json that tokenizers cannot parse is a CheckpointError, not a bare Exception."""
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_round_trips_and_reads_eos(tokenizer, tmp_path):
    """save + from_dir keep the vocabulary; eos comes from tokenizer_config.json (string or AddedToken dict);
    without tokenizer_config.json there is no eos."""
    tokenizer.save(tmp_path)
    plain = Tokenizer.from_dir(tmp_path)
    assert plain.vocab_size == tokenizer.vocab_size
    assert plain.encode(TEXTS["mixed"]) == tokenizer.encode(TEXTS["mixed"])
    assert plain.eos_token_ids == ()
    eos_id = tokenizer._tok.token_to_id("<eos>")
    for eos in ("<eos>", {"content": "<eos>", "special": True}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        assert Tokenizer.from_dir(tmp_path).eos_token_ids == (eos_id,)


def test_from_dir_bos_is_prepended_when_configured(tokenizer, tmp_path):
    """bos_token + add_bos_token in tokenizer_config.json: encode prepends the BOS id, decode drops it."""
    tokenizer.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<eos>", "eos_token": "<eos>", "add_bos_token": True})
    )
    tok = Tokenizer.from_dir(tmp_path)
    bos = tokenizer._tok.token_to_id("<eos>")
    ids = tok.encode("hi")
    assert ids[0] == bos and ids[1:] == tokenizer.encode("hi")
    assert tok.decode(ids) == "hi"
