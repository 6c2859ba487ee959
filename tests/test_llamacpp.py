"""llama.cpp as a bench baseline (bench/llamacpp.py): a tiny checkpoint through the vendored GGUF converter and back,
its arms, and the arms inside `verispec bench`. Tests that need the `llama` extra or llama.cpp's binaries skip
without them, saying how to build them (scripts/test.sh builds them)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import TOKENIZER_TEXT, tiny_model
from verispec.bench import llamacpp as lc
from verispec.config import SamplingParams
from verispec.decode import decode
from verispec.errors import VerispecError
from verispec.model import load_model, save_model

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n"
N_CTX = 256
# The second half of every skip reason here: how to get what is missing.
HOW = (f"run `{lc.SETUP}` (it builds llama.cpp from source once per CPU, about 10 minutes on 2 cores; "
       "scripts/test.sh runs it unless VERISPEC_LLAMACPP=0)")


def _needs_binding() -> None:
    pytest.importorskip("llama_cpp", reason=f"the `llama` extra (llama-cpp-python) is not installed: {HOW}")
    if not lc.converter().is_file():
        pytest.skip(f"llama.cpp's GGUF converter is not unpacked at {lc.converter()}: {HOW}")


def _needs_binaries(*kinds: str) -> None:
    _needs_binding()
    for kind in kinds:
        if not (lc.build_dir() / "bin" / lc.BINARIES[kind]).is_file():
            pytest.skip(f"llama.cpp's {lc.BINARIES[kind]} is not built for this CPU (no "
                        f"{lc.build_dir() / 'bin' / lc.BINARIES[kind]}): {HOW}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    """A tiny tied-embedding fp32 checkpoint (as the zoo's target is tied) with its tokenizer."""
    path = tmp_path_factory.mktemp("llamacpp") / "target"
    save_model(tiny_model(vocab_size=tokenizer.vocab_size, tie_word_embeddings=True, max_position_embeddings=N_CTX),
               path)
    tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _ours(ckpt, prompt: list[int], n: int) -> list[int]:
    return decode(load_model(ckpt, "fp32"), prompt, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids


def test_gguf_round_trip_fp32_tokens_equal(ckpt, cache, tokenizer):
    """f32 GGUF: cached by source hash, the same vocabulary and tokenization (the `gpt-2` pre-tokenizer is ours),
    and greedy tokens equal to verispec's fp32 plain decoding, generation after generation."""
    _needs_binding()
    path = lc.gguf_file(ckpt, "f32", cache)
    assert lc.gguf_file(ckpt, "f32", cache) == path and path.parent.name.endswith(lc.source_hash(ckpt))
    vocab = lc.Vocab(path)
    assert vocab.llm.n_vocab() == tokenizer.vocab_size
    for line in TOKENIZER_TEXT.splitlines(keepends=True)[:4]:
        ids = tokenizer.encode(line)
        assert vocab.encode(line.encode()) == ids and vocab.text(ids) == line.encode()
    prompt = tokenizer.encode(PROMPT)
    arm = lc.PlainArm(path, N_CTX, 1, vocab)
    ours = _ours(ckpt, prompt, 16)
    for _ in range(2):  # the binding's cache is reset between generations
        g = arm.generate(prompt, 16)
        assert g.token_ids == ours and g.num_tokens == 16 and 0 < g.decode_s < g.total_s
        assert g.text == vocab.text(ours)
    other = tokenizer.encode("The quick brown fox")
    assert arm.generate(other, 8).token_ids == _ours(ckpt, other, 8)


@pytest.mark.parametrize("quant", ["bf16", "q8_0", "q4_0"])
def test_quantized_plain_arms_generate_n_tokens(ckpt, cache, tokenizer, quant):
    _needs_binding()
    arm = lc.build_arms(ckpt, (f"plain-{quant}",), N_CTX, 1, cache=cache)[f"plain-{quant}"]
    g = arm.generate(tokenizer.encode(PROMPT), 12)
    assert len(g.token_ids) == g.num_tokens == 12 and all(0 <= t < tokenizer.vocab_size for t in g.token_ids)


def test_speculative_and_lookup_binaries_equal_plain_f32(ckpt, cache, tokenizer):
    """llama.cpp's own llama-speculative (the target drafting for itself) and llama-lookup: the prompt's bytes go in
    as the same ids, at least N tokens come out, and the text is plain decoding's (lossless in fp32)."""
    _needs_binaries("speculative", "lookup")
    arms = lc.build_arms(ckpt, ("plain-f32", "speculative-f32", "lookup-f32"), N_CTX, 1, draft=ckpt, cache=cache)
    prompt = tokenizer.encode(PROMPT * 3)  # repeats, so lookup finds n-grams
    plain = arms["plain-f32"].generate(prompt, 16)
    for name in ("speculative-f32", "lookup-f32"):
        g = arms[name].generate(prompt, 16)
        assert g.prompt_ids_equal and g.num_tokens >= 16 and len(g.token_ids) >= 16, name
        assert g.text[:len(plain.text)] == plain.text, name
        assert 0 < g.decode_s <= g.total_s and 0 <= g.num_accepted <= g.num_drafted, name
    assert arms["speculative-f32"].generate(prompt, 16).num_drafted > 0


def test_bench_runs_llamacpp_arms_side_by_side(ckpt, tmp_path, monkeypatch):
    """`verispec bench --llamacpp`: llama.cpp records per task and arm, the fp32 equality check over the bench
    prompts, and the side-by-side table in the summary."""
    _needs_binaries("lookup")
    from verispec.bench.suite import BenchConfig, run

    build = lc.build_dir()
    monkeypatch.setattr(lc, "build_dir", lambda: build)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))  # the GGUF files go there, not the user's cache
    cfg = BenchConfig.quick(ckpt, methods=("ngram",), ks=(2,), prompts_per_task=1, max_tokens=8, dtype="fp32",
                            tasks=("code_completion", "prose"), baselines=False,
                            llamacpp=("plain-f32", "lookup-f32"))
    report = run(cfg, tmp_path / "out", progress=False)
    records = report["llamacpp"]["records"]
    assert {(r["task"], r["arm"]) for r in records} == {
        (t, a) for t in cfg.tasks for a in ("plain-f32", "lookup-f32")}
    for r in records:
        assert 0 < r["tokens_per_s"] <= r["decode_tokens_per_s"] and r["num_prompts"] == 1 and r["num_tokens"] >= 8
        if r["arm"] == "lookup-f32":
            assert r["reference"] == "plain-f32" and r["equal_to_plain"] == 1 and r["prompt_ids_equal"] == 1
        else:
            assert r["reference"] is None and r["equal_to_plain"] is None
    eq = report["llamacpp"]["fp32_equality"]
    assert eq["num_prompts"] == 2 and eq["num_equal"] == 2 and eq["differences"] == []
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["llamacpp"]["records"] == records
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## Side by side with llama.cpp" in summary
    assert "| code_completion | llama.cpp | lookup f32 draft 8 |" in summary
    assert "| code_completion | verispec | plain fp32 |" in summary and "2/2 prompts equal" in summary


