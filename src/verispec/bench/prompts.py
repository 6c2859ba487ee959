"""Benchmark prompt sets built from the held-out (bench) split of the corpus, and loaders for users' files.

Tasks:
- code_completion: a function's signature and docstring (with some file context before it); the body follows.
- code_continuation: the middle of a source file, cut at a line boundary.
- editing: a function followed by a request to repeat it with one name changed: the answer largely copies
  the prompt, the regime where prompt lookup shines.
- prose: documentation text cut at a paragraph boundary.

Long-context set (LONG_TASKS, not run by `verispec bench` by default; `--tasks long_context` runs it):
- long_context: a window of a source file ending at a line boundary, sized to ~1,000 / ~1,500 / ~1,900 tokens of
  the zoo target's tokenizer (+-5%, and under 2,048 - 200 so 192 new tokens fit the target's context); the
  file's next text follows, as in code_continuation.
  Built from the stdlib's bench-split code files directly (build_long_context), so it needs no corpus directory.

Every record keeps the part and path of its source file, so tests can check it came from the bench split.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from verispec.errors import VerispecError
from verispec.train.corpus import Document, read_split, split_of, stdlib_documents

if TYPE_CHECKING:
    from verispec.model.tokenizer import Tokenizer

TASKS = ("code_completion", "code_continuation", "editing", "prose")
LONG_TASKS = ("long_context",)  # shipped too, but kept out of TASKS: the default bench, serve and ablation sets
PROMPT_DIR = Path(__file__).parent / "prompts"
MAX_CONTEXT_CHARS = 2400


def _context_before(text: str, end: int, limit: int = MAX_CONTEXT_CHARS) -> str:
    """text[:end] trimmed to at most `limit` characters, starting at a line boundary."""
    start = max(0, end - limit)
    if start > 0:
        nl = text.find("\n", start)
        start = nl + 1 if 0 <= nl < end else start
    return text[start:end]


def _functions(doc: Document) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return []
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _line_offsets(text: str) -> list[int]:
    offsets, pos = [0], 0
    for line in text.splitlines(keepends=True):
        pos += len(line)
        offsets.append(pos)
    return offsets


def _completion(doc: Document, rng: random.Random) -> list[dict]:
    out = []
    lines = _line_offsets(doc.text)
    for fn in _functions(doc):
        body = fn.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str) and len(body) >= 2):
            continue
        doc_end = lines[body[0].end_lineno]
        fn_end = lines[fn.end_lineno]
        if fn_end - doc_end < 120:
            continue
        out.append({"prompt": _context_before(doc.text, doc_end), "reference": doc.text[doc_end:fn_end]})
    return out


def _continuation(doc: Document, rng: random.Random) -> list[dict]:
    lines = _line_offsets(doc.text)
    if len(lines) < 80:
        return []
    cut = lines[rng.randrange(40, len(lines) - 30)]
    return [{"prompt": _context_before(doc.text, cut), "reference": doc.text[cut : cut + 600]}]


def _editing(doc: Document, rng: random.Random) -> list[dict]:
    out = []
    lines = _line_offsets(doc.text)
    for fn in _functions(doc):
        n_lines = fn.end_lineno - fn.lineno + 1
        args = [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
        if not 8 <= n_lines <= 30 or not args or fn.col_offset:
            continue
        source = doc.text[lines[fn.lineno - 1] : lines[fn.end_lineno]]
        old = args[0]
        new = f"{old}_arg"
        renamed = re.sub(rf"\b{re.escape(old)}\b", new, source)
        prompt = (f"# Original version:\n{source}\n"
                  f"# The same function, with the parameter `{old}` renamed to `{new}`:\n")
        out.append({"prompt": prompt, "reference": renamed, "_body": source.rstrip("\n")})
    return out


def _prose(doc: Document, rng: random.Random) -> list[dict]:
    paragraphs = [m.start() for m in re.finditer(r"\n\n(?=\S)", doc.text)]
    candidates = [p + 2 for p in paragraphs if 800 <= p <= len(doc.text) - 400]
    cuts = rng.sample(candidates, min(4, len(candidates)))
    return [{"prompt": _context_before(doc.text, c), "reference": doc.text[c : c + 600]} for c in cuts]


BUILDERS = {"code_completion": (_completion, "code"), "code_continuation": (_continuation, "code"),
            "editing": (_editing, "code"), "prose": (_prose, "prose")}


def build_prompt_sets(corpus: Path, out_dir: Path = PROMPT_DIR, per_task: int = 48, seed: int = 0,
                      per_file: int = 3) -> dict[str, int]:
    """Write out_dir/<task>.jsonl with `per_task` prompts each, drawn with a fixed seed, at most `per_file`
    from any one source file."""
    docs = list(read_split(corpus, "bench"))
    # The stdlib repeats some code across files: drop any prompt whose text also occurs in training data.
    train_text = "\n".join(d.text for d in read_split(corpus, "train"))
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for task in TASKS:
        builder, part = BUILDERS[task]
        rng = random.Random(f"{seed}/{task}")
        pool = []
        for doc in docs:
            if doc.part != part:
                continue
            found = builder(doc, rng)
            rng.shuffle(found)
            clean = []
            for r in found:
                body = r.pop("_body", r["prompt"])  # editing prompts wrap their source; check the source itself
                if body not in train_text and r["reference"] not in train_text:
                    clean.append(r)
            pool += [dict(r, source={"part": doc.part, "path": doc.path}) for r in clean[:per_file]]
        rng.shuffle(pool)
        chosen = pool[:per_task]
        with (out_dir / f"{task}.jsonl").open("w", encoding="utf-8") as f:
            for i, r in enumerate(chosen):
                f.write(json.dumps({"id": f"{task}-{i:03d}", "task": task, **r}) + "\n")
        counts[task] = len(chosen)
    return counts


LONG_LENGTHS = (1000, 1500, 1900)
LONG_TOLERANCE = 0.05  # a prompt's token count is within this fraction of its bucket
LONG_REFERENCE_CHARS = 600  # the continuation kept after the window, as code_continuation's
# the longest window kept: the zoo target's 2,048-token context less 200, so 192 new tokens (and a little slack) fit;
# it trims the ~1,900 bucket's +-5% to 1,805-1,847 tokens
LONG_MAX_TOKENS = 2048 - 200 - 1


def _long_window(doc: Document, length: int, tokenizer: Tokenizer, rng: random.Random,
                 max_tokens: int = LONG_MAX_TOKENS, tries: int = 6) -> dict | None:
    """A window of doc.text from a line start to a line boundary `cut`, whose text tokenizes to within
    LONG_TOLERANCE of `length` tokens and to at most `max_tokens`, with at least LONG_REFERENCE_CHARS of the file
    after `cut`; None if `tries` random cuts find none. The start is a binary search over line starts (fewer
    tokens the later it is), so a window costs a dozen encodes, not one per line."""
    text = doc.text
    lines = _line_offsets(text)
    lo_tokens, hi_tokens = length * (1 - LONG_TOLERANCE), min(length * (1 + LONG_TOLERANCE), max_tokens)
    aim = min(length, max_tokens)
    # cut lines with room for the prompt before (>= 2 characters a token, generous for code) and the reference after
    cuts = [c for c in range(1, len(lines)) if lines[c] >= 2 * length and len(text) - lines[c] >= LONG_REFERENCE_CHARS
            and text[lines[c] : lines[c] + LONG_REFERENCE_CHARS].strip()]
    for _ in range(min(tries, len(cuts))):
        c = cuts.pop(rng.randrange(len(cuts)))
        cut = lines[c]
        counts: dict[int, int] = {}  # line start -> tokens of text[lines[start]:cut]

        def count(s: int, cut: int = cut, counts: dict[int, int] = counts) -> int:
            if s not in counts:
                counts[s] = len(tokenizer.encode(text[lines[s] : cut]))
            return counts[s]

        if count(0) < lo_tokens:
            continue
        lo, hi = 0, c - 1  # the last start s with count(s) >= aim: count(lo) >= aim > count(hi + 1)
        if count(hi) >= aim:
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(mid) >= aim:
                lo = mid
            else:
                hi = mid - 1
        fits = [(abs(count(s) - aim), s) for s in (lo, lo + 1) if s < c and lo_tokens <= count(s) <= hi_tokens]
        if fits:
            best = min(fits)[1]
            return {"prompt": text[lines[best] : cut], "reference": text[cut : cut + LONG_REFERENCE_CHARS],
                    "num_tokens": count(best)}
    return None


def build_long_context(out_path: Path = PROMPT_DIR / "long_context.jsonl", lengths: Iterable[int] = LONG_LENGTHS,
                       per_length: int = 8, seed: int = 0, tokenizer: Tokenizer | None = None,
                       docs: Iterable[Document] | None = None, check_training: bool = True,
                       max_tokens: int = LONG_MAX_TOKENS) -> dict[int, list[int]]:
    """Write `out_path`: for each length L, `per_length` windows of bench-split stdlib code files (split_of) that
    tokenize to L tokens +-5%, and at most `max_tokens`, with `tokenizer` (default: the zoo target's), each
    ending at a line boundary and followed by its file's next
    LONG_REFERENCE_CHARS characters, from a different file each where the split has enough, drawn with a fixed
    seed. `docs` restricts the candidate files (default: every stdlib file, stdlib_documents); files outside
    the bench split are dropped either way. With `check_training`, a window or reference whose text also occurs
    in a training-split stdlib file is skipped (the stdlib repeats some code), as build_prompt_sets does.
    Returns each length's token counts."""
    if tokenizer is None:
        from verispec.model.tokenizer import Tokenizer
        from verispec.zoo import default_target

        tokenizer = Tokenizer.from_dir(default_target())
    all_docs = list(stdlib_documents() if docs is None else docs)
    bench = [d for d in all_docs if d.part == "code" and split_of(d.part, d.path) == "bench"]
    train_text = b""  # utf-8: bytes search is ~15x faster than str search over the stdlib's non-ASCII text
    if check_training:
        train_docs = all_docs if docs is None else stdlib_documents()
        train_text = "\n".join(d.text for d in train_docs if split_of(d.part, d.path) == "train").encode()
    used: set[str] = set()
    records, counts = [], {}
    for length in lengths:
        rng = random.Random(f"{seed}/long_context/{length}")
        order = bench[:]
        rng.shuffle(order)
        chosen: list[dict] = []
        # files no other window used first, then (where the split runs short) files already used, another window
        for doc in [d for d in order if d.path not in used] + [d for d in order if d.path in used]:
            if len(chosen) == per_length:
                break
            r = _long_window(doc, length, tokenizer, rng, max_tokens)
            if r is None or any(r["prompt"] == c["prompt"] for c in chosen):
                continue
            if check_training and (r["prompt"].encode() in train_text or r["reference"].encode() in train_text):
                continue
            used.add(doc.path)
            chosen.append({"prompt": r["prompt"], "reference": r["reference"],
                           "source": {"part": doc.part, "path": doc.path}, "length_bucket": length,
                           "num_tokens": r["num_tokens"]})
        if len(chosen) < per_length:
            raise VerispecError(f"only {len(chosen)} of {per_length} bench-split windows of ~{length} tokens found")
        records += chosen
        counts[length] = [r["num_tokens"] for r in chosen]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({"id": f"long_context-{i:03d}", "task": "long_context", **r}) + "\n")
    return counts


