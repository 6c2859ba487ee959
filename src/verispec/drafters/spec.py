"""Drafter specs: the `name:arg` shorthand, and structured specs `name(key=value, ...)` whose values may be specs.

    ngram                       lookup:dspark:zoo/dspark
    vericache(compress=streaming, budget=256, draft=lookup:dspark:zoo/dspark)

A structured spec's values end at a top-level comma or the closing parenthesis, so a nested spec may itself be
structured (parentheses balance); whitespace around keys and values is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.errors import ConfigError


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    arg: str | None = None  # the shorthand's argument (`name:arg`)
    options: dict[str, str] = field(default_factory=dict)  # a structured spec's key=value pairs


def parse_spec(spec: str) -> DrafterSpec:
    spec = spec.strip()
    paren, colon = spec.find("("), spec.find(":")
    if paren < 0 or 0 <= colon < paren:
        name, _, arg = spec.partition(":")
        return DrafterSpec(name.strip(), arg or None)
    name = spec[:paren].strip()
    if not spec.endswith(")"):
        raise ConfigError(f"drafter spec {spec!r}: a structured spec ends with ')'")
    body = spec[paren + 1 : -1]
    options: dict[str, str] = {}
    for part in _split_top(body, spec):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ConfigError(f"drafter spec {spec!r}: expected key=value, got {part.strip()!r}")
        if key in options:
            raise ConfigError(f"drafter spec {spec!r}: option {key!r} given twice")
        options[key] = value
    return DrafterSpec(name, None, options)


def split_specs(text: str) -> list[str]:
    """A comma-separated list of drafter specs (`--methods ngram,vericache(budget=128,draft=ngram)`), split at
    the commas outside parentheses."""
    return [part.strip() for part in _split_top(text, text) if part.strip()]


def _split_top(body: str, spec: str) -> list[str]:
    """`body` split at commas outside parentheses (empty body: no parts)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"drafter spec {spec!r}: unbalanced ')'")
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"drafter spec {spec!r}: unbalanced '('")
    if body.strip():
        parts.append(body[start:])
    return parts
