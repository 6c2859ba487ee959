"""The offline training corpus: Python's standard library source (code) and Python's reST documentation
(prose), split deterministically by file into train / validation / held-out benchmark text.

Sources (both PSF licence):
- code: the `.py` files of the running interpreter's standard library (`sysconfig` stdlib path, no
  site-packages);
- prose: the reST sources of the Python documentation, Debian package `python3.11-doc`
  (`usr/share/doc/python3.11/html/_sources/**/*.rst.txt`), fetched with `apt-get download` and unpacked with
  `dpkg-deb -x` (no installation), or read from `--doc-dir` / an installed copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError

SPLITS = ("train", "val", "bench")
DOC_PACKAGE = "python3.11-doc"
DOC_SOURCES = Path("usr/share/doc/python3.11/html/_sources")
LICENCE = "PSF-2.0 (Python Software Foundation License)"


@dataclass(frozen=True)
class Document:
    part: str  # "code" | "prose"
    path: str  # relative to its source root; the split key
    text: str


def split_of(part: str, path: str) -> str:
    """Deterministic split by file: a hash of the path decides, so a file never straddles two splits."""
    bucket = int(hashlib.sha256(f"{part}/{path}".encode()).hexdigest(), 16) % 100
    return "train" if bucket < 90 else "val" if bucket < 95 else "bench"


def stdlib_documents(root: Path | None = None) -> Iterator[Document]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")):
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document("code", rel, text)


def find_doc_sources(doc_dir: Path | None, workdir: Path) -> Path:
    """The reST sources: `doc_dir`, an installed copy, or the Debian package unpacked into `workdir`."""
    candidates = [doc_dir] if doc_dir else [Path("/") / DOC_SOURCES]
    for c in candidates:
        if c and c.is_dir():
            return c
    if doc_dir:
        raise VerispecError(f"documentation directory not found: {doc_dir}")
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise VerispecError(f"need apt-get and dpkg-deb to fetch {DOC_PACKAGE}, or pass --doc-dir")
    subprocess.run(["apt-get", "download", DOC_PACKAGE], cwd=workdir, check=True, capture_output=True)
    deb = next(workdir.glob(f"{DOC_PACKAGE}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
    return workdir / "root" / DOC_SOURCES


def doc_documents(root: Path) -> Iterator[Document]:
    for f in sorted(root.rglob("*.rst.txt")):
        text = f.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document("prose", f.relative_to(root).as_posix(), text)


def build_corpus(out: Path, doc_dir: Path | None = None, stdlib_dir: Path | None = None) -> dict:
    """Write out/{train,val,bench}.jsonl (one document per line) and out/manifest.json."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {s: {"code": [0, 0], "prose": [0, 0]} for s in SPLITS}  # [files, characters]
    with tempfile.TemporaryDirectory() as tmp:
        docs_root = find_doc_sources(doc_dir, Path(tmp))
        files = {s: (out / f"{s}.jsonl").open("w", encoding="utf-8") for s in SPLITS}
        try:
            for doc in [*stdlib_documents(stdlib_dir), *doc_documents(docs_root)]:
                split = split_of(doc.part, doc.path)
                files[split].write(json.dumps({"part": doc.part, "path": doc.path, "text": doc.text}) + "\n")
                counts[split][doc.part][0] += 1
                counts[split][doc.part][1] += len(doc.text)
        finally:
            for f in files.values():
                f.close()
    manifest = {
        "sources": {
            "code": {"what": "Python standard library source (.py)", "from": sysconfig.get_paths()["stdlib"],
                     "licence": LICENCE},
            "prose": {"what": "Python documentation reST sources", "from": f"Debian package {DOC_PACKAGE}",
                      "licence": LICENCE},
        },
        "split": "sha256('<part>/<path>') % 100: <90 train, <95 val, else bench",
        "counts": {s: {p: {"files": c[0], "chars": c[1]} for p, c in parts.items()} for s, parts in counts.items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_split(corpus: Path, split: str) -> Iterator[Document]:
    path = corpus / f"{split}.jsonl"
    if not path.is_file():
        raise VerispecError(f"corpus split not found: {path} (build it with `verispec corpus build`)")
    with path.open(encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            yield Document(d["part"], d["path"], d["text"])
