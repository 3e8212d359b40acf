"""The OpenAI-compatible gateway against a real worker process, through the official client.

One tiny-Llama worker and one `genpool gateway` process (with an API key) serve the module; the
429 test runs a second gateway in a thread on a prefix no worker serves, so its queue only grows.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import redis

from genpool.producer import Client
from genpool.schemas.connection import connect
from tests.conftest import TOPOLOGIES
from tests.pool_helpers import (
    ROOT,
    drop_prefix,
    free_port,
    http_ok,
    new_prefix,
    spawn_worker,
    stop_proc,
    wait_for,
    workers_alive,
)

KEY = "sk-genpool-test"
CHAT = [{"role": "user", "content": "Name three colors."}]


def answers(base: str) -> bool:
    return http_ok(f"{base}/health")


@pytest.fixture(scope="module", params=TOPOLOGIES)
def pool(request, tiny_llama_long_path, tmp_path_factory):
    """Worker + gateway processes on one server, then on a local Redis Cluster."""
    redis_url = request.getfixturevalue("redis_url" if request.param == "single"
                                        else "cluster_url")
    prefix, port = new_prefix("gw"), free_port()
    logs = tmp_path_factory.mktemp("gateway")
    worker = spawn_worker(redis_url, prefix, tiny_llama_long_path, "gw-w", "--max-num-seqs", "8",
                          "--served-model-name", "tiny", "--num-threads", "1",
                          log_path=logs / "worker.log")
    gw = subprocess.Popen([sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway", "--port", str(port),
                           "--redis", redis_url, "--prefix", prefix, "--api-key", KEY,
                           "--log-level", "warning"], cwd=ROOT,
                          stderr=open(logs / "gateway.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(base) or gw.poll() is not None, 60, what="gateway up")
        wait_for(lambda: workers_alive(redis_url, prefix) or worker.poll() is not None, 240,
                 what="worker up")
        assert worker.poll() is None, (logs / "worker.log").read_text()[-3000:]
        assert gw.poll() is None, (logs / "gateway.log").read_text()[-3000:]
        yield {"base": base, "prefix": prefix, "url": redis_url,
               "client": openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)}
    finally:
        stop_proc(gw, 10)
        stop_proc(worker)
        drop_prefix(redis_url, prefix)


def test_models_lists_the_served_name(pool):
    assert "tiny" in [m.id for m in pool["client"].models.list()]
    assert pool["client"].models.retrieve("tiny").owned_by == "genpool"


def test_a_request_without_model_is_answered_with_the_served_name(pool):
    """OpenAI echoes the model; a model-less request goes to the pool's one model, so the
    answer names it (it said "genpool"), streamed or not."""
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{pool['base']}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    with httpx.stream("POST", f"{pool['base']}/v1/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
        first = json.loads(next(r.iter_lines()).removeprefix("data: "))
    assert first["model"] == "tiny"


def test_completion_logprobs_are_the_engines_raw_distribution(pool, tiny_llama_long_path):
    """logprobs=3 through the official client equals the engine's own logprobs for the same
    greedy request (log-softmax of the raw logits, before penalties and temperature), streamed
    and not; a token's logprob is its own entry in top_logprobs when it is among the top."""
    from genpool.engine import LLM, SamplingParams

    c = pool["client"]
    kw = dict(model="tiny", prompt="The harbor at dawn", max_tokens=6, temperature=0,
              logprobs=3, extra_body={"ignore_eos": True, "frequency_penalty": 1.5})
    whole = c.completions.create(**kw)
    lp = whole.choices[0].logprobs
    with LLM(str(tiny_llama_long_path), num_threads=1) as llm:
        ref = llm.generate(["The harbor at dawn"], SamplingParams(
            temperature=0, max_tokens=6, logprobs=3, ignore_eos=True,
            frequency_penalty=1.5))[0].outputs[0]
        tok = llm.llm_engine.tokenizer
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for t, got, top, d in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs, ref.logprobs):
        assert got == pytest.approx(d[t], abs=1e-4)
        want = sorted(((v, k) for k, v in d.items()), reverse=True)[:3]
        assert sorted(top.values(), reverse=True) == pytest.approx([v for v, _ in want], abs=1e-4)
        assert set(top) == {tok.decode([k]) for _, k in want}
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chunks = list(c.completions.create(**kw, stream=True))
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs
                                             if ch.choices and ch.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
    offsets = [x for ch in chunks for x in (ch.choices[0].logprobs.text_offset
                                            if ch.choices and ch.choices[0].logprobs else [])]
    assert offsets == lp.text_offset


