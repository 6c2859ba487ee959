"""llama.cpp as an outside baseline for `verispec bench --llamacpp` (the optional `llama` extra, built from source
by `scripts/llamacpp.sh`).

A verispec / Hugging Face checkpoint is converted to GGUF with the converter vendored in the llama-cpp-python sdist
(f32 and bf16; q8_0 and q4_0 by llama.cpp's own quantizer), cached by a hash of its files. Arms are `KIND-QUANT`
(QUANT defaults to bf16), all greedy with 2 threads (the bench's --threads), N new tokens past EOS:
- `plain`: one token per forward through the Python binding, token ids in and out;
- `speculative`: llama.cpp's own `llama-speculative` with the draft model, draft 8;
- `lookup`: llama.cpp's own `llama-lookup` (prompt lookup n-grams), draft 8.
The binaries read text, so a prompt goes in as the exact bytes of its tokens (checked to tokenize back to the same
ids) and their output is read back from the bytes they print. Times are end to end from the prompt (prefill
included) and after the prefill, as verispec's; a binary's own counters time it, without process start and load.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from verispec.errors import VerispecError
from verispec.paths import user_cache

VERSION = "0.3.36"  # llama-cpp-python; its sdist vendors the llama.cpp it binds (and the binaries are built from)
QUANTS = ("f32", "bf16", "q8_0", "q4_0")
KINDS = ("plain", "speculative", "lookup")
DEFAULT_ARMS = ("plain-bf16", "plain-q8_0", "plain-q4_0", "speculative", "lookup")
BINARIES = {"speculative": "llama-speculative", "lookup": "llama-lookup"}
DRAFT = 8  # tokens drafted per round by both speculative arms
FLASH_ATTN = True  # llama.cpp's default on a CPU (`-fa auto` resolves to on), set alike for the binding and binaries
SETUP = "bash scripts/llamacpp.sh"


class LlamaCppMissing(VerispecError):
    """The `llama` extra or llama.cpp's binaries are not built."""


# --- where the build lives -------------------------------------------------------------------------------------

def cpu_key() -> str:
    """A short hash of the CPU's feature flags: a native build (`-march=native`) is kept per CPU."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        import platform

        flags = platform.machine() + platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_dir() -> Path:
    """The sdist's sources, the wheel and llama.cpp's binaries built from them, for this CPU."""
    return user_cache("llama.cpp") / f"{VERSION}-{cpu_key()}"


def converter() -> Path:
    return build_dir() / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def binary(kind: str) -> Path:
    path = build_dir() / "bin" / BINARIES[kind]
    if not path.is_file():
        raise LlamaCppMissing(f"llama.cpp's {BINARIES[kind]} is not built for this CPU (no {path}): run `{SETUP}`")
    return path


def import_llama_cpp():
    """The binding, or one clear error saying how to build it."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppMissing(
            f"the llama.cpp baseline needs the `llama` extra built from source: run `{SETUP}`") from None
    if llama_cpp.__version__ != VERSION:
        raise LlamaCppMissing(f"llama-cpp-python {llama_cpp.__version__} is installed, the baseline pins {VERSION}: "
                              f"run `{SETUP}`")
    return llama_cpp


# --- conversion ------------------------------------------------------------------------------------------------

