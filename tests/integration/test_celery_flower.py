"""Celery front door + Flower end to end: real Redis, Flower and genpool workers (tiny model).

Worker A is `genpool worker --celery` (the engine inside a real Celery worker: serves stream jobs
and `genpool.generate` tasks, answers remote control); worker B is a standalone `genpool worker
--celery-events`. Jobs go in through both front doors; Flower's API must list both workers and
every job with its final state, runtime and worker; the metrics of both workers must add up to the
tokens streamed; a SIGKILLed worker must show offline within 10 s.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

from genpool.producer import Client
from tests.pool_helpers import ROOT, drop_prefix, free_port, new_prefix, spawn_worker, wait_for
from tests.worker.test_metrics import scrape, value

pytest.importorskip("flower", reason="the worker extra (celery, flower) is not installed")
pytest.importorskip("prometheus_client")
ENV = {"OMP_WAIT_POLICY": "PASSIVE", "FLOWER_UNAUTHENTICATED_API": "true"}
FINAL = ("SUCCESS", "FAILURE", "REVOKED")


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def flower_up(base: str) -> bool:
    try:
        return urllib.request.urlopen(base + "/healthcheck", timeout=2).status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def stack(tiny_llama_long_path, redis_url, tmp_path_factory):
    from genpool.workers.integrations.celery_app import make_app

    logs = tmp_path_factory.mktemp("celery_flower")
    prefix = new_prefix("cf")
    names = {k: f"{k}-{prefix[-8:]}" for k in "ab"}
    ports = {k: free_port() for k in ("a", "b", "flower")}
    env = dict(os.environ, GENPOOL_REDIS_URL=redis_url, **ENV)
    base = f"http://127.0.0.1:{ports['flower']}"
    flower = subprocess.Popen(
        [sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app", "flower",
         f"--port={ports['flower']}", "--address=127.0.0.1"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=open(logs / "flower.log", "wb"))
    common = ("--num-threads", "1", "--heartbeat-s", "0.5", "--metrics-addr", "127.0.0.1",
              "--served-model-name", "tiny", "--claim-idle-ms", "60000")
    procs = {
        "a": spawn_worker(redis_url, prefix, tiny_llama_long_path, names["a"], *common, "--celery",
                          "--celery-queue", prefix, "--celery-concurrency", "8",
                          "--metrics-port", str(ports["a"]), env=ENV, log_path=logs / "a.log"),
        "b": spawn_worker(redis_url, prefix, tiny_llama_long_path, names["b"], *common,
                          "--celery-events", "--metrics-port", str(ports["b"]), env=ENV,
                          log_path=logs / "b.log"),
    }
    st = SimpleNamespace(prefix=prefix, url=redis_url, flower=base, procs=procs, ports=ports,
                         hosts={k: f"genpool@{v}" for k, v in names.items()}, logs=logs,
                         caller=make_app(redis_url, prefix), client=Client(redis_url, prefix))
    try:
        wait_for(lambda: flower_up(base), 60, 0.3, "Flower")
        wait_for(lambda: all(flower_status(st).get(h) for h in st.hosts.values()), 120, 0.5,
                 "both genpool workers online in Flower")
        yield st
    finally:
        _tear_down(st, (*procs.values(), flower), redis_url, prefix)


def _tear_down(st, procs, redis_url: str, prefix: str) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)
    # this run's Celery queue: its list and kombu's binding set (never FLUSHDB: shared DB)
    st.client.redis.delete(prefix, f"_kombu.binding.{prefix}")
    st.client.close()
    drop_prefix(redis_url, prefix)


def flower_status(st) -> dict:
    return get_json(st.flower + "/api/workers?status=1")


def job_stream(client: Client, job_id: str) -> tuple[str, list[int]]:
    text, ids = "", []
    for ev in client.job(job_id).stream(timeout=120):
        text, ids = text + ev.text, ids + ev.token_ids
    return text, ids


def first_token(client: Client, job_id: str) -> None:
    next(ev for ev in client.job(job_id).events(timeout=60) if ev.type == "token")


def delay_in_subprocess(st, **kwargs) -> dict:
    """`generate.delay(...)` the way calling code does: configuration from the environment."""
    code = ("import json, sys; from genpool.workers.integrations.celery_app import generate; "
            "r = generate.delay(**json.loads(sys.argv[1])); "
            "print(json.dumps(r.get(timeout=120)))")
    env = dict(os.environ, GENPOOL_REDIS_URL=st.url, GENPOOL_CELERY_QUEUE=st.prefix,
               )
    out = subprocess.run([sys.executable, "-P", "-c", code, json.dumps(kwargs)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def revoke_state(client: Client, r) -> str:
    """What a revoke wait ended in: the task's state and how its genpool job ended."""
    try:
        res = client.job(r.id).result(timeout=1, raise_on_error=False)
        end = res.error.code if res.error else res.finish_reason
    except Exception as e:  # noqa: BLE001 - only describing a failure
        end = repr(e)
    return f"Celery task {r.id} REVOKED (state {r.state}, its job ended with {end})"