def test_missing_extra_is_one_clear_error(ckpt, monkeypatch, capsys):
    from verispec.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    with pytest.raises(lc.LlamaCppMissing, match="scripts/llamacpp.sh"):
        lc.import_llama_cpp()
    rc = main(["bench", "--target", str(ckpt), "--quick", "--methods", "ngram", "--tasks", "code_completion",
               "--dtype", "fp32", "--no-baselines", "--llamacpp", "plain-f32", "--out", str(ckpt.parent / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: the llama.cpp baseline needs the `llama` extra")


def test_arm_names():
    assert lc.parse_arms("all") == lc.DEFAULT_ARMS
    assert lc.parse_arms("plain-q4_0, lookup") == ("plain-q4_0", "lookup")
    assert lc.parse_arm("speculative") == ("speculative", "bf16")
    for bad in ("plain-q5_0", "beam", "lookup-"):
        with pytest.raises(VerispecError, match="unknown llama.cpp arm"):
            lc.parse_arm(bad)


def test_only_gpt2_style_pretokenizers_are_declared_gpt2(ckpt, tmp_path):
    lc.check_gpt2_pretokenizer(ckpt / "tokenizer.json")
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(VerispecError, match="not a GPT-2-style"):
        lc.check_gpt2_pretokenizer(tmp_path / "tokenizer.json")
