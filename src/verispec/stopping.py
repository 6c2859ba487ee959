"""Stop conditions applied token by token to each round's committed block.

The earliest event wins: EOS, a completed stop string, max_tokens, or the context limit. Nothing after it is
emitted: not in token ids, not in text, not in the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.config import SamplingParams
from verispec.errors import ConfigError
from verispec.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class Emitted:
    token_ids: list[int]  # tokens kept from the block
    text: str  # text safe to stream now (held back while it could still start a stop string)
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | int | None = None  # the stop string or EOS id that ended generation


class StopChecker:
    def __init__(
        self,
        params: SamplingParams,
        prompt_len: int,
        context_limit: int,
        eos_token_ids: tuple[int, ...],
        tokenizer: Tokenizer | None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        if params.stop and tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        self.params = params
        self.prompt_len = prompt_len
        self.context_limit = context_limit
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.output: list[int] = []
        self.text = ""  # full output text so far (truncated at a stop string once one matches)
        self._sent = 0  # characters of text already streamed
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def extend(self, block: list[int]) -> Emitted:
        kept: list[int] = []
        reason: str | None = None
        stop_reason: str | int | None = None
        for tok in block:
            kept.append(tok)
            self.output.append(tok)
            if tok in self.eos:
                reason, stop_reason = "stop", tok
                break
            if self.detok is not None:
                before = len(self.text)
                self.text += self.detok.add(tok)
                hit = self._find_stop(before)
                if hit is not None:
                    reason, stop_reason = "stop", hit
                    break
            if len(self.output) >= self.params.max_tokens or self.prompt_len + len(self.output) >= self.context_limit:
                reason = "length"
                break
        if reason is not None and self.detok is not None and not isinstance(stop_reason, str):
            self.text += self.detok.flush()
        return Emitted(kept, self._stream_delta(final=reason is not None), reason, stop_reason)

    def _find_stop(self, before: int) -> str | None:
        """Look for a stop string ending in the text added since `before`; truncate the text at the earliest."""
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            idx = self.text.find(s, max(0, before - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def _stream_delta(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._holdback)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