def test_logit_bias_forces_and_bans_a_token(pool):
    """Through the official client; the ids come from the Python client's result (its logprob
    maps are keyed by token id)."""
    from genpool.producer import Client

    c = pool["client"]
    kw = dict(model="tiny", prompt="The harbor at dawn", max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    plain = c.completions.create(**kw, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    with Client(pool["url"], pool["prefix"]) as gc:
        res = gc.submit("The harbor at dawn", model="tiny", max_tokens=1, temperature=0,
                        logprobs=5).result(timeout=60)
    first_id = res.token_ids[0]
    ranked = sorted(res.logprobs[0].items(), key=lambda kv: kv[1])
    other_id = int(ranked[0][0])  # the least likely of the top 5
    other = res.token_texts[ranked[0][0]]
    assert res.token_texts[str(first_id)] == first and other_id != first_id
    banned = c.completions.create(**kw, logprobs=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = c.completions.create(**kw, logprobs=0, logit_bias={str(other_id): 100})
    assert forced.choices[0].logprobs.tokens == [other] * 4  # +100: every step picks it
    # the logprobs stay the model's own (raw) distribution, bias or not
    assert banned.choices[0].logprobs.token_logprobs[0] < plain.choices[0].logprobs.token_logprobs[0]
    for bad in ({"x": 1}, {"1": 101}, {"99999999": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            c.completions.create(**kw, logit_bias=bad)


def test_any_int64_seed_is_taken_and_repeats(pool):
    """OpenAI and vLLM take any 64-bit signed seed: a negative one samples reproducibly (the same
    text twice) and differently from another seed; one past int64 is a 400."""
    c = pool["client"]
    kw = dict(model="tiny", prompt="the weather", max_tokens=12, temperature=1.5)
    texts = {seed: [c.completions.create(**kw, seed=seed).choices[0].text for _ in range(2)]
             for seed in (-5, -(2**63), 2**63 - 1)}
    for seed, (a, b) in texts.items():
        assert a == b, seed
    assert len({t[0] for t in texts.values()}) > 1
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError, match="seed"):
            c.completions.create(**kw, seed=bad)


def test_chat_logprobs_streamed_equal_non_streamed(pool):
    c = pool["client"]
    kw = dict(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
              top_logprobs=2, n=2, seed=3)
    whole = c.chat.completions.create(**{**kw, "temperature": 0.9})
    for ch in whole.choices:
        content = ch.logprobs.content
        assert content and "".join(e.token for e in content) == ch.message.content
        for e in content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 2
            assert e.bytes == list(e.token.encode()) and e.top_logprobs[0].logprob >= e.logprob
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    parts: dict[int, list] = {0: [], 1: []}
    for chunk in c.chat.completions.create(**{**kw, "temperature": 0.9}, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                parts[ch.index] += [(e.token, e.logprob) for e in ch.logprobs.content]
    for ch in whole.choices:  # seeded: the same samples, the same logprobs
        assert parts[ch.index] == [(e.token, e.logprob) for e in ch.logprobs.content]
    plain = c.chat.completions.create(**{k: v for k, v in kw.items()
                                         if k not in ("logprobs", "top_logprobs")})
    assert all(ch.logprobs is None for ch in plain.choices)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _calls_of(stream) -> tuple[list[tuple[str, str]], str]:
    """Tool calls reassembled from streamed deltas (OpenAI's chunking), and the finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                got = calls.setdefault(d.index, ["", ""])
                if d.function and d.function.name:
                    got[0] = d.function.name
                if d.function and d.function.arguments:
                    got[1] += d.function.arguments
            finish = ch.finish_reason or finish
    return [tuple(v) for _, v in sorted(calls.items())], finish


@pytest.mark.parametrize("choice,names", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_a_forced_tool_call_is_valid_streamed_or_not(pool, choice, names):
    import jsonschema

    c = pool["client"]
    kw = dict(model="tiny", messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice=choice,
              max_tokens=120, temperature=0)
    whole = c.chat.completions.create(**kw)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]
    jsonschema.validate(json.loads(call.function.arguments), schema["parameters"])
    streamed, finish = _calls_of(c.chat.completions.create(**kw, stream=True))
    assert streamed == [(call.function.name, call.function.arguments)] and finish == "tool_calls"


def test_a_conversation_with_a_tool_result_goes_on_in_text(pool):
    c = pool["client"]
    msgs = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"}]
    res = c.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER],
                                    max_tokens=8, temperature=0)
    ch = res.choices[0]
    # auto: whatever the (random-weight) model wrote is text unless it is a well-formed call
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert (ch.message.content is not None) or ch.message.tool_calls
    with pytest.raises(openai.BadRequestError, match="tool_choice names 'nope'"):
        c.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="used twice"):
        c.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER, WEATHER])


def test_langchain_tools_structured_output_and_streaming(pool):
    """LangChain's own OpenAI client (langchain-openai) against the gateway, unchanged."""
    import jsonschema
    import pydantic
    from langchain_openai import ChatOpenAI

    class Forecast(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        degrees: int = pydantic.Field(ge=-60, le=60)
        sky: str = pydantic.Field(pattern="^(clear|cloudy|snow)$")

    llm = ChatOpenAI(base_url=f"{pool['base']}/v1", api_key=KEY, model="tiny", temperature=0,
                     max_tokens=120, max_retries=0)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(
        "What is the weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    got = llm.with_structured_output(Forecast).invoke("Forecast for Oslo, as JSON.")
    assert isinstance(got, Forecast) and -60 <= got.degrees <= 60
    short = ChatOpenAI(base_url=f"{pool['base']}/v1", api_key=KEY, model="tiny", temperature=0,
                       max_tokens=8, max_retries=0)
    streamed = "".join(chunk.content for chunk in short.stream("Name three colors."))
    assert streamed and streamed == short.invoke("Name three colors.").content


def test_chat_streamed_equals_non_streamed(pool):
    c = pool["client"]
    kw = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert {ch.id for ch in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")


def test_completion_streamed_equals_non_streamed(pool):
    c = pool["client"]
    kw = dict(model="tiny", prompt="The harbor at dawn", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    whole = c.completions.create(**kw)
    text = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True))
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    assert text == whole.choices[0].text and whole.choices[0].finish_reason == "length"


def test_sse_framing(pool):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{pool['base']}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def error_of(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_api_key_required(pool):
    bad = openai.OpenAI(base_url=f"{pool['base']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{pool['base']}/v1/completions", headers=headers,
                       json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401
        assert error_of(r)["code"] == "invalid_api_key"


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny", "messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": CHAT, "frobnicate": 1}, "frobnicate"),
    ({"model": "tiny", "messages": CHAT, "logprobs": "yes"}, "logprobs"),
    ({"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
    ({"model": "tiny", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"model": "tiny", "messages": CHAT, "echo": True}, "echo"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("{not json", None),
])
def test_validation_errors_are_openai_shaped(pool, body, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{pool['base']}/v1/chat/completions", **kw,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if isinstance(body, dict):  # the official client maps it to its 400 exception
        rest = dict(body)
        with pytest.raises(openai.BadRequestError):
            pool["client"].chat.completions.create(model=rest.pop("model"),
                                                   messages=rest.pop("messages"),
                                                   extra_body=rest)


def test_unknown_model_and_route(pool):
    with pytest.raises(openai.NotFoundError) as e:
        pool["client"].chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):  # streamed too: the status waits for the worker
        pool["client"].chat.completions.create(model="gpt-9", messages=CHAT, stream=True)
    r = httpx.get(f"{pool['base']}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and error_of(r)["type"] == "invalid_request_error"


def wait_cancelled(pool, job_id: str) -> dict:
    r = connect(pool["url"], decode_responses=True)
    key = Client(pool["url"], pool["prefix"]).keys.job(job_id)
    got = wait_for(lambda: r.hget(key, "error"), 20, what="job cancelled")
    return json.loads(got)


def test_disconnect_cancels_streamed_job(pool):
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{pool['base']}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        first = next(r.iter_lines())
    job_id = json.loads(first.removeprefix("data: "))["id"].removeprefix("cmpl-")
    assert wait_cancelled(pool, job_id)["code"] == "cancelled"


def test_disconnect_cancels_non_streamed_job(pool):
    # The job must outlast the client's 1 s timeout by far, whatever the machine: a job that ends
    # before the gateway's cancel leaves nothing to cancel. (1500 tokens took 3.6 s engine-only on
    # one thread on an AVX-512 machine; 15000 leave a wide margin on faster ones.)
    body = {"model": "tiny", "prompt": "Twice", "max_tokens": 15000, "ignore_eos": True}
    r = connect(pool["url"], decode_responses=True)
    prefix = pool["prefix"]

    def job_keys():
        return {k for k in r.scan_iter(f"{prefix}:job:*", count=1000) if not k.endswith(":events")}
    before = job_keys()  # earlier tests' cancelled jobs must not count
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{pool['base']}/v1/completions", json=body, timeout=1.0,
                   headers={"Authorization": f"Bearer {KEY}"})

    def cancelled_jobs():
        return [k for k in job_keys() - before if r.hget(k, "cancel")]
    key = wait_for(cancelled_jobs, 20, what="non-streamed job cancelled")[0]
    err = wait_for(lambda: r.hget(key, "error"), 20, what="cancel reached the worker")
    assert json.loads(err)["code"] == "cancelled"


def test_a_task_that_swallows_its_cancellation_is_cancelled_again():
    """The gateway's cancel of a request's job.result() must end it even when the task survives
    one cancel() (redis-py's asyncio client did, inside XREAD BLOCK), else the request hangs and
    the disconnected client's job is never cancelled."""
    import asyncio

    from genpool.producer.gateway_io import stop_task

    async def stubborn(log):
        for _ in range(2):  # survives two cancellations, like a swallowed one
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                log.append("swallowed")
        await asyncio.sleep(10)
        log.append("ran on")

    async def main():
        log = []
        task = asyncio.ensure_future(stubborn(log))
        await asyncio.sleep(0.01)
        await asyncio.wait_for(stop_task(task, every_s=0.05), 5)
        return task, log

    task, log = asyncio.run(main())
    assert task.cancelled() and log == ["swallowed", "swallowed"]  # the third cancel ended it

    async def fails_when_cancelled():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise redis.ConnectionError("the read was interrupted") from None

    async def main2():
        task = asyncio.ensure_future(fails_when_cancelled())
        await asyncio.sleep(0.01)
        await stop_task(task, every_s=0.05)  # returns: the caller goes on to cancel the job
        return task

    assert isinstance(asyncio.run(main2()).exception(), redis.ConnectionError)


@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn in a thread of this process; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(base), 30, what="thread gateway up")
        yield base
    finally:
        server.should_exit = True
        t.join(10)


@pytest.fixture
def thread_gateway(redis_url):
    """A gateway on a prefix that no worker serves, so its queue only grows."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gw429")
    with serve_in_thread(create_app(redis_url, prefix, max_queue_depth=2)) as base:
        yield base, prefix
    drop_prefix(redis_url, prefix)


def test_redis_down_is_503():
    from genpool.producer.gateway import create_app

    with serve_in_thread(create_app("redis://127.0.0.1:1/0", "nowhere")) as base:
        r = httpx.get(f"{base}/v1/models", timeout=30)
    assert r.status_code == 503 and error_of(r)["code"] == "queue_unavailable"


def test_queue_deeper_than_bound_gets_429(thread_gateway, redis_url):
    base, prefix = thread_gateway
    c = Client(redis_url, prefix)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    for i in range(3):  # nobody serves this prefix: the queue only grows
        c.submit(prompt=f"p{i}", max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1)
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT})
    assert r.status_code == 429 and error_of(r)["code"] == "queue_full"
    assert c.status()["lanes"]["normal"]["queued"] == 3  # the refused requests enqueued nothing
    assert httpx.get(f"{base}/v1/models").json() == {"object": "list", "data": []}


def test_smollm2_streamed_equals_non_streamed(redis_url, smollm2_path, tmp_path):
    """The real model: the same greedy chat request, streamed and not, gives the same text."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwsmol")
    worker = spawn_worker(redis_url, prefix, "smollm2-135m", "gw-smol", "--max-num-seqs", "4",
                          "--num-threads", "1", log_path=tmp_path / "worker.log")
    try:
        with serve_in_thread(create_app(redis_url, prefix)) as base:
            wait_for(lambda: workers_alive(redis_url, prefix) or worker.poll() is not None, 300,
                     what="worker up")
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            kw = dict(model="smollm2-135m", max_tokens=12, temperature=0,
                      messages=[{"role": "user", "content": "What is the capital of France?"}])
            whole = c.chat.completions.create(**kw).choices[0].message.content
            streamed = "".join(ch.choices[0].delta.content or ""
                               for ch in c.chat.completions.create(**kw, stream=True))
    finally:
        stop_proc(worker)
        drop_prefix(redis_url, prefix)
    assert streamed == whole and whole.startswith("The capital of France is Paris")


def test_a_stream_cut_by_a_lost_queue_ends_with_an_error_chunk(tmp_path):
    """Redis goes away for good in the middle of a streamed completion: the stream must end
    with an OpenAI-shaped error event (queue_unavailable), not a dropped connection (found by
    a hostile run: the client saw only 'Connection error.')."""
    import socket
    import time

    from genpool.producer.gateway import create_app
    from genpool.workers.integrations import embedded
    from tests.fake_engine import FakeEngine
    from tests.pool_helpers import worker_thread

    port = next(p for p in range(7300, 7400) if socket.socket().connect_ex(("127.0.0.1", p)))
    server = embedded.start_server(port=port, data_dir=tmp_path / "redis")
    prefix, events = new_prefix("gwcut"), []
    try:
        app = create_app(server.url, prefix)
        with worker_thread(FakeEngine(step_delay=0.05), server.url, prefix), \
                serve_in_thread(app) as base:
            app.state.gateway.client.reconnect_s = 2.0  # give up on Redis after 2 s, not 30
            body = {"model": "fake", "prompt": "cut short", "max_tokens": 400, "stream": True}
            t0 = time.monotonic()
            try:
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                            if len(events) == 3:
                                server.stop()  # and it stays down
            except httpx.HTTPError as e:
                events.append({"transport": repr(e)})
            assert time.monotonic() - t0 < 40
    finally:
        server.stop()
    assert events[:3] and all("choices" in e for e in events[:3])
    assert events[-1].get("error", {}).get("code") == "queue_unavailable", events[-1]
