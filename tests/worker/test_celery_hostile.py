"""Hostile or broken callers of the Celery front door, against real Celery workers and real Redis.

Raw messages go in through kombu (what anyone who can reach the broker can publish), shaped the
ways Celery's own request handling does not expect. Neither kind of Celery worker may die of
one (the message, unacknowledged, would go back on the queue and kill the next worker too):
it must be rejected, logged with what was wrong, and a good task after it must still complete.
Both kinds: the plain forwarder (`celery -A genpool.workers.integrations.celery_app worker`, with
a genpool worker in a thread of this process) and `genpool worker --celery` (the fake engine
inside the Celery worker). And a Celery caller may not jump the queue past the gateway's
priority ceiling.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import ROOT, drop_prefix, new_prefix, spawn_worker, stop_proc, wait_for, worker_thread

pytest.importorskip("celery", reason="the worker extra (celery) is not installed")
TASK = "genpool.generate"


@contextmanager
def forwarder(redis_url: str, prefix: str, log_path):
    """`celery -A genpool.workers.integrations.celery_app worker`: task bodies only, the engine
    is a genpool worker in a thread of this process."""
    env = dict(os.environ, GENPOOL_REDIS_URL=redis_url, GENPOOL_PREFIX=prefix,
               GENPOOL_CELERY_QUEUE=prefix)
    cmd = [sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app",
           "worker", "-P", "threads", "-c", "2", "-Q", prefix, "-n", f"fw-{prefix[-8:]}@%h",
           "--without-mingle", "--without-gossip", "-l", "info"]
    with worker_thread(FakeEngine(), redis_url, prefix):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=open(log_path, "wb"))
        try:
            yield proc
        finally:
            stop_proc(proc, 20)


@contextmanager
def in_process(redis_url: str, prefix: str, log_path):
    """`genpool worker --celery`: the (fake) engine inside the Celery worker process."""
    proc = spawn_worker(redis_url, prefix, "fake", f"cel-{prefix[-8:]}", "--engine-factory",
                        "tests.fake_engine:make", "--celery", "--celery-queue", prefix,
                        "--celery-concurrency", "2", log_path=log_path)
    try:
        yield proc
    finally:
        stop_proc(proc, 20)


@pytest.fixture(params=["forwarder", "in_process"])
def celery_worker(request, redis_url, tmp_path):
    from genpool.workers.integrations.celery_app import make_app

    prefix, log = new_prefix("hostile"), tmp_path / "celery.log"
    app = make_app(redis_url, prefix)
    start = forwarder if request.param == "forwarder" else in_process
    try:
        with start(redis_url, prefix, log) as proc:
            yield SimpleNamespace(proc=proc, log=log, prefix=prefix, app=app, url=redis_url)
    finally:
        with app.connection_for_write() as conn:  # this run's queue (never FLUSHDB: shared DB)
            conn.default_channel.client.delete(prefix)
        drop_prefix(redis_url, prefix)


def publish_raw(st, body, headers: dict, raw: bool = False) -> None:
    """One message on the queue as kombu sends it, with exactly these headers and body."""
    with st.app.connection_for_write() as conn:
        kw = (dict(content_type="application/json", content_encoding="utf-8") if raw
              else dict(serializer="json"))
        conn.Producer().publish(body, exchange="", routing_key=st.prefix, headers=headers, **kw)


def _id() -> str:
    return uuid.uuid4().hex


def unsettled(st) -> list[str]:
    """This queue's messages a worker took and never acknowledged or rejected (kombu's Redis
    transport keeps them in its `unacked` hash, shared by every queue of the database)."""
    with st.app.connection_for_write() as conn:
        held = conn.default_channel.client.hvals("unacked")
    return [m.decode() for m in held if f'"routing_key": "{st.prefix}"' in m.decode()]


OK = {"prompt": "x", "max_tokens": 2}
SIG = {"task": TASK, "args": [], "kwargs": {}, "subtask_type": None, "immutable": True}
# (headers, body, what the log must say was wrong); the headers get task=genpool.generate
# unless they name another task, or None for none (protocol 1: all in the body)
MALFORMED = [
    ({}, {"not": "a list"}, "header 'id'"),  # the message, exactly (no id header either)
    ({"id": _id()}, {"not": "a list"}, "body must be a JSON array [args, kwargs, embed]"),
    ({"id": _id()}, 5, "body must be a JSON array [args, kwargs, embed]"),
    ({"id": _id()}, "abc", "body must be a JSON array [args, kwargs, embed]"),
    ({"id": _id()}, [[], {}, {}, 4], "body must be a JSON array [args, kwargs, embed]"),
    ({"id": _id()}, [1, {}, {}], "args must be a JSON array"),
    ({"id": _id()}, [[], [], {}], "kwargs must be a JSON object"),
    ({"id": _id()}, [[], {}, "x"], "embed must be a JSON object"),
    ({"id": _id()}, {"args": "x", "kwargs": {}}, "args must be a JSON array"),  # hybrid 1/2
    ({"task": None}, {"task": TASK, "id": _id(), "args": [], "kwargs": []},  # protocol 1
     "kwargs must be a JSON object"),
    ({"id": 5}, [[], OK, {}], "header 'id'"),
    ({"id": _id(), "task": ["x"]}, [[], OK, {}], "header 'task' must be a string"),
    ({"id": _id(), "timelimit": [1, 2, 3]}, [[], OK, {}], "header 'timelimit'"),
    ({"id": _id(), "timelimit": "soon"}, [[], OK, {}], "header 'timelimit'"),
    ({"id": _id(), "stamped_headers": 5}, [[], OK, {}], "header 'stamped_headers'"),
    ({"id": _id(), "stamps": 5}, [[], OK, {}], "header 'stamps'"),
    ({"id": _id(), "shadow": [1]}, [[], OK, {}], "header 'shadow' must be a string"),
    ({"id": _id(), "chain": 5}, [[], OK, {}], "header 'chain' is not a task message header"),
    ({"id": _id()}, [[], OK, {"foo": 1}], "unknown embed field 'foo'"),
    ({"id": _id()}, [[], OK, {"chain": [{"x": 1}]}], "embed signatures must be JSON objects"),
    ({"id": _id()}, [[], OK, {"callbacks": [{**SIG, "options": 5}]}],
     "signature field 'options'"),
    # readable, but Celery's own failure handling raises in the pool thread (it stores the
    # failed chain's results under task id 5): the message must still be settled
    ({"id": _id()}, [[], {"prompt": "x", "max_tokens": 0},
                     {"chain": [{**SIG, "options": {"task_id": 5}}]}],
     "Celery failed handling its outcome"),
]


def envelope(headers: dict) -> dict:
    """The headers a MALFORMED message is published with."""
    out = {"task": TASK, **headers}
    return out if out["task"] is not None else {k: v for k, v in out.items() if k != "task"}


def logged(log: str, headers: dict, body, reason: str) -> bool:
    """A line of the log gives the reason, and the message's id when it has a usable one."""
    mid = envelope(headers).get("id") if "task" in envelope(headers) else body["id"]
    return any(reason in line and (not isinstance(mid, str) or mid in line)
               for line in log.splitlines())


