"""The gateway's own llguidance check of a constraint runs off the event loop (issue 28, item 10):
concurrent big-schema requests must not stall /health. A real gateway in its own uvicorn process,
real httpx clients, real Redis; no worker, so each request ends in 503 no_workers after it was
checked (the check is the part measured). Its own process: with the server in a thread of the
test, the four posting clients shared its GIL, and one /health took 0.66 s in a CI run."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from genpool.schemas.structured import StructuredOutputs, check_structured
from tests.pool_helpers import ROOT, drop_prefix, free_port, http_ok, new_prefix, stop_proc, wait_for

SERVE = ("import sys, uvicorn; from genpool.producer.gateway import create_app; "
         "uvicorn.run(create_app(sys.argv[1], sys.argv[2], no_worker_grace_s=0.1), host='127.0.0.1', "
         "port=int(sys.argv[3]), log_level='warning')")


def wide(n: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "string",
                                                       "pattern": f"[a-z]{{{i % 7 + 1}}}x"}
                                             for i in range(n)}}


def test_big_schema_checks_do_not_stall_health(redis_url):
    schema = wide(8000)  # ~450 KB: llguidance's check takes ~0.7 s here (the report: ~1.6 s)
    t0 = time.monotonic()
    assert check_structured(StructuredOutputs(json=schema)) is None
    t_check = time.monotonic() - t0
    prefix = new_prefix("gwcheck")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r",
                                                                       "schema": schema}}}
    statuses, lat = [], []
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gw = subprocess.Popen([sys.executable, "-c", SERVE, redis_url, prefix, str(port)], cwd=ROOT)
    try:
        wait_for(lambda: http_ok(f"{base}/health") or gw.poll() is not None, 60, what="gateway up")
        assert gw.poll() is None, "the gateway exited"
        # One client, warmed: a fresh httpx client per probe spends ~75 ms (0.2-0.3 s the first
        # time, on busy cores) building its TLS context, which is the client's cost, not the
        # gateway's stall this measures.
        with httpx.Client(base_url=base, timeout=60) as probe:
            assert probe.get("/health").status_code == 200
            def post():
                statuses.append(httpx.post(f"{base}/v1/chat/completions", json=body,
                                           timeout=120).status_code)
            posts = [threading.Thread(target=post) for _ in range(4)]
            for t in posts:
                t.start()
            time.sleep(0.05)  # the bodies are in; their checks are running
            while any(t.is_alive() for t in posts):
                t1 = time.monotonic()
                assert probe.get("/health").status_code == 200
                lat.append(time.monotonic() - t1)
                time.sleep(0.02)
            for t in posts:
                t.join()
    finally:
        stop_proc(gw, 10)
        drop_prefix(redis_url, prefix)
    assert statuses == [503] * 4, statuses  # checked, valid, then: no worker serves it
    assert lat and max(lat) < t_check / 3, (f"/health took {max(lat):.2f} s while 4 checks of "
                                            f"{t_check:.2f} s each ran", lat)


def spy_checks(monkeypatch) -> list[str]:
    """The thread of each llguidance check (schemas/structured.py llguidance_grammar)."""
    import genpool.schemas.structured as st

    seen, real = [], st.llguidance_grammar

    def spy(kind, text):
        seen.append(threading.current_thread().name)
        return real(kind, text)

    monkeypatch.setattr(st, "llguidance_grammar", spy)
    return seen


def test_a_constraint_checked_once_is_not_checked_again(monkeypatch):
    """The gateway checks a request's constraint on its check threads, then its client's submit
    checks the same request on the event loop: the second check took as long as the first."""
    from genpool.producer.protocol import build_request

    seen = spy_checks(monkeypatch)
    schema = wide(40 + len(seen))  # a schema no earlier test checked
    for _ in range(3):
        build_request("hi", json_schema=schema)
    assert len(seen) == 1
    build_request("hi", json_schema=wide(41 + len(seen)))
    assert len(seen) == 2
    for _ in range(2):  # a bad one's verdict is kept too, and each submit is refused
        try:
            build_request("hi", structured_outputs={"regex": "a(("})
        except ValueError as e:
            assert "structured_outputs.regex" in str(e)
        else:
            raise AssertionError("a bad regex was accepted")
    assert len(seen) == 3


def test_a_forced_tool_calls_constraint_is_checked_off_the_event_loop(monkeypatch):
    """tool_choice "required" (or a named tool) builds a constraint from the tools' schemas:
    the gateway checked it on the event loop (0.40 s for a 233 KB schema)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from genpool.producer.gateway import Gateway

    seen = spy_checks(monkeypatch)
    gw = Gateway(None, "unused", [], None, 0, None, 4)
    gw.checks = ThreadPoolExecutor(1, thread_name_prefix="genpool-gw-check")
    tool = {"type": "function", "function": {"name": "f", "parameters": wide(30)}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "tool_choice": "required"}
    try:
        req = asyncio.run(gw.parse("chat", body))
    finally:
        gw.checks.shutdown()
    assert req.kwargs["structured_outputs"] and seen, (req.kwargs, seen)
    assert all(name.startswith("genpool-gw-check") for name in seen), seen


def test_an_oversized_list_is_refused_before_its_items_are_read():
    """A bound on a list's length was checked after every item (the request's conversion, then
    pydantic): 200,000 messages took 0.5 s of the gateway's event loop for a 400. The length is
    checked first: an item that would be refused at the end of the list is never reached."""
    from genpool.producer.openai_format import APIError, parse_body

    msgs = [{"role": "user", "content": "x"}] * 199_999 + ["not a message"]
    cases = [("chat", {"messages": msgs}, "messages", "200000 items; at most 1000"),
             ("completion", {"prompt": [1] * 1_000_000 + ["x"]}, "prompt", "at most 1000000"),
             ("completion", {"prompt": "p", "stop": ["a"] * 16 + [7]}, "stop", "17 items"),
             ("completion", {"prompt": "p", "logit_bias": {str(i): 1 for i in range(1024)}
                             | {"x": "y"}}, "logit_bias", "1025 items; at most 1024")]
    for kind, body, param, words in cases:
        try:
            parse_body(kind, {"model": "m", **body})
        except APIError as e:
            assert e.param == param and words in e.message, (param, e.param, e.message)
        else:
            raise AssertionError(f"{param}: accepted")
