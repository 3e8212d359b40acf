"""producer/openai_tools.py and its use in openai_format: tools in, tool calls out (no Redis)."""
from __future__ import annotations

import json

import pytest

from genpool.producer import openai_tools
from genpool.producer.openai_format import APIError, completion_body, final_chunks, parse_body
from genpool.schemas import JobResult

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
DEEP: dict = {"type": "object"}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def body(**kw):
    return {"model": "m", "messages": ASK, "tools": [WEATHER, TIME], **kw}


def test_a_named_choice_constrains_the_answer_to_that_tools_call():
    req = parse_body("chat", body(tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}}))
    so = req.kwargs["structured_outputs"]["json"]
    assert so["properties"]["name"] == {"const": "get_weather"}
    assert so["properties"]["arguments"] == WEATHER["function"]["parameters"]
    system = req.kwargs["messages"][0]
    assert system["role"] == "system" and "<tools>" in system["content"] and "get_time" in \
        system["content"]
    required = parse_body("chat", body(tool_choice="required")).kwargs["structured_outputs"]
    assert [o["properties"]["name"]["const"] for o in required["json"]["anyOf"]] == [
        "get_weather", "get_time"]


def test_auto_is_unconstrained_and_none_shows_no_tools():
    auto = parse_body("chat", body())
    assert "structured_outputs" not in auto.kwargs and auto.tools.choice == "auto"
    none = parse_body("chat", body(tool_choice="none"))
    assert none.kwargs["messages"] == ASK and not none.tools.active


def test_a_conversation_with_calls_and_results_renders_in_the_hermes_format():
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    req = parse_body("chat", body(messages=msgs))
    out = req.kwargs["messages"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert out[3] == {"role": "tool", "content": "-3 C, snow"}


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools.0.function.name"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER] * 129, None, "tools"),
    ([{"type": "retrieval"}], None, "tools.0"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "required", None),  # llguidance refuses the schema
    # each of these was a 500 (AttributeError, TypeError, RecursionError) under "required"
    ([{"type": "function", "function": {"name": "f", "parameters": {"$defs": None}}}],
     "required", "tools.0.function.parameters.$defs"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"definitions": [1]}}}],
     "auto", "tools.0.function.parameters.definitions"),
    ([{"type": "function", "function": {"name": "f", "parameters": DEEP}}], "required",
     "tools.0.function.parameters"),
])
def test_bad_tools_are_400s_naming_the_tool(tools, choice, param):
    kw = {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
    with pytest.raises(APIError) as e:
        parse_body("chat", {"model": "m", "messages": ASK, **kw})
    assert e.value.status == 400
    if param:
        assert e.value.param == param


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": 5, "tool_calls": [{"function": {"name": "f"}}]}, "messages.1.content"),
    ({"role": "assistant", "content": "x",
      "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]}, "messages.1.tool_calls"),
])
def test_a_bad_assistant_tool_call_message_is_a_400(message, param):
    """Content that is no string beside tool calls, or arguments nested past the JSON parser's
    limit (a short, flat body: the depth is inside a string), are the request's 400, not a 500."""
    with pytest.raises(APIError) as e:
        parse_body("chat", {"model": "m", "messages": [*ASK, message]})
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required", "response_format": "json"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": ["json_object"]}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_odd_fields_beside_tools_are_400s(extra, param):
    """A response_format that is no object beside a forced call was an AttributeError (500)."""
    with pytest.raises(APIError) as e:
        parse_body("chat", body(**extra))
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_text_response_format_beside_a_forced_call_is_no_conflict():
    req = parse_body("chat", body(tool_choice="required", response_format={"type": "text"}))
    assert "anyOf" in req.kwargs["structured_outputs"]["json"]


