"""Tool calls out of a finished answer (producer/openai_tools.py has the request side): the
Hermes parser for `"auto"`, the constrained call's JSON for `"required"` or a named tool, and
OpenAI's chunking of an answer held back for its calls. No I/O."""
from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from .openai_tools import Tools

CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call(obj: Any, names: Optional[list[str]] = None) -> Optional[dict]:
    """A call in OpenAI's shape, or None when `obj` is not one (of the tools in `names`).
    Arguments the model wrote as a string are passed on as written, not JSON-encoded again."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args)}}


_CUT_RE = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\Z', re.S)


def _cut_call(text: str) -> Optional[dict]:
    """A constrained call that max_tokens cut: its name and the arguments' text so far (not
    valid JSON; finish_reason says "length"), or None when it was cut before its arguments."""
    m = _CUT_RE.match(text)
    if m is None:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": json.loads(f'"{m.group(1)}"'), "arguments": m.group(2)}}


def hermes(text: str, names: Optional[list[str]] = None) -> tuple[Optional[str], list[dict]]:
    """(content, calls): every `<tool_call>{json}</tool_call>` that parses as a call of one of
    the tools in `names` (None: any), and the text left (a block that is no such call stays)."""
    calls, rest, at = [], [], 0
    for m in CALL_RE.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), names)
        except (ValueError, RecursionError):
            call = None
        if call is not None:
            calls.append(call)
            rest.append(text[at:m.start()])
            at = m.end()
    if not calls:
        return text, []
    rest.append(text[at:])
    return "".join(rest).strip() or None, calls


PARSERS: dict[str, Callable[[str, Optional[list[str]]], tuple[Optional[str], list[dict]]]] = {
    "hermes": hermes}


def split(tools: Optional[Tools], text: str) -> tuple[Optional[str], list[dict]]:
    """An answer's (content, tool calls) under the request's tools."""
    if tools is None or not tools.active:
        return text, []
    if tools.constrained:  # the constraint made it exactly one call's JSON
        try:
            call = _call(json.loads(text))
        except (ValueError, RecursionError):  # cut short (max_tokens), or nested past
            # json.loads's depth: OpenAI's answer to a cut call, the arguments so far
            call = _cut_call(text)
        return (None, [call]) if call else (text, [])
    content, calls = PARSERS[tools.parser](text, [t["name"] for t in tools.tools])
    return content, calls if tools.parallel else calls[:1]


def chunks(chunk: Callable[..., dict], content: Optional[str], calls: list[dict]) -> list[dict]:
    """OpenAI's chunking of an answer held back for its tool calls: the content, then per call
    its index, id, type and name (arguments ""), then its arguments. `chunk(text=...)` makes one
    chunk of the choice."""
    out = [chunk(text=content)] if content else []
    for j, call in enumerate(calls):
        for delta in ({"index": j, "id": call["id"], "type": "function",
                       "function": {"name": call["function"]["name"], "arguments": ""}},
                      {"index": j, "function": {"arguments": call["function"]["arguments"]}}):
            c = chunk()
            c["choices"][0]["delta"] = {"tool_calls": [delta]}
            out.append(c)
    return out
