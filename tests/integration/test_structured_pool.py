"""Structured outputs through every front door, on one real SmolLM2 worker process:
Client.submit, `genpool submit --json-schema`, the gateway with the official openai client
(response_format json_object / json_schema, streamed and not, vLLM's structured_outputs extra
body, chat.completions.parse with a pydantic model), `genpool batch` lines and the Celery task.
Errors: caught at submit when the client can tell; otherwise invalid_request on the job's stream
while the worker keeps serving."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import openai
import pydantic
import pytest

from genpool.producer import Client
from genpool.producer.batch import run_batch
from genpool.producer.client import SUBMIT
from genpool.producer.protocol import submit_args
from genpool.schemas import JobRequest
from genpool.schemas.request import new_job_id
from tests.pool_helpers import ROOT, drop_prefix, new_prefix, spawn_worker, stop_proc, wait_for, workers_alive
from tests.producer.test_gateway import answers, free_port

pytest.importorskip("celery")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["name", "age", "city"],
    "additionalProperties": False}
DOC = "Extract the person as JSON: Marta Rossi, 41, moved to Rome last year."
MSGS = [{"role": "user", "content": DOC}]
# json_object allows any keys: a prompt the model answers with a short object, so it ends
COPY = [{"role": "user", "content": 'Reply with exactly this JSON and nothing else: {"ok": true}'}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=130)
    city: str = pydantic.Field(pattern="^(Paris|Rome|Oslo)$")


@pytest.fixture(scope="module")
def pool(redis_url, smollm2_path, tmp_path_factory):
    prefix, port = new_prefix("so"), free_port()
    logs = tmp_path_factory.mktemp("structured")
    worker = spawn_worker(redis_url, prefix, smollm2_path, "so-w", "--max-num-seqs", "16",
                          "--served-model-name", "smol", "--num-threads", "2", "--celery",
                          "--celery-queue", prefix, "--celery-concurrency", "4",
                          log_path=logs / "worker.log")
    gw = subprocess.Popen([sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway", "--port", str(port),
                           "--redis", redis_url, "--prefix", prefix, "--log-level", "warning"],
                          cwd=ROOT, stderr=open(logs / "gateway.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    client = Client(redis_url, prefix)
    try:
        wait_for(lambda: answers(base) or gw.poll() is not None, 60, what="gateway up")
        wait_for(lambda: workers_alive(redis_url, prefix) or worker.poll() is not None, 240,
                 what="worker up")
        assert worker.poll() is None, (logs / "worker.log").read_text()[-3000:]
        yield {"client": client, "prefix": prefix, "url": redis_url, "logs": logs,
               "oai": openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)}
    finally:
        stop_proc(gw, 10)
        stop_proc(worker)
        client.redis.delete(prefix, f"_kombu.binding.{prefix}")
        client.close()
        drop_prefix(redis_url, prefix)


def test_client_json_schema_response_format_and_pydantic(pool):
    c = pool["client"]
    jobs = [c.submit(messages=MSGS, json_schema=PERSON, temperature=0, max_tokens=120),
            c.submit(messages=MSGS, json_schema=Person, temperature=0.8, seed=3, max_tokens=120),
            c.submit(messages=COPY, response_format={"type": "json_object"}, temperature=0,
                     max_tokens=60),
            c.submit(DOC, structured_outputs={"choice": ["Paris", "Rome", "Oslo"]}, max_tokens=8)]
    res = [j.result(timeout=180) for j in jobs]
    for r in res:
        assert r.error is None and r.finish_reason == "stop", (r.text, r.finish_reason, r.error)
    jsonschema.validate(json.loads(res[0].text), PERSON)
    Person.model_validate_json(res[1].text)
    assert isinstance(json.loads(res[2].text), dict)
    assert res[3].text in ("Paris", "Rome", "Oslo")


@pytest.mark.parametrize("kw,words", [
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable"),
    (dict(structured_outputs={"regex": "a(b"}), "unclosed group"),
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "exactly one"),
])
def test_client_refuses_bad_constraints_before_submitting(pool, kw, words):
    with pytest.raises(ValueError, match=words):
        pool["client"].submit("hi", **kw)


def raw_submit(c: Client, **fields) -> str:
    """Enqueue without the client's checks: what a producer in another language might send."""
    data = {"id": new_job_id(), "prompt": "Hello", "max_tokens": 5, **fields}
    req = JobRequest(id=data["id"], prompt="Hello")  # for the keys and lane only
    args = submit_args(req)
    args[0] = json.dumps(data)  # written by hand: pydantic will not serialize 300 levels deep
    SUBMIT(c.redis, [c.keys.job(req.id), c.keys.jobs(req.lane)], args)
    return req.id


def test_worker_reports_bad_constraints_on_the_stream_and_keeps_serving(pool):
    c = pool["client"]
    deep: dict = {"type": "string"}
    for _ in range(150):
        deep = {"type": "object", "properties": {"a": deep}}
    bad = {raw_submit(c, structured_outputs={"json": {"type": "integer", "minimum": 5, "maximum": 3}}):
           "Unsatisfiable", raw_submit(c, structured_outputs={"regex": "(?=a)b"}): "look-around",
           raw_submit(c, structured_outputs={"json": deep}): "recursion|deep"}
    good = c.submit("Count: one, two,", temperature=0, max_tokens=6, ignore_eos=True)
    for job_id, words in bad.items():
        err = c.job(job_id).result(timeout=120, raise_on_error=False).error
        assert err is not None and err.code == "invalid_request", err
        assert re.search(words, err.message), err
    assert len(good.result(timeout=120).token_ids) == 6  # the pool kept serving


