"""Chat messages -> prompt text: the checkpoint's own template when it has one, else a documented default.

A checkpoint template (`chat_template` in tokenizer_config.json) is rendered in Jinja's immutable sandbox, so a
template cannot reach Python internals. Without one (the zoo's models are not chat-tuned) the default is

    <role>: <content>\\n\\n ... assistant:
"""

from __future__ import annotations

import json
from pathlib import Path

from verispec.errors import ConfigError


def default_template(messages: list[dict[str, str]]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:"


class ChatTemplate:
    def __init__(self, template: str | None = None) -> None:
        self.source = template
        self._compiled = None
        if template:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ConfigError("the checkpoint has a chat_template but jinja2 is not installed") from None
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._compiled = env.from_string(template)

    @classmethod
    def from_dir(cls, path: Path | None) -> ChatTemplate:
        cfg = Path(path) / "tokenizer_config.json" if path else None
        if cfg is not None and cfg.is_file():
            template = json.loads(cfg.read_text()).get("chat_template")
            if isinstance(template, str):
                return cls(template)
        return cls(None)

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._compiled is None:
            return default_template(messages)
        return self._compiled.render(messages=messages, add_generation_prompt=True)
