"""The checkpoint's `tokenizer.json` (Hugging Face tokenizers) and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from verispec.errors import CheckpointError


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None,
                 add_bos: bool = False) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.is_file():
            raise CheckpointError(f"{path} has no tokenizer.json (pass token ids, or a directory with one)")
        try:
            tok = _HFTokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"cannot read {f}: {e}") from None
        eos: tuple[int, ...] = ()
        bos = None
        add_bos = False
        tcfg = path / "tokenizer_config.json"
        if tcfg.is_file():
            meta = json.loads(tcfg.read_text())
            eos_tok, bos_tok = meta.get("eos_token"), meta.get("bos_token")
            eos_tok = eos_tok.get("content") if isinstance(eos_tok, dict) else eos_tok
            bos_tok = bos_tok.get("content") if isinstance(bos_tok, dict) else bos_tok
            if eos_tok and tok.token_to_id(eos_tok) is not None:
                eos = (tok.token_to_id(eos_tok),)
            if bos_tok:
                bos = tok.token_to_id(bos_tok)
            add_bos = bool(meta.get("add_bos_token", False))
        return cls(tok, eos, bos, add_bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"the tokenizer has no token {token!r}")
        return tid

    def special_tokens(self) -> list[str]:
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def plain_text_copy(self) -> Tokenizer:
        """A copy that encodes special-token strings in user text as ordinary text (no `<|eos|>` injection)."""
        tok = _HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return Tokenizer(tok, self.eos_token_ids, self.bos_token_id, self.add_bos)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(Path(path) / "tokenizer.json"))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never end inside a UTF-8 character.

    Byte-level tokens can split a character; decoding a partial character gives U+FFFD, so such text is held
    back until the next token completes it. Only a short window of tokens is re-decoded per step.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""  # text emitted so far
        # Decode with a few prompt tokens in front so leading spaces/merges render as in the full text.
        self._context = list(prompt_ids[-4:]) if prompt_ids else []
        self._prefix = 0  # window start (index into context + ids)
        self._read = len(self._context)  # tokens up to here are fully emitted
        self._held = 0  # characters of the window past _read already emitted while its tail is incomplete

    def add(self, token_id: int) -> str:
        """Append one token; return the newly printable text (possibly empty)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: emit whatever is held back, replacement characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        seq = self._context + self.ids
        prefix_text = self.tok.decode(seq[self._prefix : self._read])
        new = self.tok.decode(seq[self._prefix :])[len(prefix_text) :]
        incomplete = new.endswith("\ufffd") and not final
        # Emit the complete characters now (a stop string may end there); hold back only the broken tail.
        ready = new.rstrip("\ufffd") if incomplete else new
        delta = ready[self._held :]
        if incomplete:
            self._held = len(ready)
        else:
            self._prefix, self._read, self._held = self._read, len(seq), 0
        self.text += delta
        return delta