def test_malformed_messages_are_rejected_and_the_worker_keeps_serving(celery_worker):
    st = celery_worker
    for headers, body, _ in MALFORMED:
        publish_raw(st, body, envelope(headers))
    publish_raw(st, b"{not json", {"task": TASK, "id": _id()}, raw=True)  # Celery's own check
    # behind every bad message on the queue: a good task still completes
    good = st.app.send_task(TASK, kwargs=dict(prompt="after the storm", max_tokens=5))
    wait_for(lambda: good.ready() or st.proc.poll() is not None, 60,
             what=lambda: f"the good task (log: {st.log.read_text()[-3000:]})")
    log = st.log.read_text()
    assert st.proc.poll() is None, f"the Celery worker died (rc {st.proc.poll()}):\n{log[-4000:]}"
    assert good.get(timeout=5)["text"] == expected_for_prompt("after the storm", 5)
    assert "Unrecoverable error" not in log and "Connection to broker lost" not in log
    # rejected or acknowledged for good: none holds a worker slot or goes back on the queue
    wait_for(lambda: not unsettled(st), 10, what=lambda: f"settled messages: {unsettled(st)}")
    with st.app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(st.prefix) == 0
    # the good task can finish on the other pool thread before a bad one's error is logged
    # (Celery's traceback first, then the guard's line): wait for each, don't read once
    for headers, body, reason in MALFORMED:
        wait_for(lambda: logged(st.log.read_text(), headers, body, reason), 10,
                 what=lambda: f"{reason!r} logged for {headers} (log: {st.log.read_text()[-4000:]})")


def test_celery_callers_get_the_gateways_priority_ceiling(redis_url, tmp_path):
    """A Celery caller may ask to run later, never sooner than an HTTP caller may."""
    from genpool.producer.gateway import GATEWAY_PRIORITY
    from genpool.schemas import Keys
    from genpool.schemas.connection import connect
    from genpool.schemas.request import CALLER_PRIORITY_CEILING
    from genpool.workers.integrations.celery_app import make_app

    assert GATEWAY_PRIORITY == CALLER_PRIORITY_CEILING  # one definition, in schemas/
    prefix = new_prefix("prio")
    app = make_app(redis_url, prefix)
    r = connect(redis_url, decode_responses=True)
    try:
        with forwarder(redis_url, prefix, tmp_path / "celery.log") as proc:
            jump = [app.send_task(TASK, kwargs=dict(prompt="me first", max_tokens=2, priority=p))
                    for p in (-(2**31), CALLER_PRIORITY_CEILING - 1)]
            ok = [app.send_task(TASK, kwargs=dict(prompt="fine", max_tokens=2, priority=p))
                  for p in (CALLER_PRIORITY_CEILING, 0, 5)]
            wait_for(lambda: all(t.ready() for t in jump + ok) or proc.poll() is not None, 60,
                     what="every task to end")
            for t in jump:
                assert t.state == "FAILURE", (t.state, t.result)
                assert "priority" in str(t.result) and str(CALLER_PRIORITY_CEILING) in str(t.result)
                assert not r.exists(Keys(prefix).job(t.id), Keys(prefix).events(t.id)), "queued"
            assert [t.get(timeout=5)["text"] for t in ok] == [expected_for_prompt("fine", 2)] * 3
    finally:
        r.delete(prefix)
        r.close()
        drop_prefix(redis_url, prefix)


