"""OpenAI API shapes <-> genpool jobs, shared by the HTTP gateway and the batch runner.

Request bodies become `Client.submit` keyword arguments (validated here, so a bad request fails at
the edge with an OpenAI-shaped 400 instead of reaching a worker); job results become
`chat.completion` / `text_completion` bodies and streaming chunks (openai_response.py, re-exported
here). No I/O, no FastAPI.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import annotated_types
from pydantic import ValidationError

from genpool.schemas import ErrorEvent
from genpool.schemas.request import MAX_LOGPROBS, JobRequest

from . import openai_echo, openai_tools

# The response side is openai_response.py's; these names stay importable from here, where
# callers have always taken them.
from .openai_response import chunk_body, completion_body, echo_chunks, final_chunks  # noqa: F401
from .protocol import build_request

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def one_of(value: Any, names: dict) -> bool:
    """Whether a request's `value` is one of `names`' keys (a JSON list or object is none: a
    dict lookup of one raised TypeError, a 500)."""
    return isinstance(value, str) and value in names
# OpenAI's completions default is 16 tokens; chat has no fixed default, and 16 cuts most answers.
DEFAULT_MAX_TOKENS = {"chat": 256, "completion": 16}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
          "frequency_penalty", "logit_bias", "stream", "stream_options",
          # vLLM-style extensions (the engine supports them; OpenAI clients send them via extra_body)
          "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
          "priority", "speculative",
          # structured output: OpenAI's response_format, vLLM's structured_outputs (extra_body)
          "response_format", "structured_outputs"}
ONLY = {"chat": {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                 "tool_choice", "parallel_tool_calls"},
        "completion": {"prompt", "logprobs", "echo", "prompt_logprobs"}}
IGNORED = {"user", "store", "metadata", "service_tier"}
# Features accepted only at their "off" value: a caller relying on them must hear "no", not get
# a silently different answer.
OFF_VALUES: dict[str, tuple] = {
    "suffix": (None,),
    "best_of": (None, 1), "functions": (None, []), "function_call": (None, "none"),
    "modalities": (None, ["text"]),
}
# Worker error codes -> (HTTP status, OpenAI error type, OpenAI error code).
ERROR_STATUS = {
    "invalid_request": (400, "invalid_request_error", "invalid_request"),
    "unknown_model": (404, "invalid_request_error", "model_not_found"),
    "expired": (408, "invalid_request_error", "expired"),
    "cancelled": (409, "invalid_request_error", "cancelled"),
    "dead_lettered": (500, "server_error", "dead_lettered"),
    "internal": (500, "server_error", "internal"),
}


# An absolute filesystem path (POSIX or Windows) inside a message: never shown to HTTP callers.
# This API's own endpoints (a batch line's error names them) match first and stay as they are,
# where the text or a delimiter follows them (else they begin a path: /v1/models-7b/config.json).
API_PATHS = (*ENDPOINTS, "/v1/embeddings", "/v1/batches", "/v1/files", "/v1/models")
_PATH_RE = re.compile(r"(" + "|".join(map(re.escape, API_PATHS)) + r")(?=$|[\s'\",;:)]|\.(?!\w))"
                      r"|(?:[A-Za-z]:\\|~?/)(?:[^\s'\"/\\]+[/\\])+[^\s'\",;:)]*")


def scrub_paths(text: str) -> str:
    return _PATH_RE.sub(lambda m: m.group(1) or "<path>", text)


class APIError(Exception):
    """An error with an HTTP status and OpenAI's body shape (paths scrubbed from its message)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type_,
                                                                       param, code)
        self.headers = headers  # HTTP response headers (the gateway's; the batch runner has none)

    def body(self) -> dict:
        return {"error": {"message": scrub_paths(self.message), "type": self.type,
                          "param": self.param, "code": self.code}}


def error_from_event(ev: ErrorEvent) -> APIError:
    status, type_, code = ERROR_STATUS.get(ev.code, (500, "server_error", ev.code))
    return APIError(status, ev.message, type_, None, code)


@dataclass
class OpenAIRequest:
    kind: str  # "chat" | "completion"
    kwargs: dict  # Client.submit keyword arguments
    model: str  # echoed back in responses
    stream: bool = False
    include_usage: bool = False
    top_logprobs: Optional[int] = None  # logprobs asked: alternatives per token (None: not asked)
    tools: Optional[openai_tools.Tools] = None  # chat tool calling (producer/openai_tools.py)
    echo: bool = False  # completions: the prompt comes back before the completion (openai_echo.py)