def test_cli_submit_json_schema(pool, tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    out = subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", "submit", DOC, "--chat",
                          "--json-schema", str(path), "--temperature", "0", "--max-tokens", "120",
                          "--json", "--redis", pool["url"], "--prefix", pool["prefix"]],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(json.loads(out.stdout)["text"]), PERSON)
    path.write_text("{not json")
    bad = subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", "submit", DOC, "--json-schema",
                          str(path), "--redis", pool["url"], "--prefix", pool["prefix"]],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--json-schema" in bad.stderr


def test_gateway_response_format_with_the_openai_client(pool):
    oai = pool["oai"]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = oai.chat.completions.create(model="smol", messages=MSGS, temperature=0, max_tokens=120,
                                        response_format=rf)
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    chunks = oai.chat.completions.create(model="smol", messages=MSGS, temperature=0,
                                         max_tokens=120, response_format=rf, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    comp = oai.chat.completions.create(model="smol", messages=COPY, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(comp.choices[0].message.content), dict)
    streamed = oai.completions.create(model="smol", prompt=DOC + "\nCity:", max_tokens=8,
                                      stream=True, extra_body={"structured_outputs": {
                                          "choice": ["Paris", "Rome", "Oslo"]}})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) in ("Paris", "Rome", "Oslo")
    parsed = oai.chat.completions.parse(model="smol", messages=MSGS, temperature=0,
                                        max_tokens=120, response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    with pytest.raises(openai.BadRequestError, match="Unsatisfiable"):
        oai.chat.completions.create(model="smol", messages=MSGS, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "integer", "minimum": 5, "maximum": 3}}})


def test_gateway_response_format_on_completions_and_json_object_streamed(pool):
    """response_format on /v1/completions (the openai client passes it as extra body there), whole
    and streamed (the same text); json_object streamed on chat and on completions; an over-limit
    schema is a 400 naming the limit, and a pathological regex runs without holding up the pool."""
    oai = pool["oai"]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    prompt = DOC + "\nJSON:"
    whole = oai.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=120,
                                   extra_body={"response_format": rf})
    assert whole.choices[0].finish_reason == "stop", whole
    jsonschema.validate(json.loads(whole.choices[0].text), PERSON)
    chunks = oai.completions.create(model="smol", prompt=prompt, temperature=0, max_tokens=120,
                                    stream=True, extra_body={"response_format": rf})
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text

    obj = {"response_format": {"type": "json_object"}}
    chat = oai.chat.completions.create(model="smol", messages=COPY, temperature=0, max_tokens=60,
                                       stream=True, **obj)
    text = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)
    assert isinstance(json.loads(text), dict), text
    comp = oai.completions.create(model="smol", prompt='Reply with this JSON: {"ok": true}\nJSON:',
                                  temperature=0, max_tokens=60, stream=True, extra_body=obj)
    parts = [ch.choices[0] for ch in comp if ch.choices]
    text = "".join(c.text for c in parts)
    assert parts[-1].finish_reason == "stop", (text, parts[-1])
    assert isinstance(json.loads(text), dict), text

    huge = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(40000)}}
    with pytest.raises(openai.BadRequestError, match="over 1000000 characters"):
        oai.completions.create(model="smol", prompt="x", max_tokens=4, extra_body={"response_format": {
            "type": "json_schema", "json_schema": {"name": "huge", "schema": huge}}})
    hostile = oai.completions.create(model="smol", prompt="a or b:", max_tokens=30, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "(a|b)*a(a|b){20}"}})
    out = hostile.choices[0]
    assert out.finish_reason in ("stop", "length") and re.fullmatch("[ab]*", out.text), out
    if out.finish_reason == "stop":
        assert re.fullmatch("(a|b)*a(a|b){20}", out.text), out.text


def test_batch_lines_and_celery_task(pool, tmp_path):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MSGS, "temperature": 0, "max_tokens": 120, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}}
             for i in range(3)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": MSGS, "structured_outputs": {"regex": "a(b"}}})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch(inp, out, client=pool["client"], progress=False)
    got = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    for i in range(3):
        content = got[f"r{i}"]["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), PERSON)
    assert "unclosed group" in got["bad"]["error"]["message"]

    from genpool.workers.integrations.celery_app import make_app

    caller = make_app(pool["url"], pool["prefix"])
    task = caller.send_task("genpool.generate", kwargs=dict(
        messages=MSGS, json_schema=PERSON, temperature=0, max_tokens=120))
    res = task.get(timeout=180)
    assert res["error"] is None
    jsonschema.validate(json.loads(res["text"]), PERSON)


def test_extract_records_example(pool, tmp_path):
    from examples.extract_records import DEFAULT_SCHEMA

    out = tmp_path / "records.jsonl"
    run = subprocess.run([sys.executable, "examples/extract_records.py", "examples/docs", "-o",
                          str(out), "--max-chars", "600", "--redis", pool["url"], "--prefix",
                          pool["prefix"]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["document"] for r in records) == sorted(
        p.name for p in (ROOT / "examples" / "docs").glob("*.txt"))
    for r in records:
        jsonschema.validate(r["record"], DEFAULT_SCHEMA)