def run_both_front_doors(st) -> SimpleNamespace:
    """Stream jobs (ok, unknown model, cancelled while running) and Celery tasks (send_task with
    prompt/chat/interactive lane, an invalid request, a revoke while running, delay()).
    Returns the expected Flower state per task uuid (= job id) and what readers streamed."""
    c, caller = st.client, st.caller
    stream_ok = [c.submit(f"Stream {i}: copper garden", max_tokens=4 + i, temperature=0.0)
                 for i in range(3)]
    stream_bad = c.submit("Unknown model", model="not-served")
    # the jobs cancelled/revoked while running must outlast a revoke's trip under load: 12000
    # tokens of the long-context tiny model take ~14 s alone (1500 once finished first in CI)
    stream_cancel = c.submit("Long", max_tokens=12000, ignore_eos=True, temperature=0.0)
    kw = [dict(prompt="Celery river", max_tokens=5, temperature=0.0),
          dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0),
          dict(prompt="Celery urgent", max_tokens=4, priority=-1, temperature=0.0)]
    celery_ok = [caller.send_task("genpool.generate", kwargs=k) for k in kw]
    celery_bad = caller.send_task("genpool.generate", kwargs=dict(prompt="x", max_tokens=0))
    celery_expired = caller.send_task("genpool.generate", kwargs=dict(
        prompt="Too late", deadline=time.time() - 1))
    celery_revoke = caller.send_task("genpool.generate", kwargs=dict(
        prompt="Long celery", max_tokens=12000, ignore_eos=True, temperature=0.0))
    first_token(c, stream_cancel.id)
    c.cancel(stream_cancel.id)
    first_token(c, celery_revoke.id)  # its job id is the task id: tokens stream there too
    caller.control.revoke(celery_revoke.id)
    delayed = delay_in_subprocess(st, prompt="Delayed lamp", max_tokens=3, temperature=0.0)

    ran = [j.id for j in stream_ok] + [r.id for r in celery_ok] + [
        stream_cancel.id, celery_revoke.id, delayed["job_id"]]
    out = SimpleNamespace(streamed={i: job_stream(c, i) for i in ran}, stream_ok=stream_ok,
                          celery_ok=celery_ok,
                          celery_other=[celery_bad, celery_revoke, celery_expired])
    for r in celery_ok:
        res = r.get(timeout=120)
        assert res["error"] is None and res["job_id"] == r.id
        assert (res["text"], res["token_ids"]) == out.streamed[r.id]
        assert res["usage"]["completion_tokens"] == len(res["token_ids"]) > 0
    assert delayed["text"] == out.streamed[delayed["job_id"]][0]
    with pytest.raises(Exception) as e:
        celery_bad.get(timeout=60)
    assert "max_tokens" in str(e.value) and celery_bad.state == "FAILURE"
    for r in (celery_revoke, celery_expired):
        wait_for(lambda: r.state == "REVOKED", 30, 0.2, lambda: revoke_state(c, r))
    assert c.job(stream_cancel.id).result(timeout=30).error.code == "cancelled"
    assert c.job(stream_bad.id).result(timeout=30, raise_on_error=False).error.code == "unknown_model"
    out.expect = {i: "SUCCESS" for i in ran}
    out.expect.update({stream_bad.id: "FAILURE", stream_cancel.id: "REVOKED",
                       celery_bad.id: "FAILURE", celery_revoke.id: "REVOKED",
                       celery_expired.id: "REVOKED"})
    return out


