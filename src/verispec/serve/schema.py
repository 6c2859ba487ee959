"""OpenAPI descriptions of the request and response bodies of /v1/completions and /v1/chat/completions.

Documentation for clients and the fuzzer (tests/test_fuzz_server.py), not validation: protocol.py checks every body
and names the offending parameter in its 400. These schemas say what it accepts, so they are built per server (token
ids, top_k, max_tokens, the model name and the drafters depend on it). Unknown fields are allowed: protocol.py
ignores them. Limits that depend on the prompt (max_tokens + prompt tokens <= the context) are not expressible here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verispec.config import POLICIES, VERIFY_RULES
from verispec.serve.protocol import INT64, MAX_MESSAGES, MAX_STOP, MAX_STOP_CHARS

if TYPE_CHECKING:
    from verispec.serve.app import ServerState

Schema = dict


def _null_or(*schemas: Schema) -> Schema:
    return {"anyOf": [*schemas, {"type": "null"}]}


def _only_zero(what: str) -> Schema:
    return {"type": ["number", "null"], "minimum": 0, "maximum": 0, "description": f"{what}: only 0 is supported"}


def _speculation(drafters: tuple[str, ...]) -> Schema:
    # A request names an enabled spec, or a registry name that matches exactly one of them (ServerState).
    names = [d.partition(":")[0] for d in drafters]
    unique = [n for n in dict.fromkeys(names) if names.count(n) == 1 and n not in drafters]
    spec = {
        "type": "object",
        "properties": {
            "method": {"enum": ["off", "none", *drafters, *unique, None],
                       "description": "a drafter this server enabled (--drafters), or off"},
            "k": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 32}, {"const": "auto"}, {"type": "null"}],
                  "description": 'the draft length; "auto" lets the dspark policy choose per round'},
            "policy": {"enum": [*POLICIES, None]},
            "verify": {"enum": list(VERIFY_RULES)},
        },
    }
    return {"anyOf": [spec, {"const": "off"}, {"type": ["boolean", "null"]}],
            "description": 'per-request speculation: "off" / false, true (the server default) or an object'}


def _common(vocab_size: int, context_limit: int, model: str, drafters: tuple[str, ...]) -> dict[str, Schema]:
    """Fields both routes accept (protocol.parse_sampling, parse_stream, parse_speculation)."""
    max_new = {"type": ["integer", "null"], "minimum": 1, "maximum": context_limit - 1,
               "description": "new tokens at most; with the prompt's tokens within the context limit"}
    stop_text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {
        "model": {"enum": [model, None], "description": "the served model (GET /v1/models)"},
        "max_tokens": max_new,
        # Only range-checked when max_tokens is given too (max_tokens wins), so no context bound here.
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": INT64 - 1,
                                  "description": "max_tokens' newer name; max_tokens wins when both are given"},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2, "description": "0 is greedy"},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": vocab_size, "description": "0 or -1: off"},
        "seed": {"type": ["integer", "null"], "minimum": -INT64, "maximum": INT64 - 1},
        "stop": _null_or(stop_text, {"type": "array", "items": stop_text, "maxItems": MAX_STOP}),
        "stream": {"type": ["boolean", "null"]},
        "stream_options": _null_or({"type": "object",
                                    "properties": {"include_usage": {"type": ["boolean", "null"]}}}),
        "ignore_eos": {"type": ["boolean", "null"]},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 1, "description": "only 1 is supported"},
        "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": 1, "description": "only 1 is supported"},
        "presence_penalty": _only_zero("presence_penalty"),
        "frequency_penalty": _only_zero("frequency_penalty"),
        "min_p": _only_zero("min_p"),
        "top_logprobs": {"enum": [0, None], "description": "logprobs are not supported"},
        "logit_bias": _null_or({"type": "object", "maxProperties": 0, "description": "not supported"}),
        "speculation": _speculation(drafters),
    }


def _completion_body(vocab_size: int, context_limit: int, common: dict[str, Schema]) -> Schema:
    ids = {"type": "array", "minItems": 1, "maxItems": context_limit - 1,
           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, ids, {"type": "array", "items": {"anyOf": [text, ids]}, "minItems": 1, "maxItems": 1}],
              "description": "one prompt: a string, a list of token ids, or a list holding one of them"}
    props = {"prompt": prompt, **common,
             "logprobs": {"enum": [0, None], "description": "logprobs are not supported"},
             "echo": {"enum": [False, None], "description": "not supported"},
             "suffix": {"enum": ["", None], "description": "not supported"}}
    return {"type": "object", "required": ["prompt"], "properties": props}


def _chat_body(common: dict[str, Schema]) -> Schema:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {
        "type": "object", "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant"]},
            "content": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": part, "minItems": 1}],
                        "description": "non-empty text (or text parts); special-token strings are refused"},
        },
    }
    props = {"messages": {"type": "array", "items": message, "minItems": 1, "maxItems": MAX_MESSAGES}, **common,
             "logprobs": {"enum": [False, None], "description": "logprobs are not supported"},
             "response_format": _null_or({"type": "object", "required": ["type"],
                                          "properties": {"type": {"const": "text"}}}),
             "modalities": _null_or({"type": "array", "items": {"const": "text"}}),
             "audio": {"type": "null", "description": "not supported"}}
    # No tool calling: tools (functions) are allowed only with tool_choice (function_call) "none".
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        props[tools] = {"type": ["array", "null"], "description": f'not supported unless {choice} is "none"'}
        props[choice] = {"enum": ["none", "auto", None]}
    return {"type": "object", "required": ["messages"], "properties": props}


ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"], "description": "the offending request field"},
                       "code": {"type": ["string", "null"]}},
    }},
}

# OpenAPI 3.1: the `schema` of an event stream describes one event.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a JSON chunk; the last event is [DONE]"}}}


def _completion_response(chat: bool) -> Schema:
    text = ({"message": {"type": "object", "required": ["role", "content"]}} if chat else {"text": {"type": "string"}})
    choice = {"type": "object", "required": ["index", "finish_reason", *text],
              "properties": {"index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]}, **text}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"},
                           "object": {"const": "chat.completion" if chat else "text_completion"},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice}, "usage": usage,
                           "speculation": {"type": "object", "description": "this request's speculation statistics"}}}


def openapi_extra(*, chat: bool, vocab_size: int, context_limit: int, model: str,
                  drafters: tuple[str, ...]) -> dict:
    """The `openapi_extra` of a POST route: its JSON request body, its completion and error responses."""
    common = _common(vocab_size, context_limit, model, drafters)
    body = _chat_body(common) if chat else _completion_body(vocab_size, context_limit, common)
    error = {"content": {"application/json": {"schema": ERROR}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {"description": "the completion, or with stream: true server-sent chunks ending in [DONE]",
                    "content": {"application/json": {"schema": _completion_response(chat)},
                                "text/event-stream": {"schema": SSE_EVENT}}},
            "4XX": {"description": "a refused request; param names the field at fault", **error},
            "5XX": {"description": "a server error", **error},
        },
    }


def route_doc(state: ServerState, *, chat: bool) -> dict:
    """`openapi_extra` for the server `state` serves (its model, vocabulary, context and drafters)."""
    engine = state.engine.engine
    return openapi_extra(chat=chat, vocab_size=engine.target.config.vocab_size, context_limit=engine.limit,
                         model=state.model_name, drafters=state.drafters)
