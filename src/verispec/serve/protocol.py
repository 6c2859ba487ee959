"""OpenAI request bodies -> validated engine inputs; every problem is an APIError naming the parameter.

Unknown fields are ignored (clients send vendor extensions); known fields are checked strictly: a wrong type or an
out-of-range value is a 400 with `param` set, never a 500 and never silently clamped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verispec.config import POLICIES, VERIFY_RULES, RequestSpec, SamplingParams, TreeConfig
from verispec.errors import ConfigError

INT64 = 1 << 63
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024


@dataclass(frozen=True)
class ServeLimits:
    """Per-request limits of one server (`verispec serve --max-tokens-limit`, `--body-timeout`)."""

    # The most new tokens one request may ask for; also what a chat request without max_tokens gets (OpenAI's
    # "up to the context", bounded), so one client cannot reserve the whole context by omission.
    max_tokens_limit: int = 2048
    completion_max_tokens: int = 16  # /v1/completions without max_tokens: OpenAI's default
    body_timeout_s: float = 30.0  # the whole request body must arrive within this, else 408 (a stalled upload)

    def __post_init__(self) -> None:
        if self.max_tokens_limit < 1 or self.completion_max_tokens < 1:
            raise ConfigError("max_tokens_limit and completion_max_tokens must be >= 1")
        if not self.body_timeout_s > 0:
            raise ConfigError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")


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


def _show(v: int | float) -> str:
    # A JSON number may have thousands of digits: never put all of them in an error message.
    return str(v) if abs(v) < 1e18 else "a number out of range"


def _int(body: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"{name} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(name, f"{name} must be in [{lo}, {hi}], got {_show(v)}")
    return v


def _float(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"{name} must be a number, got {type(v).__name__}")
    if not (lo <= v <= hi) or (lo_open and v == lo):  # exact for any int: float() of a huge one overflows
        raise _bad(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {_show(v)}")
    return float(v)  # NaN fails every comparison above; +-Infinity is out of range


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"{name} must be a boolean, got {type(v).__name__}")
    return v


def _typed(body: dict, name: str, kind: type, what: str):
    """body[name] if it is absent (None) or a `kind`; any other value, falsy ones included, is a 400."""
    v = body.get(name)
    if v is not None and not isinstance(v, kind):
        raise _bad(name, f"{name} must be {what}, got {type(v).__name__}")
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


def parse_tree(value: Any) -> TreeConfig | None:
    if value is None:
        return None
    if value in ("off", "auto"):
        return TreeConfig(mode=value)
    if not isinstance(value, dict) or set(value) - {"mode", "width", "depth", "nodes"}:
        raise _bad("speculation.tree", 'speculation.tree must be "off", "auto" or an object {"mode", "width", '
                                       '"depth", "nodes"}')
    for key in ("width", "depth", "nodes"):
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64):
            raise _bad(f"speculation.tree.{key}", f"speculation.tree.{key} must be an integer in [1, 64]")
    try:
        return TreeConfig(**{"mode": "auto", **value})
    except (ConfigError, TypeError) as e:
        raise _bad("speculation.tree", str(e)) from None


def parse_speculation(value: Any) -> RequestSpec:
    """`"off"` / false, or {"method": drafter spec, "k": int | "auto", "policy": name, "verify": rule, "tree": shape}
    with shape "off", "auto" or {"mode": "auto" | "off", "width": int, "depth": int, "nodes": int} (TreeConfig's
    defaults fill what it leaves out; drafters that draw requested trees: model, eagle, mtp, medusa)."""
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
    if not isinstance(verify, str) or verify not in VERIFY_RULES:
        raise _bad("speculation.verify", f"speculation.verify must be one of {VERIFY_RULES}")
    tree = parse_tree(value.get("tree"))
    try:
        return RequestSpec(drafter="none" if method == "off" else method, policy=policy, k=k, verify=verify,
                           tree=tree)
    except ConfigError as e:
        raise _bad("speculation", str(e)) from None


def refuse_unsupported(body: dict) -> None:
    """OpenAI parameters that would change what a request means are refused, never ignored; their defaults (false,
    "", {"type": "text"}, no tools) pass, and a wrong type is a 400 like any other."""
    if _bool(body, "echo", False):
        raise _bad("echo", "echo is not supported")
    suffix = _typed(body, "suffix", str, "a string")
    if suffix:
        raise _bad("suffix", "suffix (insertion) is not supported")
    fmt = _typed(body, "response_format", dict, "an object")
    if fmt is not None and fmt.get("type") != "text":
        raise _bad("response_format", 'only response_format {"type": "text"} is supported (no JSON mode or schema)')
    # The model is never shown tools and never calls one: allowed only where the client says not to call any.
    for tools_name, choice_name in (("tools", "tool_choice"), ("functions", "function_call")):
        tools, choice = body.get(tools_name), body.get(choice_name)
        if tools is not None and not isinstance(tools, list):
            raise _bad(tools_name, f"{tools_name} must be a list")
        if choice is not None and not isinstance(choice, (str, dict)):
            raise _bad(choice_name, f"{choice_name} must be a string or an object")
        if choice is not None and choice not in ("none", "auto"):
            raise _bad(choice_name, f'{choice_name} other than "none" or "auto" is not supported (no tool calling)')
        if tools and choice != "none":
            raise _bad(tools_name, f'{tools_name} are not supported (no tool calling) unless {choice_name} is "none"')
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
        raise _bad("modalities", 'only modalities ["text"] is supported')
    if body.get("audio") is not None:
        raise _bad("audio", "audio output is not supported")


def _max_tokens(body: dict, prompt_len: int, context_limit: int, default: int, limit: int, prompt_param: str) -> int:
    room = context_limit - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the context limit is {context_limit}, so at most "
                            f"{context_limit - 1} prompt tokens leave room to generate",
                       param=prompt_param, code="context_length_exceeded")
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = _int(body, "max_completion_tokens", 1, INT64 - 1, None)
    max_tokens = _int(body, "max_tokens", 1, INT64 - 1, max_tokens)
    if max_tokens is None:
        return max(1, min(default, room))
    if max_tokens > room:
        raise APIError(400, f"{name} {_show(max_tokens)} + the prompt's {prompt_len} tokens exceed the context "
                            f"limit of {context_limit}; at most {room} new tokens fit", param=name,
                       code="context_length_exceeded")
    if max_tokens > limit:
        raise _bad(name, f"{name} {max_tokens} exceeds this server's limit of {limit} new tokens per request")
    return max_tokens


def parse_sampling(body: dict, prompt_len: int, context_limit: int, vocab_size: int, *, chat: bool,
                   limits: ServeLimits, fits: int | None = None) -> SamplingParams:
    """`fits`: the most new tokens the KV cache budget leaves this prompt; bounds the default only (an explicit
    max_tokens over it is the engine's to refuse)."""
    for name in ("n", "best_of"):
        if _int(body, name, 1, 1 << 30, 1) != 1:
            raise _bad(name, f"{name} > 1 is not supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _float(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise _bad(name, f"{name} is not supported (only 0)")
    if _float(body, "min_p", 0.0, 1.0, 0.0) != 0.0:
        raise _bad("min_p", "min_p is not supported (only 0)")
    # chat: logprobs is a boolean; completions: the number of top tokens (OpenAI's types)
    logprobs = _bool(body, "logprobs", False) if chat else _int(body, "logprobs", 0, 1 << 30, 0)
    if logprobs:
        raise _bad("logprobs", "logprobs are not supported")
    if _int(body, "top_logprobs", 0, 1 << 30, 0):
        raise _bad("top_logprobs", "logprobs are not supported")
    if _typed(body, "logit_bias", dict, "an object"):
        raise _bad("logit_bias", "logit_bias is not supported")
    default = limits.max_tokens_limit if chat else min(limits.completion_max_tokens, limits.max_tokens_limit)
    default = default if fits is None else min(default, fits)
    max_tokens = _max_tokens(body, prompt_len, context_limit, default, limits.max_tokens_limit,
                             "messages" if chat else "prompt")  # the field that makes the prompt
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
    ignore_eos = _bool(body, "ignore_eos", False)
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
        seed=None if seed is None else seed % INT64, stop=tuple(stop), ignore_eos=ignore_eos,
    )


def parse_stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = _typed(body, "stream_options", dict, "an object")
    if opts is None:
        return stream, False
    usage = opts.get("include_usage", False)
    if usage is not None and not isinstance(usage, bool):
        raise _bad("stream_options.include_usage", "include_usage must be a boolean")
    return stream, bool(usage)


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
