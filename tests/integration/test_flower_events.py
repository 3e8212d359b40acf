"""FlowerEvents in isolation: which Celery events each worker hook sends (no Redis, no Flower)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from genpool.schemas import ErrorEvent, JobRequest, ResultEvent, Usage
from genpool.workers.integrations import flower_events
from genpool.workers.integrations.flower_events import CELERY_MARK, FlowerEvents, celery_hostname
from genpool.workers.job import Claim, Entry, Job
from genpool.workers.observe import Observers, WorkerObserver


class Recorder:
    def __init__(self, fail: bool = False):
        self.sent: list[tuple[str, dict]] = []
        self.fail = fail

    def send(self, type_, **fields):
        if self.fail:
            raise ConnectionError("redis down")
        self.sent.append((type_, fields))

    def close(self):
        pass


def make(heartbeats=True, freq=2.0):
    rec = Recorder()
    return FlowerEvents(lambda: rec, "genpool@w1", heartbeats=heartbeats, freq=freq), rec


def verdict(job_id, kind="run", **req):
    """A claimed job, as the worker hands it to job_received."""
    r = JobRequest(id=job_id, prompt="hi", **req)
    return Job(Entry("p:jobs:{p}:normal", "normal", "1-0", {}), req=r, job_id=job_id,
               claim=Claim(kind))


def job(job_id):
    return SimpleNamespace(id=job_id)


WORKER = SimpleNamespace(jobs=[])


def test_lifecycle_of_a_stream_job():
    ev, rec = make()
    ev.worker_started(WORKER)
    ev.job_received(verdict("j1"))
    ev.job_started(job("j1"))
    ev.job_finished(job("j1"), ResultEvent(text="Paris.", finish_reason="stop",
                                           usage=Usage(prompt_tokens=3, completion_tokens=2)))
    ev.worker_stopped(WORKER)
    types = [t for t, _ in rec.sent]
    assert types == ["worker-online", "task-received", "task-started", "task-succeeded",
                     "worker-offline"]
    received, succeeded = rec.sent[1][1], rec.sent[3][1]
    assert received["uuid"] == "j1" and received["name"] == "genpool.stream"
    assert "'prompt': 'hi'" in received["kwargs"]
    assert succeeded["runtime"] >= 0 and "Paris." in succeeded["result"]
    assert rec.sent[0][1]["freq"] == 2.0 and ev.processed == 1


def test_error_codes_map_to_celery_states():
    ev, rec = make()
    for i, code in enumerate(("cancelled", "expired", "unknown_model")):
        ev.job_received(verdict(f"j{i}", kind="check" if code == "unknown_model" else "run"))
        ev.job_failed(f"j{i}", ErrorEvent(code=code, message="m"))
    ends = [(t, f) for t, f in rec.sent if t != "task-received"]
    assert ends[0][0] == "task-revoked" and ends[0][1]["terminated"] is True
    assert ends[1][0] == "task-revoked" and ends[1][1]["expired"] is True
    assert ends[2][0] == "task-failed" and "unknown_model" in ends[2][1]["exception"]


def test_celery_jobs_duplicates_and_unknown_ends_are_left_alone():
    ev, rec = make()
    ev.job_received(verdict("c1", metadata={CELERY_MARK: "c1"}))  # its Celery worker reports it
    ev.job_received(verdict("d1", kind="duplicate"))
    ev.job_started(job("c1"))
    ev.job_finished(job("c1"), ResultEvent(text=""))
    ev.job_failed("zz", ErrorEvent(code="internal", message="m"))
    assert rec.sent == []


def test_a_celery_job_the_worker_rejects_is_left_to_celery():
    """A job the worker turns down (unknown model, prompt too long) reaches the observer without
    a parsed request; when the Celery front door submitted it, the Celery worker reports it
    (as genpool.generate): a genpool.stream report too would rename it and count it twice."""
    import json

    from genpool.workers.intake import parse_entry

    ev, rec = make()
    for job_id, meta in (("c2", {CELERY_MARK: "c2"}), ("s2", None)):
        body = {"id": job_id, "prompt": "hi", "model": "not-served", "metadata": meta}
        entry = Entry("p:jobs:{p}:normal", "normal", "1-0", {b"job": json.dumps(body).encode()})
        p = parse_entry(entry, frozenset({"fake"}))
        assert p.req is None and p.error.code == "unknown_model"
        p.claim = Claim.CHECK
        ev.job_received(p)
        ev.job_failed(job_id, p.error)
    assert [(t, f["uuid"]) for t, f in rec.sent] == [("task-received", "s2"), ("task-failed", "s2")]


def test_heartbeats_follow_freq_and_only_when_asked(monkeypatch):
    # the module's clock is the test's: on real time, "too early" was the 50 ms between two
    # statements, which a busy CI machine did not always keep
    clock = SimpleNamespace(now=1000.0, time=time.time)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(flower_events, "time", clock)
    ev, rec = make(freq=2.0)
    ev.worker_started(WORKER)
    clock.now += 1.9
    ev.tick(WORKER)  # too early
    clock.now += 0.1
    ev.tick(WORKER)
    ev.tick(WORKER)  # the next one is due 2 s after this beat
    assert [t for t, _ in rec.sent] == ["worker-online", "worker-heartbeat"]
    clock.now += 2.0
    ev.tick(WORKER)
    assert [t for t, _ in rec.sent] == ["worker-online", "worker-heartbeat", "worker-heartbeat"]
    quiet, rec2 = make(heartbeats=False)  # inside a Celery worker, which beats itself
    quiet.worker_started(WORKER)
    quiet.tick(WORKER)
    assert rec2.sent == []


def test_events_are_kept_while_redis_is_down_and_sent_in_order_after(monkeypatch):
    rec = Recorder(fail=True)
    ev = FlowerEvents(lambda: rec, "genpool@w1")
    monkeypatch.setattr("genpool.workers.integrations.flower_events.RETRY_AFTER_S", 0.0)
    ev.job_received(verdict("j1"))
    ev.job_started(job("j1"))
    assert rec.sent == [] and len(ev._buffer) == 2
    rec.fail = False
    ev.tick(SimpleNamespace(jobs=[]))  # heartbeat due: buffered events go first
    assert [t for t, _ in rec.sent] == ["task-received", "task-started", "worker-heartbeat"]
    assert rec.sent[0][1]["timestamp"] < rec.sent[2][1]["timestamp"]


def test_a_failing_observer_never_reaches_the_worker():
    class Broken(WorkerObserver):
        def tick(self, worker):
            raise RuntimeError("bug")

    seen = []

    class Fine(WorkerObserver):
        def tick(self, worker):
            seen.append(worker)

    Observers(Broken(), Fine()).emit("tick", "w")
    assert seen == ["w"]


def test_hostnames():
    assert celery_hostname("host-12") == "genpool@host-12"
    assert celery_hostname("gpu0@host") == "gpu0@host"
