"""What a newcomer sees, continued: Client.map's waits, a cancelled job's summary line, and the
jobs in the lanes (`genpool status`, `genpool jobs list`).

Real Redis (the test DB), real `genpool` processes for the CLI, the fake engine in a worker
thread where a worker is needed (what is tested is the producer's side, not the model's).
"""
from __future__ import annotations

import threading
import time

import pytest

from genpool.producer import NoWorkers
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import client_env, wait_for, worker_thread
from tests.producer.test_ux import genpool


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "uxq") as e:
        yield e


def _unserved_notes(caplog, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "genpool.client" and f"no live worker serves {what}" in r.getMessage()]


def test_map_says_when_no_worker_serves_and_ends_as_result_does(env, caplog):
    """Client.map never waits silently: it warns (genpool.client) at once when no live worker
    serves its jobs' model, and its timeout / no_worker_s end the wait with NoWorkers, as
    Job.result does; a worker that serves but is slow gives a plain TimeoutError."""
    import logging

    url, prefix, c = env
    caplog.set_level(logging.WARNING, logger="genpool.client")
    t0 = time.monotonic()
    with pytest.raises(NoWorkers) as e:
        c.map(["a", "b"], model="nobody", max_tokens=2, timeout=2)
    assert 2 <= time.monotonic() - t0 < 20
    assert "model 'nobody'" in str(e.value) and "genpool worker --model nobody" in str(e.value)
    assert len(_unserved_notes(caplog, f"model 'nobody' on prefix '{prefix}'")) == 1
    t0 = time.monotonic()
    with pytest.raises(NoWorkers):
        c.map(["c"], model="nobody", max_tokens=2, no_worker_s=1)
    assert 1 <= time.monotonic() - t0 < 20
    with worker_thread(FakeEngine(step_delay=0.05), url, prefix):
        with pytest.raises(TimeoutError) as e:
            c.map(["d"], max_tokens=2000, timeout=1)
        assert not isinstance(e.value, NoWorkers)


def test_map_without_a_timeout_warns_then_finishes_when_a_worker_comes(env, caplog):
    import logging

    url, prefix, c = env
    caplog.set_level(logging.INFO, logger="genpool.client")
    out: list = []
    t = threading.Thread(target=lambda: out.append(c.map(["x", "y"], max_tokens=3)), daemon=True)
    t.start()
    wait_for(lambda: _unserved_notes(caplog, f"prefix '{prefix}'"), 10,
             what="map's no-worker warning")
    with worker_thread(FakeEngine(), url, prefix):
        t.join(30)
    assert not t.is_alive() and [r.text for r in out[0]] == [
        expected_for_prompt(p, 3) for p in ("x", "y")]
    assert len(_unserved_notes(caplog, f"prefix '{prefix}'")) == 1  # said once, not every poll


def test_job_stream_of_a_cancelled_job_prints_what_is_known(env):
    """The summary line after a cancelled job's text: the tokens streamed before the cancel,
    its time to first token and total from the job's records, the prompt tokens said unknown
    (a cancel carries no usage) - never zeros that look measured."""
    import re

    url, prefix, c = env
    with worker_thread(FakeEngine(step_delay=0.02), url, prefix):
        job = c.submit("long one", max_tokens=2000)
        stream = job.stream(timeout=10)
        seen = "".join(next(stream).text for _ in range(5))
        job.cancel()
        seen += "".join(ev.text for ev in stream)
        st = genpool("job", "stream", job.id, "--redis", url, "--prefix", prefix)
    assert st.returncode == 0 and st.stdout == seen, st.stderr
    assert "0 prompt + 0 completion" not in st.stderr, st.stderr
    assert f"{len(seen)} completion tokens before the cancel" in st.stderr, st.stderr
    assert "prompt tokens unknown" in st.stderr, st.stderr
    ttft, total = map(float, re.search(r"ttft ([\d.]+) s, total ([\d.]+) s", st.stderr).groups())
    assert 0 < ttft <= total < 30, st.stderr
    queued = c.submit("never runs", max_tokens=4)  # cancelled before any worker took it
    queued.cancel()
    with worker_thread(FakeEngine(), url, prefix):
        st = genpool("job", "stream", queued.id, "--redis", url, "--prefix", prefix)
    assert st.returncode == 0 and st.stdout == "", st.stderr
    assert "cancelled before its first token" in st.stderr and "ttft" not in st.stderr, st.stderr


