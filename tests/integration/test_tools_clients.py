"""OpenAI tool calling outside the gateway: `Client.submit`, `AsyncClient.submit`, the Celery task
`genpool.generate` and batch lines, against real Redis and one real SmolLM2-135M worker.

The tools never travel on the wire (producer/openai_tools.py turns them into a plain chat job);
the caller gets the calls back parsed, in OpenAI's shape, on the result. A required or named
choice is constrained, so its arguments must validate against the tool's schema.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import jsonschema
import pytest

from genpool.producer import Client
from genpool.producer.aio import AsyncClient
from genpool.producer.batch import run_batch
from tests.pool_helpers import ROOT, drop_prefix, new_prefix, stop_proc, wait_for, worker_thread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Oslo right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def smol(redis_url, smollm2_path):
    from genpool.engine import LLM

    prefix = new_prefix("tools")
    eng = LLM(str(smollm2_path), num_threads=1, max_num_seqs=8, num_kv_blocks=512).llm_engine
    c = Client(redis_url, prefix)
    try:
        with worker_thread(eng, redis_url, prefix, served_models=frozenset({"smollm2-135m"})):
            yield redis_url, prefix, c
    finally:
        c.close()
        drop_prefix(redis_url, prefix)


def valid_call(call) -> dict:
    """A ToolCall (or its JSON dict) in OpenAI's shape whose arguments fit its tool's schema."""
    call = call if isinstance(call, dict) else call.model_dump()
    assert call["type"] == "function" and call["id"].startswith("call_")
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
    return {"name": call["function"]["name"], **args}


def test_submit_with_a_named_or_required_tool_gets_a_valid_call(smol):
    _, _, c = smol
    named = c.submit(messages=ASK, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=60,
                     temperature=0)
    required = c.submit(messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", n=2,
                        max_tokens=60, temperature=0.8, seed=7, parallel_tool_calls=False)
    res = named.result(timeout=240)
    assert res.content is None and len(res.tool_calls) == 1
    assert valid_call(res.tool_calls[0])["name"] == "get_weather"
    assert res.text.startswith("{")  # the raw answer stays: the call's JSON
    res2 = required.result(timeout=240)
    assert len(res2.choices) == 2
    for ch in res2.choices:
        (call,) = ch.tool_calls
        assert ch.content is None and valid_call(call)["name"] in SCHEMAS
    assert res2.tool_calls == res2.choices[0].tool_calls
    # streamed, then the result: the same parse (the stream's end fills in the result)
    again = c.submit(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60,
                     temperature=0)
    text = "".join(ev.text for ev in again.stream(timeout=240))
    after = again.result()
    assert after.text == text and valid_call(after.tool_calls[0])["name"] == "get_weather"


def test_map_applies_common_tools_to_every_item(smol):
    _, _, c = smol
    asks = [[{"role": "user", "content": f"Weather in {city}?"}] for city in ("Lima", "Oslo")]
    got = c.map([{"messages": m} for m in asks], tools=[WEATHER, CLOCK], tool_choice="required",
                max_tokens=60, temperature=0, timeout=240)
    assert [r.content for r in got] == [None, None]
    assert all(valid_call(r.tool_calls[0])["name"] in SCHEMAS for r in got)


def test_async_submit_and_a_tool_result_conversation(smol):
    url, prefix, _ = smol
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"}]

    async def go():
        async with AsyncClient(url, prefix) as ac:
            forced = await ac.submit(messages=ASK, tools=[WEATHER, CLOCK], tool_choice=NAMED,
                                     max_tokens=60, temperature=0)
            auto = await ac.submit(messages=convo, tools=[WEATHER], max_tokens=24, temperature=0)
            plain = await ac.submit(messages=ASK, max_tokens=4, temperature=0)
            return [await j.result(timeout=240) for j in (forced, auto, plain)]
    forced, auto, plain = asyncio.run(go())
    assert valid_call(forced.tool_calls[0])["name"] == "get_weather"
    # auto: text unless the model wrote a well-formed Hermes call
    assert (auto.tool_calls is None and auto.content == auto.text) or \
        "<tool_call>" in auto.text
    assert plain.tool_calls is None and plain.content is None  # no tools: nothing parsed


def test_bad_tools_fail_at_the_caller_naming_the_field(smol):
    _, _, c = smol
    before = len(c.redis.keys(f"{c.keys.prefix}:job:*"))
    cases = [
        (dict(messages=ASK, tools=[WEATHER, WEATHER]), "used twice"),
        (dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "function",
                                                          "function": {"name": "nope"}}),
         "not among the tools"),
        (dict(prompt="Weather?", tools=[WEATHER]), "give messages"),
        (dict(messages=ASK, tools=[WEATHER], tool_choice="required",
              json_schema={"type": "object"}), "cannot be combined"),
        (dict(messages=ASK, tool_choice="required"), "needs tools"),
    ]
    for kw, words in cases:
        with pytest.raises(ValueError, match=words):
            c.submit(max_tokens=4, **kw)
    with pytest.raises(ValueError, match="needs tools"):
        c.submit_many([dict(messages=ASK, max_tokens=4),
                       dict(messages=ASK, tool_choice="required")])
    assert len(c.redis.keys(f"{c.keys.prefix}:job:*")) == before  # nothing was submitted


def test_batch_lines_carry_tools(smol, tmp_path):
    url, prefix, c = smol
    body = {"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required",
            "max_tokens": 60, "temperature": 0}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"custom_id": "t1", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n")
    counts = run_batch(inp, out, client=c, progress=False)
    assert (counts.ok, counts.errors) == (1, 0), counts
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    ch = line["response"]["body"]["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    assert valid_call(ch["message"]["tool_calls"][0])["name"] in SCHEMAS


def test_the_celery_task_returns_tool_calls(smol, tmp_path):
    pytest.importorskip("celery", reason="the worker extra (celery) is not installed")
    from genpool.workers.integrations.celery_app import make_app

    url, prefix, c = smol
    env = dict(os.environ, GENPOOL_REDIS_URL=url, GENPOOL_PREFIX=prefix,
               GENPOOL_CELERY_QUEUE=prefix, OMP_WAIT_POLICY="PASSIVE")
    log = tmp_path / "celery.log"
    cmd = [sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app",
           "worker", "-P", "threads", "-c", "2", "-Q", prefix, "-n", f"tools-{prefix[-8:]}@%h",
           "--without-mingle", "--without-gossip", "-l", "info"]
    app = make_app(url, prefix)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"))
    try:
        task = app.send_task("genpool.generate", kwargs=dict(
            messages=ASK, tools=[WEATHER, CLOCK], tool_choice=NAMED, max_tokens=60,
            temperature=0))
        wait_for(lambda: task.ready() or proc.poll() is not None, 240,
                 what=lambda: f"the task (log: {log.read_text()[-3000:]})")
        out = task.get(timeout=5)
        assert out["error"] is None and out["content"] is None, out
        assert valid_call(out["tool_calls"][0])["name"] == "get_weather"
        bad = app.send_task("genpool.generate", kwargs=dict(messages=ASK, tools=[WEATHER, WEATHER]))
        wait_for(lambda: bad.ready(), 60, what="the bad task")
        assert bad.state == "FAILURE" and "used twice" in str(bad.result)
    finally:
        stop_proc(proc, 20)
        c.redis.delete(prefix)  # this run's Celery queue (never FLUSHDB: shared DB)