def test_only_declared_tools_are_called_and_parallel_false_keeps_the_first():
    """A call of a tool the request did not declare is not a call (its text stays content);
    arguments the model wrote as a JSON string are not encoded again; parallel_tool_calls
    false keeps the first call; a block that is no call stays in the content."""
    text = ('A <tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
            '</tool_call> B <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> C '
            '<tool_call>broken</tool_call><tool_call>{"name": "get_time", "arguments": '
            '{"zone": "UTC"}}</tool_call>')
    tools = parse_body("chat", body()).tools
    content, calls = openai_tools.split(tools, text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert content == ('A  B <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> C '
                       '<tool_call>broken</tool_call>')
    one = parse_body("chat", body(parallel_tool_calls=False)).tools
    assert [c["function"]["name"] for c in openai_tools.split(one, text)[1]] == ["get_weather"]


def test_answers_become_tool_calls():
    content, calls = openai_tools.hermes('Let me check. <tool_call>\n{"name": "get_weather", '
                                         '"arguments": {"city": "Oslo"}}\n</tool_call>')
    assert content == "Let me check." and calls[0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert openai_tools.hermes("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])
    req = parse_body("chat", body(tool_choice="required"))
    res = JobResult(id="j", text='{"name": "get_time", "arguments": {"zone": "UTC"}}',
                    finish_reason="stop")
    choice = completion_body(req, res)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "zone": "UTC"}
    chunks = final_chunks(req, res, 0)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"] == {"arguments": '{"zone": "UTC"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_schemas_with_defs_and_recursion_keep_their_refs_under_the_call():
    """Pydantic (and LangChain) schemas carry `$defs` and root-relative `$ref`s; nested under
    `arguments` they must be hoisted and rewritten, or the constraint refers to nothing."""
    import jsonschema
    import pydantic

    class Item(pydantic.BaseModel):
        name: str

    class Order(pydantic.BaseModel):
        items: list[Item]

    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    tools = [{"type": "function", "function": {"name": "order",
                                                "parameters": Order.model_json_schema()}},
             {"type": "function", "function": {"name": "tree", "parameters": tree}}]
    req = parse_body("chat", {"model": "m", "messages": ASK, "tools": tools,
                              "tool_choice": "required"})
    schema = req.kwargs["structured_outputs"]["json"]
    assert set(schema["$defs"]) == {"order__Item", "tree__root"}
    good = [{"name": "order", "arguments": {"items": [{"name": "tea"}]}},
            {"name": "tree", "arguments": {"kids": [{"kids": []}]}}]
    for call in good:
        jsonschema.validate(call, schema)
    for bad in ({"name": "order", "arguments": {"items": [{"nom": 1}]}},
                {"name": "tree", "arguments": {"kids": [{"kids": [1]}]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_prepare_and_attach_give_the_python_clients_the_gateways_tools():
    """Client.submit's path: the tool fields become a plain chat job (what the gateway sends),
    and the result gets OpenAI tool calls per choice, completion 0's at the top level."""
    from genpool.schemas import ChatMessage, Choice

    msgs = [ChatMessage(role="user", content="Weather in Oslo?"),
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "-3 C"}]
    kw = {"messages": msgs, "tools": [WEATHER, TIME], "tool_choice": "required",
          "parallel_tool_calls": False, "max_tokens": 9}
    tools = openai_tools.prepare(kw)
    gw = parse_body("chat", {"model": "m", "messages": [{"role": "user", "content":
                             "Weather in Oslo?"}] + msgs[1:], "tools": [WEATHER, TIME],
                             "tool_choice": "required"})
    assert kw["messages"] == gw.kwargs["messages"] and set(kw) == {"messages", "max_tokens",
                                                                   "structured_outputs"}
    assert kw["structured_outputs"] == gw.kwargs["structured_outputs"]
    assert kw["messages"][3] == {"role": "tool", "content": "-3 C"}
    a = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    b = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    res = openai_tools.attach(tools, JobResult(id="j", text=a, finish_reason="stop", choices=[
        Choice(index=0, text=a), Choice(index=1, text=b)]))
    assert [c.tool_calls[0].function.name for c in res.choices] == ["get_weather", "get_time"]
    assert res.tool_calls == res.choices[0].tool_calls and res.content is None
    assert json.loads(res.model_dump(mode="json")["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Oslo"}
    auto = openai_tools.prepare({"messages": ASK, "tools": [WEATHER]})
    text = "Sure. <tool_call>\n" + a + "\n</tool_call>"
    got = openai_tools.attach(auto, JobResult(id="j", text=text, finish_reason="stop"))
    assert got.content == "Sure." and got.tool_calls[0].function.name == "get_weather"
    plain = JobResult(id="j", text=a, finish_reason="stop")
    assert openai_tools.attach(None, plain) is plain


def test_a_constrained_call_cut_by_max_tokens_keeps_its_name_and_partial_arguments():
    """As OpenAI answers a call cut by max_tokens: tool_calls with the arguments so far, and
    finish_reason "length" (not "tool_calls")."""
    from genpool.producer import openai_tools
    from genpool.producer.openai_response import _finish_calls

    tools = openai_tools.parse({"tools": [WEATHER], "tool_choice": "required"})
    content, calls = openai_tools.split(tools, '{"name":"get_weather","arguments":{"city":"Os')
    assert content is None and calls[0]["function"] == {"name": "get_weather",
                                                         "arguments": '{"city":"Os'}
    assert openai_tools.split(tools, '{"na') == ('{"na', [])  # cut before the arguments
    assert _finish_calls("length", calls) == "length" and _finish_calls("stop", calls) == "tool_calls"


def nested(depth: int) -> dict:
    out: dict = {}
    for _ in range(depth):
        out = {"a": out}
    return out


def test_tools_nested_past_the_recursion_limit_are_a_400():
    """json.dumps of the tools (their size check) raised RecursionError: a 500 and a logged
    traceback for each such request."""
    import sys

    deep = {"type": "function", "function": {"name": "f", "description": "x",
                                             "parameters": nested(2 * sys.getrecursionlimit())}}
    with pytest.raises(openai_tools.ToolError) as e:
        openai_tools.parse({"tools": [deep]})
    assert e.value.param == "tools" and "nested" in str(e.value)


def test_a_constrained_call_nested_past_the_recursion_limit_is_its_text_cut_short():
    """A forced call whose arguments the model nested deeper than json.loads goes (an
    unconstrained property, max_tokens reached): the call cut short, not a 500 / broken stream."""
    import sys

    tools = openai_tools.parse({"tools": [WEATHER], "tool_choice": "required"})
    text = '{"name":"get_weather","arguments":{"city":' + "[" * (2 * sys.getrecursionlimit())
    content, calls = openai_tools.split(tools, text)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"].startswith('{"city":[[[')
