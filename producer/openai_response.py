"""genpool job results -> OpenAI response shapes: `chat.completion` / `text_completion` bodies
for a finished job, and the streaming chunks (per-token deltas, the streamed echo, the closing
finish_reason and usage chunks). The request side (parsing, errors) is openai_format.py's.
No I/O, no FastAPI.
"""
from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Optional

from genpool.schemas import Choice, JobResult, TokenEvent, Usage
from genpool.schemas.events import PromptScores

from . import openai_echo, openai_logprobs, openai_tools

if TYPE_CHECKING:  # only for annotations: openai_format.py re-exports this module's names
    from .openai_format import OpenAIRequest


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def response_id(kind: str, job_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{job_id}"


def _finish(reason: Optional[str]) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _finish_calls(reason: Optional[str], calls: list) -> str:
    """"tool_calls" for an answer that is calls, unless max_tokens cut it ("length", as OpenAI)."""
    return "tool_calls" if calls and reason != "length" else _finish(reason)


def completion_body(req: OpenAIRequest, res: JobResult, created: Optional[int] = None) -> dict:
    """A `chat.completion` or `text_completion` body for a successful job."""
    choices = res.choices or [_single(res)]
    body = {"id": response_id(req.kind, res.id), "created": created or int(time.time()),
            "model": req.model, "system_fingerprint": None, "usage": usage_body(res.usage)}
    def lps(c: Choice):
        return openai_logprobs.body(req.kind, req.top_logprobs, c.token_ids, c.logprobs,
                                    c.token_texts)
    if req.kind == "chat":
        body["object"] = "chat.completion"
        body["choices"] = []
        for c in choices:
            content, calls = openai_tools.split(req.tools, c.text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            body["choices"].append({"index": c.index, "logprobs": lps(c), "message": message,
                                    "finish_reason": _finish_calls(c.finish_reason, calls)})
    else:
        body["object"] = "text_completion"
        body["choices"] = []
        for c in choices:
            text, lp = c.text, lps(c)
            if req.echo:
                text, lp = openai_echo.choice(req.kwargs.get("prompt"), res, req.top_logprobs,
                                              text, lp)
            body["choices"].append({"index": c.index, "text": text, "logprobs": lp,
                                    "finish_reason": _finish(c.finish_reason)})
            if not req.echo and "prompt_logprobs" in req.kwargs:  # vLLM's extension, asked
                body["choices"][-1]["prompt_logprobs"] = openai_echo.vllm_prompt_logprobs(res.prompt)
    return body


def _single(res: JobResult) -> Choice:
    return Choice(index=0, text=res.text, token_ids=res.token_ids, finish_reason=res.finish_reason,
                  logprobs=res.logprobs, token_texts=res.token_texts)


def chunk_body(req: OpenAIRequest, job_id: str, created: int, index: int, *, text: str = "",
               role: bool = False, finish_reason: Optional[str] = None,
               token: Optional[TokenEvent] = None, offset: int = 0) -> dict:
    """One streaming chunk in OpenAI's shape (`delta` for chat, `text` for completions); `token`,
    a TokenEvent, gives its logprobs (`offset`: where its text starts in the completion)."""
    lps = None if token is None else openai_logprobs.body(
        req.kind, req.top_logprobs, token.token_ids, token.logprobs, token.token_texts, offset)
    if req.kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": response_id(req.kind, job_id), "object": obj, "created": created,
            "model": req.model, "system_fingerprint": None, "choices": [choice]}


def echo_chunks(req: OpenAIRequest, job_id: str, created: int,
                scores: Optional[PromptScores]) -> tuple[list[dict], int]:
    """Streamed echo: every choice opens with the prompt (and its logprobs); the completion's
    text offsets start after it (the int returned)."""
    text = openai_echo.text(req.kwargs.get("prompt"), scores)
    lps = openai_echo.logprobs(scores, req.top_logprobs)
    out = []
    for i in range(req.kwargs.get("n", 1)):
        chunk = chunk_body(req, job_id, created, i, text=text)
        chunk["choices"][0]["logprobs"] = lps
        out.append(chunk)
    return out, len(text)


def final_chunks(req: OpenAIRequest, res: JobResult, created: int) -> list[dict]:
    """The closing chunks: one finish_reason per choice, then usage when it was asked for."""
    out = []
    for c in res.choices or [_single(res)]:
        calls: list[dict] = []
        if req.tools is not None and req.tools.active:  # held back until now: text or calls?
            content, calls = openai_tools.split(req.tools, c.text)
            held = openai_tools.chunks(partial(chunk_body, req, res.id, created, c.index),
                                       content, calls) or [chunk_body(req, res.id, created,
                                                                      c.index)]
            if req.top_logprobs is not None:  # the tokens' logprobs, held back with them
                held[0]["choices"][0]["logprobs"] = openai_logprobs.body(
                    req.kind, req.top_logprobs, c.token_ids, c.logprobs, c.token_texts)
            out += held
        out.append(chunk_body(req, res.id, created, c.index,
                              finish_reason=_finish_calls(c.finish_reason, calls)))
    if req.include_usage:
        out.append({**chunk_body(req, res.id, created, 0), "choices": [],
                    "usage": usage_body(res.usage)})
    return out