def load_task(task: str) -> list[dict]:
    """A shipped prompt set by name: one of TASKS or LONG_TASKS (load_prompts' records)."""
    if task not in TASKS + LONG_TASKS:
        raise VerispecError(f"unknown prompt set {task!r}: expected one of {', '.join(TASKS + LONG_TASKS)}")
    return load_prompts(PROMPT_DIR / f"{task}.jsonl")


def load_prompts(path: Path) -> list[dict]:
    """A JSONL prompt file: verispec's own records, plain {"prompt": ...} lines, or Spec-Bench's
    question.jsonl ({"question_id", "category", "turns": [...]}: the first turn is the prompt)."""
    if not path.is_file():
        raise VerispecError(f"prompt file not found: {path}")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise VerispecError(f"{path}:{n}: not JSON: {e.msg}") from None
        if isinstance(d, dict) and isinstance(d.get("prompt"), str):
            records.append({"id": str(d.get("id", n)), "task": d.get("task", path.stem), "prompt": d["prompt"],
                            # long_context's bucket and token count, where a record has them
                            **{k: d[k] for k in ("length_bucket", "num_tokens") if isinstance(d.get(k), int)}})
        elif isinstance(d, dict) and isinstance(d.get("turns"), list) and d["turns"]:
            records.append({"id": str(d.get("question_id", n)), "task": d.get("category", path.stem),
                            "prompt": str(d["turns"][0])})
        else:
            raise VerispecError(f"{path}:{n}: expected a 'prompt' string or Spec-Bench 'turns'")
    if not records:
        raise VerispecError(f"{path} holds no prompts")
    return records