def source_hash(ckpt: Path) -> str:
    """sha256 over the checkpoint's config, tokenizer and weight files (and the converter's version)."""
    h = hashlib.sha256(VERSION.encode())
    for f in sorted(p for p in Path(ckpt).iterdir() if p.suffix in (".json", ".safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def gguf_file(ckpt: Path, quant: str, cache: Path | None = None) -> Path:
    """The checkpoint as GGUF in `quant` (one of QUANTS), converted on first use and cached by source hash."""
    if quant not in QUANTS:
        raise VerispecError(f"unknown GGUF type {quant!r}: one of {', '.join(QUANTS)}")
    ckpt = Path(ckpt).resolve()
    root = cache or user_cache("llama.cpp") / "gguf"
    out = root / f"{ckpt.name}-{source_hash(ckpt)}" / f"{quant}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{quant}.partial.gguf")
    if quant in ("f32", "bf16"):
        _convert(ckpt, tmp, quant)
    else:  # llama.cpp's usual path: quantize a lossless GGUF with its own quantizer
        _quantize(gguf_file(ckpt, "f32", cache), tmp, quant)
    tmp.replace(out)
    return out


def _convert(ckpt: Path, out: Path, outtype: str) -> None:
    # A subprocess: the converter sets up logging and sys.path for itself, and the pre-tokenizer declaration
    # (_convert_main) must not outlive it.
    script = converter()
    if not script.is_file():
        raise LlamaCppMissing(f"llama.cpp's converter is not unpacked (no {script}): run `{SETUP}`")
    cmd = [sys.executable, "-m", "verispec.bench.llamacpp", "convert", str(script), str(ckpt), str(out), outtype]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the gguf-py vendored beside it, which
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)  # is newer than gguf 0.19.0 on PyPI
    if res.returncode != 0 or not out.is_file():
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise VerispecError(f"converting {ckpt} to GGUF ({outtype}) failed:\n{tail}")


def check_gpt2_pretokenizer(tokenizer_json: Path) -> None:
    """Refuse a tokenizer whose pre-tokenization is not GPT-2's (byte-level BPE over GPT-2's regex, no normalizer):
    only then is llama.cpp's `gpt-2` pre-tokenizer the same one."""
    spec = json.loads(Path(tokenizer_json).read_text())
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    ok = (spec.get("model", {}).get("type") == "BPE" and spec.get("normalizer") is None
          and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))
    if not ok:
        raise VerispecError(f"{tokenizer_json}: not a GPT-2-style byte-level BPE tokenizer, and llama.cpp's converter "
                            "does not know its pre-tokenizer")


def _convert_main(script: str, src: str, out: str, outtype: str) -> None:
    """Run the vendored convert_hf_to_gguf.py `script` in this (child) process. A freshly trained byte-level BPE
    tokenizer is unknown to the converter's table of pre-tokenizer hashes; having checked that it is GPT-2's,
    declare it `gpt-2`."""
    check_gpt2_pretokenizer(Path(src) / "tokenizer.json")
    sys.path.insert(0, str(Path(script).parent))
    import runpy

    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # "BPE pre-tokenizer was not recognized"
            return "gpt-2"

    TextModel.get_vocab_base_pre = vocab_base_pre  # this child process only: it exists to run the converter
    sys.argv = [script, src, "--outfile", out, "--outtype", outtype]
    runpy.run_path(script, run_name="__main__")


