"""OpenAI tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `tool_calls` out.

The model sees the tools in the Hermes format (a system message listing them as JSON, calls
written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), the format most small
open models were tuned on; conversations that carry assistant `tool_calls` and `role: "tool"`
results are rendered in the same format, then through the model's chat template.
- `tool_choice: "required"` or a named function: the answer is constrained (llguidance, the
  structured-output path) to one call whose arguments validate against that tool's schema.
- `"auto"`: unconstrained; a parser (openai_tool_calls.PARSERS, by name; "hermes" today) takes
  the calls out of the text, and what is left is the message's content.
- `"none"`: the tools are not shown and nothing is parsed.
Bad tools (no name, a duplicate, an invalid schema, too many or too big, an unknown named
choice) are 400s naming the tool. One call per answer when constrained; under `"auto"`,
`parallel_tool_calls: false` keeps the first call. A call naming a tool the request did not declare
is not a call: its text stays in the content.
The Python clients and the Celery task take the same fields (`prepare` before the job is built,
`attach` on its result): the job on the wire is a plain chat job, so workers know nothing of tools.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from genpool.schemas import JobResult
from genpool.schemas.events import ToolCall
from genpool.schemas.request import ChatMessage

from .openai_tool_calls import PARSERS, chunks, hermes, split  # noqa: F401 (this module's API)

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # what `prepare` takes out of submit kwargs
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 << 10  # their JSON, all together
MAX_SCHEMA_DEPTH = 64  # a tool's parameters; deeper is no real schema, and recursion would break
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    tools: list[dict]  # [{"name", "description", "parameters"}]
    choice: str  # "none" | "auto" | "required" | a tool's name
    parser: str = "hermes"
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice not in ("none", "auto")


def parse(body: dict) -> Optional[Tools]:
    """The request's tools and choice (None: no tools), validated; ToolError naming the field."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {parallel!r}",
                        "parallel_tool_calls")
    if raw in (None, []):
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    try:
        size = len(json.dumps(raw))
    except RecursionError:  # (json.loads let it through a few stack frames higher up)
        raise ToolError("tools are nested too deeply", "tools") from None
    if size > MAX_TOOLS_BYTES:
        raise ToolError(f"tools are over {MAX_TOOLS_BYTES} bytes of JSON", "tools")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    names = [t["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ToolError(f"tool name {dup!r} is used twice", "tools")
    return Tools(tools, _choice(choice, names), parallel=parallel is not False)


def _tool(t: Any, i: int) -> dict:
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                        f"tools.{i}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got "
                        f"{name!r}", f"tools.{i}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    where = f"tools.{i}.function.parameters"
    if not isinstance(params, dict):
        raise ToolError(f"tool {name!r}: parameters must be a JSON schema object", where)
    for k in ("$defs", "definitions"):
        if not isinstance(params.get(k, {}), dict):
            raise ToolError(f"tool {name!r}: parameters' {k} must be an object", f"{where}.{k}")
    if _depth(params) > MAX_SCHEMA_DEPTH:
        raise ToolError(f"tool {name!r}: parameters are nested deeper than {MAX_SCHEMA_DEPTH}",
                        where)
    return {"name": name, "description": str(fn.get("description") or ""), "parameters": params}


def _depth(x: Any) -> int:
    """How deep a JSON value nests, counted without recursion (the schema is a caller's)."""
    deepest, todo = 0, [(x, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_SCHEMA_DEPTH:
                todo.extend((w, d + 1) for w in (v.values() if isinstance(v, dict) else v))
    return deepest


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools",
                        "tool_choice")
    return name


# -- into the prompt ---------------------------------------------------------------------------
def system_text(tools: Tools) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools.tools)
    return ("You are a function calling AI model. You may call one or more functions to assist "
            "with the user query. Here are the available tools: <tools>\n" + listed +
            "\n</tools>\nFor each function call return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
            "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def render_call(call: Any, i: int, where: str = "messages") -> str:
    """An assistant message's tool call as the model writes it (Hermes)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(f"tool_calls[{i}] must carry function.name", where)
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise ToolError(f"tool_calls[{i}].function.arguments is not JSON", where) from None
    except RecursionError:  # deep JSON inside a short string: no ValueError, and no 500 either
        raise ToolError(f"tool_calls[{i}].function.arguments is nested too deeply", where) from None
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>"


def render_messages(messages: list, tools: Optional[Tools]) -> list:
    """Chat messages as the model reads them: an assistant message's `tool_calls` written into
    its content (Hermes), a tool result's `tool_call_id` / `name` dropped (the template has no
    place for them), and the tools listed in the system message when they are shown."""
    out = [m.model_dump() if isinstance(m, ChatMessage) else m for m in messages]
    for i, m in enumerate(out):
        calls = m.get("tool_calls") if isinstance(m, dict) else None  # else: the job's check
        if calls and m.get("role") == "assistant":
            where = f"messages.{i}.tool_calls"
            if not isinstance(calls, list):
                raise ToolError(f"messages[{i}]: tool_calls must be a list", where)
            if not isinstance(m.get("content"), (str, type(None))):
                raise ToolError(f"messages[{i}]: content beside tool_calls must be a string or null",
                                f"messages.{i}.content")
            written = [render_call(c, j, where) for j, c in enumerate(calls)]
            out[i] = {"role": "assistant",
                      "content": "\n".join(filter(None, [m.get("content"), *written]))}
        elif isinstance(m, dict) and {"tool_calls", "tool_call_id", "name"} & set(m):
            out[i] = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
    if tools is not None and tools.active and out:  # the tools go into the system message
        text, first = system_text(tools), out[0]
        if isinstance(first, dict) and first.get("role") == "system" \
                and isinstance(first.get("content"), str):
            out[0] = {"role": "system", "content": f"{first['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def constraint(tools: Tools) -> Optional[dict]:
    """For required / a named tool: structured_outputs for exactly one call."""
    if not tools.constrained:
        return None
    chosen = [t for t in tools.tools if tools.choice in ("required", t["name"])]
    defs: dict = {}
    one = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                              "arguments": _hoisted(t, defs)},
            "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = one[0] if len(one) == 1 else {"anyOf": one}
    return {"json": {**schema, "$defs": defs} if defs else schema}


def _hoisted(tool: dict, defs: dict) -> dict:
    """The tool's parameters with their `$defs` / `definitions` moved into `defs` (prefixed by
    the tool's name) and every local `$ref` rewritten to match: nested under `arguments`, the
    schema's own root-relative refs ("#/$defs/Item", "#") would point nowhere. Pydantic and
    LangChain write such schemas."""
    params = dict(tool["parameters"])
    own = {**params.pop("$defs", {}), **params.pop("definitions", {})}
    pre = f"{tool['name']}__"

    def fix(x: Any) -> Any:
        if isinstance(x, list):
            return [fix(v) for v in x]
        if not isinstance(x, dict):
            return x
        out = {k: fix(v) for k, v in x.items() if k != "$ref"}
        ref = x.get("$ref")
        if isinstance(ref, str):
            for base in ("#/$defs/", "#/definitions/"):
                if ref.startswith(base):
                    ref = f"#/$defs/{pre}{ref[len(base):]}"
            out["$ref"] = f"#/$defs/{pre}root" if ref == "#" else ref
        elif ref is not None:
            out["$ref"] = ref
        return out
    for k, v in own.items():
        defs[pre + k] = fix(v)
    fixed = fix(params)
    if '"#"' in json.dumps(params):  # the root refers to itself: give it a name
        defs[pre + "root"] = fixed
    return fixed


def constrain(tools: Tools, kw: dict) -> None:
    """A required or named choice constrains the job (its submit kwargs) to one call."""
    so = constraint(tools)
    if not so:
        return
    fmt = kw.get("response_format")
    if kw.get("structured_outputs") or kw.get("json_schema") is not None or (
            fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text")):
        raise ToolError("tool_choice required or a named tool constrains the answer; it cannot "
                        "be combined with response_format, structured_outputs or json_schema",
                        "tool_choice")
    kw.pop("response_format", None)  # {"type": "text"}: asks for nothing the call breaks
    kw["structured_outputs"] = so


# -- the Python clients and the Celery task ----------------------------------------------------
def prepare(kw: dict) -> Optional[Tools]:
    """Client.submit kwargs with OpenAI's tool fields (FIELDS) taken out and applied as the
    gateway applies them: the tools shown in the system message, a required or named choice
    constraining the answer, assistant tool calls and tool results rendered. The job stays a
    plain chat job. ToolError (a ValueError) names a bad field."""
    tools = parse({k: kw.pop(k) for k in FIELDS if k in kw})
    messages = kw.get("messages")
    if tools is not None and tools.active and not messages:
        raise ToolError("tools need a chat job: give messages, not a prompt", "messages")
    if tools is not None:
        constrain(tools, kw)
    if messages:
        kw["messages"] = render_messages(messages, tools)
    return tools


def attach(tools: Optional[Tools], res: JobResult) -> JobResult:
    """A finished job's result with each answer split (`split`) into `content` and `tool_calls`
    in OpenAI's shape; unchanged without active tools or when the job failed."""
    if tools is None or not tools.active or (res.error is not None and not res.finish_reason):
        return res

    def parts(text: str) -> dict:
        content, calls = split(tools, text)
        return {"content": content,
                "tool_calls": [ToolCall.model_validate(c) for c in calls] or None}
    if not res.choices:
        return res.model_copy(update=parts(res.text))
    choices = [c.model_copy(update=parts(c.text)) for c in res.choices]
    first = choices[0]  # the top level is completion 0: the same calls, ids included
    return res.model_copy(update={"choices": choices, "content": first.content,
                                  "tool_calls": first.tool_calls})