def test_status_leaves_cancelled_unread_jobs_out_of_queued(topology_url):
    """A job cancelled while queued stays in its lane until a worker reads (and drops) it: it
    will never run, so status counts it as cancelled, not queued; `jobs list` names it."""
    import re

    with client_env(topology_url, "ux") as (url, prefix, c):
        jobs = c.submit_many([{"prompt": f"p{i}", "max_tokens": 2} for i in range(3)])
        jobs[1].cancel()
        st = c.status()
        assert st["lanes"]["normal"] == {"queued": 2, "pending": 0}
        assert st["cancelled"] == {"high": 0, "normal": 1, "low": 0}
        out = genpool("status", "--redis", url, "--prefix", prefix)
        assert re.search(r"^normal\s+2\s+0\s+1$", out.stdout, re.M), out.stdout + out.stderr
        ls = genpool("jobs", "list", "--state", "cancelled", "--redis", url, "--prefix", prefix)
        assert [line.split()[0] for line in ls.stdout.splitlines()[1:]] == [jobs[1].id], ls.stderr


def test_status_and_jobs_list_survive_entries_with_refused_ids(env):
    """A hostile producer's raw XADD whose id the protocol refuses (a ':' could spell another
    job's keys, a brace move them out of their hash tag) waits in its lane until a worker
    dead-letters it. Meanwhile status and `jobs list` skip it, as they skip junk; `status`
    raised ValueError on it (found by the chaos SIGSTOP scenario, which reads status mid-run)."""
    import json

    url, prefix, c = env
    ok = c.submit("fine", max_tokens=2)
    for bad in ("bad-0:events", "x{y}", "", "z" * 129):
        c.redis.xadd(c.keys.jobs("normal"), {"job": json.dumps({"id": bad, "prompt": "x"})})
    assert c.status()["lanes"]["normal"] == {"queued": 5, "pending": 0}  # entries, as they are
    p = genpool("jobs", "list", "--redis", url, "--prefix", prefix)
    assert p.returncode == 0, p.stderr
    assert [line.split()[0] for line in p.stdout.splitlines()[1:]] == [ok.id]


def test_jobs_list_shows_the_ids_in_the_lanes(env):
    import json

    url, prefix, c = env
    conn = ["--redis", url, "--prefix", prefix]
    hi = c.submit("urgent", priority=-1, max_tokens=2)
    normal = [c.submit(f"n{i}", max_tokens=2) for i in range(3)]
    low = c.submit("bulk", priority=3, max_tokens=2)
    normal[1].cancel()
    c.redis.xadd(c.keys.jobs("normal"), {"job": b"\xff not json"})  # junk: skipped, no crash

    def listed(*args: str) -> list[tuple[str, str, str]]:
        p = genpool("jobs", "list", *args, *conn)
        assert p.returncode == 0, p.stderr
        return [tuple(line.split()[:3]) for line in p.stdout.splitlines()[1:]]  # header first

    assert listed() == [(hi.id, "high", "queued"), (normal[0].id, "normal", "queued"),
                        (normal[1].id, "normal", "cancelled"), (normal[2].id, "normal", "queued"),
                        (low.id, "low", "queued")]
    assert listed("--lane", "normal", "--state", "queued") == [
        (normal[0].id, "normal", "queued"), (normal[2].id, "normal", "queued")]
    short = genpool("jobs", "list", "--limit", "2", *conn)
    assert len(short.stdout.splitlines()) == 3 and "--limit" in short.stderr, short.stderr
    rows = [json.loads(x) for x in genpool("jobs", "list", "--json", "--lane", "low",
                                           *conn).stdout.splitlines()]
    assert [(r["id"], r["lane"], r["state"]) for r in rows] == [(low.id, "low", "queued")]
    with worker_thread(FakeEngine(step_delay=0.05), url, prefix) as w:
        long = c.submit("long", max_tokens=2000)
        for j in (hi, *normal, low):
            c.job(j.id).result(timeout=10, raise_on_error=False)
        next(long.stream(timeout=10))
        assert [r[0] for r in listed("--state", "running")] == [long.id]
        running = genpool("jobs", "list", "--state", "running", *conn).stdout
        assert w.name in running
        long.cancel()
        long.result(timeout=10)
    done = listed("--state", "done")
    assert sorted(r[0] for r in done) == sorted(j.id for j in (hi, normal[0], normal[2], low))
    assert sorted(r[0] for r in listed("--state", "cancelled")) == sorted([normal[1].id, long.id])
    bad = genpool("jobs", "list", "--state", "nonsense", *conn)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
