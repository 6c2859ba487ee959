"""OpenAI request bodies -> validated engine inputs; every problem is an APIError naming the parameter.

Unknown fields are ignored (clients send vendor extensions); known fields are checked strictly: a wrong type or an
out-of-range value is a 400 with `param` set, never a 500 and never silently clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from verispec.config import POLICIES, RequestSpec, SamplingParams
from verispec.errors import ConfigError

INT64 = 1 << 63
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        # Bounded and never echoes the request body back.
        return {"error": {"message": self.message[:1000], "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _int(body: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"{name} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(name, f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _float(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise _bad(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return v


def _check_text(param: str, text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, f"{param} is not valid Unicode (lone surrogate)") from None
    return text


@dataclass(frozen=True)
class Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    spec: RequestSpec
    stream: bool
    include_usage: bool
    echo_model: str


def parse_speculation(value: Any) -> RequestSpec:
    """`"off"` / false, or {"method": drafter spec, "k": int | "auto", "policy": name, "verify": rule}."""
    if value is None or value is True:
        return RequestSpec()
    if value is False or value == "off":
        return RequestSpec(drafter="none")
    if not isinstance(value, dict):
        raise _bad("speculation", 'speculation must be "off" or an object {"method", "k", "policy"}')
    method = value.get("method")
    if method is not None and (not isinstance(method, str) or not method):
        raise _bad("speculation.method", "speculation.method must be a drafter name such as 'ngram'")
    k, policy = value.get("k"), value.get("policy")
    if policy is not None and policy not in POLICIES:
        raise _bad("speculation.policy", f"speculation.policy must be one of {POLICIES}")
    if k == "auto":
        k, policy = None, policy or "dspark"
    elif k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 32:
            raise _bad("speculation.k", 'speculation.k must be an integer in [0, 32] or "auto"')
        policy = policy or ("off" if k == 0 else "fixed")
    verify = value.get("verify", "auto")
    try:
        return RequestSpec(drafter="none" if method == "off" else method, policy=policy, k=k, verify=verify)
    except ConfigError as e:
        raise _bad("speculation", str(e)) from None


def parse_sampling(body: dict, prompt_len: int, context_limit: int, vocab_size: int) -> SamplingParams:
    for name in ("n", "best_of"):
        if _int(body, name, 1, 1 << 30, 1) != 1:
            raise _bad(name, f"{name} > 1 is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _float(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise _bad(name, f"{name} is not supported (only 0)")
    if _float(body, "min_p", 0.0, 1.0, 0.0) != 0.0:
        raise _bad("min_p", "min_p is not supported (only 0)")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _bad("logprobs", "logprobs are not supported")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported")
    room = context_limit - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the context limit is {context_limit}, so at most "
                            f"{context_limit - 1} prompt tokens leave room to generate",
                       param="prompt", code="context_length_exceeded")
    max_tokens = _int(body, "max_completion_tokens", 1, INT64 - 1, None)
    max_tokens = _int(body, "max_tokens", 1, INT64 - 1, max_tokens)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"max_tokens {max_tokens} + the prompt's {prompt_len} tokens exceed the context limit "
                            f"of {context_limit}; at most {room} new tokens fit", param="max_tokens",
                       code="context_length_exceeded")
    temperature = _float(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _float(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1, vocab_size, 0)
    seed = _int(body, "seed", -INT64, INT64 - 1, None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("stop", "stop must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad("stop", f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters")
    for s in stop:
        _check_text("stop", s)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "ignore_eos must be a boolean")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
        seed=None if seed is None else seed % INT64, stop=tuple(stop), ignore_eos=ignore_eos,
    )


def parse_stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "stream must be a boolean")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options", "stream_options must be an object")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise _bad("stream_options.include_usage", "include_usage must be a boolean")
    return stream, usage


def completion_prompt(body: dict, encode, vocab_size: int) -> list[int]:
    """`prompt`: a string, a list with one string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "the prompt is empty")
        ids = encode(_check_text("prompt", prompt))
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise _bad("prompt", f"prompt token ids must be in [0, {vocab_size})")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt", "one prompt per request is supported")
    else:
        raise _bad("prompt", "prompt must be a non-empty string or a list of token ids")
    if not ids:
        raise _bad("prompt", "the prompt encodes to no tokens")
    return ids


def chat_messages(body: dict, special_tokens: list[str]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise _bad("messages", f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer"):
            raise _bad(f"messages[{i}].role", "role must be system, developer, user or assistant")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str) or not content:
            raise _bad(f"messages[{i}].content", "content must be a non-empty string")
        _check_text(f"messages[{i}].content", content)
        if any(tok and tok in content for tok in special_tokens):
            raise _bad(f"messages[{i}].content", "content contains a special-token string")
        out.append({"role": role, "content": content})
    return out