def _quantize(src: Path, out: Path, quant: str) -> None:
    import logging

    lib = import_llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = {"q8_0": lib.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": lib.LLAMA_FTYPE_MOSTLY_Q4_0}[quant]
    params.nthread = os.cpu_count() or 1
    log = logging.getLogger("llama-cpp-python")  # the binding prints llama.cpp's log at or above its level
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        rc = lib.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    finally:
        log.setLevel(level)
    if rc != 0:
        raise VerispecError(f"llama.cpp could not quantize {src} to {quant}")


# --- arms ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Generation:
    """One greedy generation by a llama.cpp arm."""

    token_ids: list[int]  # [num_tokens]; the binaries' are their printed text tokenized again
    text: bytes  # the generated tokens' bytes
    total_s: float  # from the prompt to the last token, prefill included
    decode_s: float  # after the prefill (which yields the first token)
    num_tokens: int  # generated; the binaries stop past N, at the end of a round
    num_drafted: int = 0
    num_accepted: int = 0
    prompt_ids_equal: bool = True  # the binary tokenized the prompt's bytes back to the same ids


def parse_arm(name: str) -> tuple[str, str]:
    """`plain-q4_0` -> ("plain", "q4_0"); `lookup` -> ("lookup", "bf16")."""
    kind, sep, quant = name.partition("-")
    quant = quant if sep else "bf16"
    if kind not in KINDS or quant not in QUANTS:
        raise VerispecError(f"unknown llama.cpp arm {name!r}: KIND[-QUANT] with KIND one of {', '.join(KINDS)} "
                            f"and QUANT one of {', '.join(QUANTS)}")
    return kind, quant


def parse_arms(text: str) -> tuple[str, ...]:
    """The --llamacpp option: comma-separated arms, or `all` (DEFAULT_ARMS)."""
    arms = DEFAULT_ARMS if text.strip() == "all" else tuple(a.strip() for a in text.split(",") if a.strip())
    for a in arms:
        parse_arm(a)
    return arms


class Vocab:
    """The GGUF's vocabulary through the binding (no weights loaded)."""

    def __init__(self, path: Path) -> None:
        self.lib = import_llama_cpp()
        self.llm = self.lib.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.lib.llama_model_get_vocab(self.llm.model)
        self._buf = ctypes.create_string_buffer(256)

    def piece(self, token: int) -> bytes:
        """What llama.cpp's binaries print for a token (common_token_to_piece, special tokens rendered)."""
        n = self.lib.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, True)
        if n < 0:  # the buffer is too small: -n bytes are needed
            self._buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, self._buf, len(self._buf), 0, True)
        return self._buf.raw[:n]

    def text(self, ids: list[int]) -> bytes:
        return b"".join(self.piece(t) for t in ids)

    def encode(self, text: bytes) -> list[int]:
        """As the binaries tokenize a prompt: add_special (BOS only if the GGUF says so), special tokens parsed."""
        return self.llm.tokenize(text, add_bos=True, special=True)


class PlainArm:
    """Greedy decoding through the binding: the prompt in one prefill, then one token per forward. `exact`: without
    flash attention and with an f32 KV cache (llama.cpp's defaults keep K and V in f16), for the fp32 check."""

    def __init__(self, path: Path, n_ctx: int, threads: int, vocab: Vocab, exact: bool = False) -> None:
        self.lib, self.vocab = import_llama_cpp(), vocab
        kv = dict(type_k=self.lib.GGML_TYPE_F32, type_v=self.lib.GGML_TYPE_F32) if exact else {}
        self.llm = self.lib.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                  flash_attn=FLASH_ATTN and not exact, verbose=False, **kv)
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompt: list[int], n: int) -> Generation:
        """N tokens after `prompt` (ids), past any EOS as verispec's ignore_eos."""
        self.llm.reset()  # else the binding would reuse the previous prompt's cache
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        out = [self._argmax()]
        t1 = time.perf_counter()
        while len(out) < n:
            self.llm.eval(out[-1:])
            out.append(self._argmax())
        t2 = time.perf_counter()
        return Generation(out, self.vocab.text(out), t2 - t0, t2 - t1, len(out))


_COUNTERS = {
    "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+)"),
    "n_drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "n_accept": re.compile(r"n_accept\s*=\s*(\d+)"),
}