def test_a_waiting_task_outlives_a_redis_outage(monkeypatch):
    """The client's own retries give up after ~5 s of a lost Redis (a failover, a restart):
    the task failed with ConnectionError and was acknowledged, so its caller never got the
    result of a job that went on running. It waits on now, as the job does."""
    import redis

    from genpool.schemas import JobResult
    from genpool.workers.integrations import celery_app

    # a stalled server times out, a cluster may be down or mid-failover: each is an outage too
    outage = [redis.ConnectionError("Connection refused"), redis.TimeoutError("Timeout reading"),
              redis.exceptions.ClusterDownError("CLUSTERDOWN"), redis.exceptions.TryAgainError(),
              TimeoutError()]
    done = JobResult(id="j", text="ok", finish_reason="stop")

    def result(timeout, raise_on_error):
        if outage:
            raise outage.pop(0)
        return done
    monkeypatch.setattr(celery_app, "POLL_S", 0.01)
    task = SimpleNamespace(request=SimpleNamespace(id="t-outage"))
    assert celery_app._wait(task, SimpleNamespace(id="j", result=result)) is done
    assert outage == []


def test_a_plain_forwarder_shuts_down_with_tasks_still_waiting(redis_url, tmp_path):
    """SIGTERM to `celery ... worker` (the forwarder alone) while a task body waits for a job no
    worker runs: its warm shutdown waited for that body for ever (only `genpool worker --celery`
    told waiting bodies to give their message back), so an orchestrator SIGKILLed it and the
    caller waited an hour for redelivery. The body hands its message back, the process exits."""
    import signal
    import time

    from celery.result import AsyncResult

    from genpool.workers.integrations.celery_app import make_app

    prefix = new_prefix("fwstop")
    app = make_app(redis_url, prefix)
    env = dict(os.environ, GENPOOL_REDIS_URL=redis_url, GENPOOL_PREFIX=prefix,
               GENPOOL_CELERY_QUEUE=prefix)
    cmd = [sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app",
           "worker", "-P", "threads", "-c", "2", "-Q", prefix, "-n", f"fw-{prefix[-8:]}@%h",
           "--without-mingle", "--without-gossip", "-l", "info"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "fw.log", "wb"))
    try:
        r = app.send_task(TASK, kwargs=dict(prompt="x", model="fake", max_tokens=2))
        wait_for(lambda: AsyncResult(r.id, app=app).state == "STARTED", 60, what="task waiting")
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15
        with app.connection_for_write() as conn:  # the message went back on the queue
            assert conn.default_channel.client.llen(prefix) == 1
    finally:
        stop_proc(proc, 5)
        with app.connection_for_write() as conn:
            conn.default_channel.client.delete(prefix)
        drop_prefix(redis_url, prefix)


def test_a_tls_url_works_for_celerys_broker_and_backend():
    """genpool takes rediss:// URLs; Celery's Redis result backend refused one without
    ssl_cert_reqs (at the first result, after the model had loaded). The certificate is
    verified unless the URL says otherwise."""
    from genpool.workers.integrations.celery_app import make_app

    app = make_app("rediss://127.0.0.1:6390/0")
    assert app.backend.connparams["ssl_cert_reqs"] is not None
    assert "ssl_cert_reqs=required" in app.conf.broker_url
    loose = make_app("rediss://127.0.0.1:6390/0?ssl_cert_reqs=none")
    assert "ssl_cert_reqs=none" in loose.conf.result_backend
    assert "ssl_cert_reqs" not in make_app("redis://127.0.0.1:6390/0").conf.broker_url


def test_the_visibility_timeout_is_a_setting(monkeypatch):
    """kombu delivers a task again once it has waited unacknowledged this long, even while its
    first body still waits (a job behind a long backlog): a deployment sets it above its longest
    wait."""
    from genpool.workers.integrations.celery_app import make_app

    monkeypatch.delenv("GENPOOL_CELERY_VISIBILITY_S", raising=False)
    assert make_app("redis://127.0.0.1:6390/0").conf.broker_transport_options["visibility_timeout"] == 3600
    monkeypatch.setenv("GENPOOL_CELERY_VISIBILITY_S", "86400")
    assert make_app("redis://127.0.0.1:6390/0").conf.broker_transport_options["visibility_timeout"] == 86400
    monkeypatch.setenv("GENPOOL_CELERY_VISIBILITY_S", "0")
    with pytest.raises(ValueError, match="GENPOOL_CELERY_VISIBILITY_S"):
        make_app("redis://127.0.0.1:6390/0")
