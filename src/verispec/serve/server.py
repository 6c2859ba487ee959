"""Building and running the server: load the models, start the engine loop, hand the app to uvicorn."""

from __future__ import annotations

from pathlib import Path

from verispec.config import DEFAULT_DTYPE, EngineConfig
from verispec.engine.async_engine import AsyncEngine
from verispec.engine.engine import Engine
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer
from verispec.serve.app import ServerState, create_app, is_loopback
from verispec.serve.chat import ChatTemplate
from verispec.serve.launch import check_bind, run_app
from verispec.serve.protocol import ServeLimits


def build_state(
    target_dir: Path, config: EngineConfig, *, dtype: str = DEFAULT_DTYPE, api_key: str | None = None,
    model_name: str | None = None, max_body_bytes: int = 4 << 20, context_limit: int | None = None,
    drafters: tuple[str, ...] = (), limits: ServeLimits = ServeLimits(),
) -> ServerState:
    """`drafters`: specs requests may choose besides the engine's default (built now, so a bad one fails at
    startup)."""
    target = load_model(target_dir, dtype=dtype)
    target.source_dir = target_dir
    tokenizer = Tokenizer.from_dir(target_dir)
    engine = Engine(target, tokenizer, config, context_limit=context_limit)
    for spec in ([config.drafter] if config.drafter else []) + list(drafters):
        engine.drafter(spec)  # a bad drafter fails at startup, not on the first request
    return ServerState(
        engine=AsyncEngine(engine).start(), tokenizer=tokenizer, model_name=model_name or Path(target_dir).name,
        api_key=api_key, max_body_bytes=max_body_bytes, limits=limits, chat=ChatTemplate.from_dir(target_dir),
        drafters=drafters,
    )


def serve(state: ServerState, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    check_bind(host, state.api_key)
    run_app(create_app(state), host, port, log_level)