class BinaryArm:
    """llama.cpp's own `llama-speculative` (with a draft model) or `llama-lookup`, one process per generation."""

    def __init__(self, kind: str, path: Path, n_ctx: int, threads: int, vocab: Vocab,
                 draft: Path | None = None) -> None:
        self.exe, self.vocab, self.n_ctx = binary(kind), vocab, n_ctx
        t = str(threads)
        self.args = ["-m", str(path), "-t", t, "-tb", t, "--temp", "0", "--ignore-eos", "--seed", "0",
                     "--spec-draft-n-max", str(DRAFT), "-fa", "on" if FLASH_ATTN else "off", "--no-escape"]
        if kind == "speculative":
            if draft is None:
                raise VerispecError("the llama.cpp `speculative` arm needs a draft model")
            self.args += ["-md", str(draft), "-td", t, "-tbd", t, "-np", "1"]

    def generate(self, prompt: list[int], n: int) -> Generation:
        """At least N tokens after `prompt`; `--ignore-eos` masks EOS (verispec's ignore_eos decodes past it)."""
        text = self.vocab.text(prompt)
        with tempfile.NamedTemporaryFile(suffix=".prompt") as f:
            f.write(text)
            f.flush()  # -bf: the bytes as they are (-f would drop a trailing newline)
            ctx = max(self.n_ctx, len(prompt) + n + 2 * DRAFT + 1)  # room for the last round's draft past N
            res = subprocess.run([str(self.exe), *self.args, "-c", str(ctx), "-bf", f.name, "-n", str(n)],
                                 capture_output=True)
        err = res.stderr.decode(errors="replace")
        if res.returncode != 0:
            raise VerispecError(f"{self.exe.name} failed ({res.returncode}): {err.strip().splitlines()[-1:]}")
        c = {k: r.search(err) for k, r in _COUNTERS.items()}
        if c["encoded"] is None or c["decoded"] is None:
            raise VerispecError(f"{self.exe.name} printed no timings; its stderr ended: {err[-300:]}")
        head = b"\n\n" + text  # the binaries echo the prompt, then print each token's piece, then blank lines
        if not res.stdout.startswith(head):
            raise VerispecError(f"{self.exe.name} did not echo the prompt before its output")
        gen = res.stdout[len(head):]
        gen = gen[:-4] if gen.endswith(b"\n\n\n\n") else gen
        # seconds are printed to the ms; the decode speed (tokens / seconds) to more digits
        n_dec, enc_s = int(c["decoded"].group(1)), float(c["encoded"].group(2))
        dec_s = n_dec / float(c["decoded"].group(3))
        return Generation(self.vocab.encode(gen), gen, enc_s + dec_s, dec_s, n_dec,
                          int(c["n_drafted"].group(1)) if c["n_drafted"] else 0,
                          int(c["n_accept"].group(1)) if c["n_accept"] else 0,
                          prompt_ids_equal=self.vocab.encode(text) == prompt)


def build_arms(target: Path, arms: tuple[str, ...], n_ctx: int, threads: int, draft: Path | None = None,
               cache: Path | None = None) -> dict[str, PlainArm | BinaryArm]:
    """Each named arm ready to generate (GGUF files converted, binaries found), before any timing."""
    parsed = {a: parse_arm(a) for a in arms}
    import_llama_cpp()  # the binding (every arm tokenizes with it), then the binaries: fail before converting
    for kind, _ in parsed.values():
        if kind in BINARIES:
            binary(kind)
    vocab = Vocab(gguf_file(target, "bf16", cache))
    draft_gguf = gguf_file(draft, "bf16", cache) if draft is not None and any(
        k == "speculative" for k, _ in parsed.values()) else None
    out: dict[str, PlainArm | BinaryArm] = {}
    for name, (kind, quant) in parsed.items():
        path = gguf_file(target, quant, cache)
        out[name] = PlainArm(path, n_ctx, threads, vocab) if kind == "plain" else BinaryArm(
            kind, path, n_ctx, threads, vocab, draft_gguf)
    return out


# --- inside `verispec bench` ----------------------------------------------------------------------------------

@dataclass
class ArmCell:
    """One (task, arm): seconds summed over the task's prompts per repeat, counts from the first repeat."""

    total_times: list[float] = field(default_factory=list)
    decode_times: list[float] = field(default_factory=list)
    total_s: float = 0.0  # the current repeat's running sums
    decode_s: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    prompts: int = 0
    equal_to_plain: int = 0  # output equal to (a prefix-extension of) plain decoding's on the same GGUF
    prompt_ids_equal: int = 0