def test_both_front_doors_in_flower_and_metrics(stack):
    st, run = stack, run_both_front_doors(stack)
    tasks = wait_for(lambda: (t := get_json(st.flower + "/api/tasks")) and all(
        t.get(u, {}).get("state") in FINAL for u in run.expect) and t, 30, 0.5, "final states")
    for uuid, state in run.expect.items():
        task = tasks[uuid]
        assert task["state"] == state and task["worker"] in st.hosts.values(), task
        assert task["received"], task
        if state == "SUCCESS":
            assert task["runtime"] > 0 and task["started"], task
    for j in run.stream_ok:  # Flower names the genpool worker that actually ran the stream job
        assert tasks[j.id]["name"] == "genpool.stream"
        assert tasks[j.id]["worker"] == f"genpool@{j.result(timeout=30).worker}"
    for r in run.celery_ok + run.celery_other:  # the Celery worker ran the task body
        assert tasks[r.id]["name"] == "genpool.generate"
        assert tasks[r.id]["worker"] == st.hosts["a"]

    # Metrics of both workers: every token a reader saw was counted once, and nothing else
    m = [scrape(st.ports[k]) for k in "ab"]
    total = lambda name, **labels: sum(value(x, name, **labels) for x in m)  # noqa: E731
    assert total("genpool:generation_tokens_total") == \
        sum(len(ids) for _, ids in run.streamed.values())
    assert total("genpool:request_success_total") == \
        sum(s == "SUCCESS" for s in run.expect.values())
    assert total("genpool:request_failure_total", code="cancelled") == 2
    assert total("genpool:request_failure_total", code="unknown_model") == 1
    assert total("genpool:request_failure_total", code="expired") == 1


def test_remote_control_ping(stack):
    host = stack.hosts["a"]
    replies = stack.caller.control.ping(destination=[host], timeout=5)
    assert replies == [{host: {"ok": "pong"}}]


def test_killed_worker_goes_offline(stack):
    p = stack.procs["b"]
    p.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    p.wait(10)
    host = stack.hosts["b"]
    wait_for(lambda: flower_status(stack).get(host) is False, 10, 0.25,
             f"{host} offline in Flower")
    print(f"{host} offline in Flower {time.monotonic() - t0:.1f} s after SIGKILL")
    assert flower_status(stack)[stack.hosts["a"]] is True


def test_remote_shutdown_drains_and_exits(stack):
    host, p = stack.hosts["a"], stack.procs["a"]
    stack.caller.control.shutdown(destination=[host])
    assert p.wait(60) == 0
    wait_for(lambda: flower_status(stack).get(host) is False, 10, 0.25, f"{host} offline")
    log = (stack.logs / "a.log").read_text()
    assert "draining" in log and "stopped" in log


# -- a Celery job the genpool worker turns down (fake engine: what is tested is the reporting) --
@pytest.fixture
def fake_celery(redis_url, tmp_path):
    """Flower and one `genpool worker --celery` on the fake engine (serves model `fake`)."""
    from genpool.workers.integrations.celery_app import make_app

    prefix, port = new_prefix("cff"), free_port()
    name = f"f-{prefix[-8:]}"
    env = dict(os.environ, GENPOOL_REDIS_URL=redis_url, **ENV)
    flower = subprocess.Popen(
        [sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app",
         "flower", f"--port={port}", "--address=127.0.0.1"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "flower.log", "wb"))
    worker = spawn_worker(redis_url, prefix, "fake", name, "--engine-factory",
                          "tests.fake_engine:make", "--served-model-name", "fake", "--celery",
                          "--celery-queue", prefix, "--celery-concurrency", "4",
                          "--heartbeat-s", "0.5", env=ENV, log_path=tmp_path / "worker.log")
    st = SimpleNamespace(prefix=prefix, flower=f"http://127.0.0.1:{port}", host=f"genpool@{name}",
                         caller=make_app(redis_url, prefix), client=Client(redis_url, prefix))
    try:
        wait_for(lambda: flower_up(st.flower), 60, 0.3, "Flower")
        wait_for(lambda: flower_status(st).get(st.host), 120, 0.5, "the worker online in Flower")
        yield st
    finally:
        _tear_down(st, (worker, flower), redis_url, prefix)


def flower_failures(st) -> float:
    """Flower's count of task-failed events from this test's worker (its /metrics)."""
    with urllib.request.urlopen(st.flower + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flower_events_total{") and 'type="task-failed"' in line
               and f'worker="{st.host}"' in line)


def test_a_celery_job_the_worker_rejects_is_one_genpool_generate_failure(fake_celery):
    st = fake_celery
    r = st.caller.send_task("genpool.generate", kwargs=dict(prompt="x", model="not-served",
                                                            max_tokens=2))
    with pytest.raises(Exception) as e:
        r.get(timeout=60)
    assert "unknown_model" in str(e.value)
    wait_for(lambda: get_json(st.flower + "/api/tasks").get(r.id, {}).get("state") == "FAILURE"
             and flower_failures(st) >= 1, 30, 0.3, "the failure in Flower")
    time.sleep(2)  # a second report of the same failure would have arrived by now
    task = get_json(st.flower + "/api/tasks")[r.id]
    assert (task["name"], task["state"], task["worker"]) == ("genpool.generate", "FAILURE",
                                                             st.host), task
    assert flower_failures(st) == 1
