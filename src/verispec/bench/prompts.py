"""Benchmark prompt sets built from the held-out (bench) split of the corpus, and loaders for users' files.

Tasks:
- code_completion: a function's signature and docstring (with some file context before it); the body follows.
- code_continuation: the middle of a source file, cut at a line boundary.
- editing: a function followed by a request to repeat it with one name changed: the answer largely copies
  the prompt, the regime where prompt lookup shines.
- prose: documentation text cut at a paragraph boundary.

Every record keeps the part and path of its source file, so tests can check it came from the bench split.
"""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

from verispec.errors import VerispecError
from verispec.train.corpus import Document, read_split

TASKS = ("code_completion", "code_continuation", "editing", "prose")
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
            records.append({"id": str(d.get("id", n)), "task": d.get("task", path.stem), "prompt": d["prompt"]})
        elif isinstance(d, dict) and isinstance(d.get("turns"), list) and d["turns"]:
            records.append({"id": str(d.get("question_id", n)), "task": d.get("category", path.stem),
                            "prompt": str(d["turns"][0])})
        else:
            raise VerispecError(f"{path}:{n}: expected a 'prompt' string or Spec-Bench 'turns'")
    if not records:
        raise VerispecError(f"{path} holds no prompts")
    return records