class BenchArms:
    """The llama.cpp arms of a `verispec bench` run: each prompt, right after verispec's arms on it."""

    def __init__(self, target: Path, arms: tuple[str, ...], n_ctx: int, threads: int, draft: Path | None,
                 cache: Path | None = None) -> None:
        self.arms = build_arms(target, arms, n_ctx, threads, draft, cache)
        self.cells: dict[tuple[str, str], ArmCell] = {}

    def run_prompt(self, task: str, prompt: list[int], n: int, first_repeat: bool) -> None:
        texts: dict[str, bytes] = {}
        for name, arm in self.arms.items():
            g = arm.generate(prompt, n)
            cell = self.cells.setdefault((task, name), ArmCell())
            cell.total_s += g.total_s
            cell.decode_s += g.decode_s
            if first_repeat:
                cell.tokens += g.num_tokens
                cell.drafted += g.num_drafted
                cell.accepted += g.num_accepted
                cell.prompts += 1
                cell.prompt_ids_equal += g.prompt_ids_equal
                texts[name] = g.text
        for name, text in texts.items():  # a speculative arm's reference: plain decoding of the same GGUF
            ref = texts.get(_reference(name) or "")
            if ref is not None and text[:len(ref)] == ref:
                self.cells[(task, name)].equal_to_plain += 1

    def end_repeat(self, task: str) -> None:
        for (t, _), cell in self.cells.items():
            if t == task:
                cell.total_times.append(cell.total_s)
                cell.decode_times.append(cell.decode_s)
                cell.total_s = cell.decode_s = 0.0

    def records(self) -> list[dict]:
        out = []
        for (task, name), c in self.cells.items():
            kind, quant = parse_arm(name)
            ref = _reference(name) if _reference(name) in self.arms else None
            out.append({
                "task": task, "arm": name, "kind": kind, "quant": quant, "draft": DRAFT if kind in BINARIES else 0,
                "tokens_per_s": c.tokens / statistics.median(c.total_times),
                "decode_tokens_per_s": c.tokens / statistics.median(c.decode_times),
                "acceptance_rate": c.accepted / c.drafted if c.drafted else None,
                "num_prompts": c.prompts, "num_tokens": c.tokens, "prompt_ids_equal": c.prompt_ids_equal,
                "reference": ref, "equal_to_plain": c.equal_to_plain if ref else None,
            })
        return out


def _reference(arm: str) -> str | None:
    """A speculative arm's output should be plain decoding's on the same GGUF; plain arms have no reference."""
    kind, quant = parse_arm(arm)
    return None if kind == "plain" else f"plain-{quant}"


def fp32_equality(target: Path, sets: dict[str, list[list[int]]], n: int, threads: int,
                  cache: Path | None = None) -> dict:
    """Greedy tokens of llama.cpp's f32 GGUF (through the binding, ids in and out, f32 KV cache, no flash attention)
    against verispec's fp32 plain decoding, N tokens on every prompt: how many are equal, and where each differing
    one first differs (with verispec's top-2 log-prob gap there)."""
    from verispec.bench.suite import _top2_gap
    from verispec.config import SamplingParams
    from verispec.decode import decode
    from verispec.model import load_model

    model = load_model(target, "fp32")
    path = gguf_file(target, "f32", cache)
    arm = PlainArm(path, model.config.context_limit, threads, Vocab(path), exact=True)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    equal, diffs = 0, []
    for task, prompts in sets.items():
        for i, p in enumerate(prompts):
            ours, theirs = decode(model, p, params).token_ids, arm.generate(p, n).token_ids
            if ours == theirs:
                equal += 1
                continue
            j = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            diffs.append({"task": task, "prompt": i, "position": j, "verispec": ours[j], "llama.cpp": theirs[j],
                          "top2_gap": _top2_gap(model, p + ours[:j])})
    return {"num_prompts": sum(len(p) for p in sets.values()), "num_equal": equal, "max_tokens": n,
            "differences": diffs}


def main(argv: list[str]) -> int:
    """`python -m verispec.bench.llamacpp convert SCRIPT SRC OUT TYPE` (the converter's child process) and
    `... build-dir` (where scripts/llamacpp.sh puts the build)."""
    if argv[:1] == ["convert"] and len(argv) == 5:
        _convert_main(*argv[1:])
        return 0
    if argv == ["build-dir"]:
        print(build_dir())
        return 0
    print("usage: python -m verispec.bench.llamacpp {convert SCRIPT SRC OUT TYPE | build-dir}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