def parse_body(kind: str, body: Any, *, priority: int = 0, default_model: Optional[str] = None,
               job_id: Optional[str] = None) -> OpenAIRequest:
    """Validate an OpenAI request body; raises APIError(400) naming the offending parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_keys(kind, body)
    _check_sizes(body)
    kw: dict[str, Any] = {k: body[k] for k in COMMON - {"stream", "stream_options"}
                          if body.get(k) is not None}
    tools = _tools(kind, body, kw)
    if kind == "chat":
        kw["messages"] = _messages(body.get("messages"), tools)
        if body.get("max_completion_tokens") is not None:
            kw["max_tokens"] = body["max_completion_tokens"]
    else:
        kw.update(_echo(openai_echo.prompt_fields, body.get("prompt")))
    top = _logprobs(kind, body)
    if top is not None:
        kw["logprobs"] = top
    kw.setdefault("max_tokens", DEFAULT_MAX_TOKENS[kind])
    echo = kind == "completion" and _echo(openai_echo.apply, body, kw, top)
    if kw["max_tokens"] == 0 and "prompt_logprobs" not in kw:  # chat: nothing to score either
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens",
                       code="invalid_value")
    kw.setdefault("priority", priority)
    if default_model and "model" not in kw:
        kw["model"] = default_model
    kw["job_id"] = job_id or uuid.uuid4().hex
    _validate(kw)
    stream, opts = body.get("stream", False), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", param="stream")
    if opts is not None and not (isinstance(opts, dict) and isinstance(
            opts.get("include_usage"), (bool, type(None)))):
        raise APIError(400, "stream_options must be an object like {\"include_usage\": true}",
                       param="stream_options")
    if opts is not None and not stream:  # as OpenAI and vLLM: it would be silently ignored
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    return OpenAIRequest(kind, kw, str(kw.get("model") or "genpool"), bool(stream),
                         bool((opts or {}).get("include_usage")), top, tools, echo)


def _echo(fn, *args):
    try:
        return fn(*args)
    except openai_echo.EchoError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _tools(kind: str, body: dict, kw: dict) -> Optional[openai_tools.Tools]:
    """The request's tools; a required or named choice constrains the answer to one call."""
    if kind != "chat":
        return None
    try:
        tools = openai_tools.parse(body)
        if tools is not None:
            openai_tools.constrain(tools, kw)
    except openai_tools.ToolError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    return tools


def _logprobs(kind: str, body: dict) -> Optional[int]:
    """How many alternatives per token the request asks logprobs for (None: no logprobs).
    Chat: `logprobs: true` and `top_logprobs` 0-20; completions: `logprobs` 0-20."""
    def count(name: str, v: Any) -> int:
        # OpenAI's bound for chat (completions: 5); genpool takes the job's for both
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS:
            raise APIError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got "
                                f"{v!r}", param=name, code="invalid_value")
        return v
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        return None if lp is None else count("logprobs", lp)
    if lp is not None and not isinstance(lp, bool):
        raise APIError(400, f"logprobs must be a boolean, got {lp!r}", param="logprobs",
                       code="invalid_value")
    if top is not None and not lp:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                       code="invalid_value")
    return count("top_logprobs", top or 0) if lp else None


def _check_keys(kind: str, body: dict) -> None:
    allowed = COMMON | ONLY[kind] | IGNORED
    for key, value in body.items():
        if key in OFF_VALUES:
            if value not in OFF_VALUES[key]:
                raise APIError(400, f"{key} is not supported by genpool", param=key,
                               code="unsupported_parameter")
        elif key not in allowed:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key,
                           code="unknown_parameter")


def _most_items(field: str) -> int:
    return next(m.max_length for m in JobRequest.model_fields[field].metadata
                if isinstance(m, annotated_types.MaxLen))


# body field -> the wire field that bounds its length: checked before any item is, since both
# the conversion here and pydantic look at every item first (200,000 messages: 0.5 s of the
# gateway's event loop for a 400)
SIZED = {k: _most_items(f) for k, f in (("messages", "messages"), ("prompt", "prompt_token_ids"),
                                        ("stop", "stop"), ("stop_token_ids", "stop_token_ids"),
                                        ("logit_bias", "logit_bias"))}


def _check_sizes(body: dict) -> None:
    for key, most in SIZED.items():
        value = body.get(key)
        if isinstance(value, (list, dict)) and len(value) > most:
            raise APIError(400, f"{key} has {len(value)} items; at most {most} are taken",
                           param=key, code="invalid_value")


def _messages(raw: Any, tools: Optional[openai_tools.Tools] = None) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages.{i}")
        role = "system" if m.get("role") == "developer" else m.get("role")
        out.append({"role": role, "content": _content(m.get("content"), i)})
        if role == "assistant" and m.get("tool_calls"):
            out[-1]["tool_calls"] = m["tool_calls"]
    try:  # calls as the model writes them (Hermes), the tools in the system message
        return openai_tools.render_messages(out, tools)
    except openai_tools.ToolError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None


def _content(content: Any, i: int) -> Any:
    """Text content parts are joined; anything but text is refused rather than dropped."""
    if not isinstance(content, list):
        return content  # strings pass; other types get the schema's message
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise APIError(400, "only text content parts are supported",
                           param=f"messages.{i}.content")
        texts.append(part["text"])
    return "".join(texts)


def _validate(kw: dict) -> None:
    try:
        build_request(**kw)
    except ValueError as e:
        cause = e.__cause__
        param = None
        if isinstance(cause, ValidationError) and cause.errors():
            param = ".".join(str(p) for p in cause.errors()[0]["loc"]) or None
        message = str(e).removeprefix("invalid job request: ")
        raise APIError(400, message, param=param, code="invalid_value") from None
