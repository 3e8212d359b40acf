"""What a newcomer sees: no silent waits, no tracebacks, failures that raise, per-job commands.

Real Redis (the test DB), real `genpool` processes for the CLI, the fake engine in a worker
thread where a worker is needed (the behaviour under test is the producer's, not the model's).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import redis

from genpool.producer import Client, JobFailed, NoWorkers, QueueUnavailable
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import ROOT, client_env, free_port, new_prefix, wait_for, worker_thread


@pytest.fixture
def env(redis_url):
    with client_env(redis_url, "ux") as e:
        yield e


def genpool(*args: str, stdin: str | None = None, timeout: float = 60, pre: str = "",
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`genpool ARGS` in a child process; `pre` is Python run first (e.g. hiding a module)."""
    code = f"{pre}\nimport sys\nfrom genpool.workers.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-P", "-c", code, *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


# -- silent waits ---------------------------------------------------------------------------------
def test_cli_submit_says_at_once_that_no_worker_serves_and_exits_4(env):
    url, prefix, _ = env
    t0 = time.monotonic()
    p = genpool("submit", "hi", "--redis", url, "--prefix", prefix, "--timeout", "3")
    assert p.returncode == 4, p.stderr
    assert f"no live worker serves prefix '{prefix}'" in p.stderr
    assert p.stderr.count("no live worker") == 2  # the notice at once, then the verdict
    assert "Traceback" not in p.stderr and time.monotonic() - t0 < 30


def test_cli_submit_names_the_model_nobody_serves(env):
    url, prefix, c = env
    eng = FakeEngine()
    with worker_thread(eng, url, prefix):  # serves "fake" only
        wait_for(lambda: c.job("x").serving_workers(), what="worker up")
        p = genpool("submit", "hi", "--model", "other", "--redis", url, "--prefix", prefix,
                    "--timeout", "2")
    # said at once; then the live worker turns the job down (unknown_model): exit 1, not a wait
    assert p.returncode == 1, p.stderr
    assert f"no live worker serves model 'other' on prefix '{prefix}'" in p.stderr
    assert "error (unknown_model)" in p.stderr


def test_result_and_stream_raise_no_workers(env):
    _, prefix, c = env
    job = c.submit("nobody home", max_tokens=3, model="fake")
    t0 = time.monotonic()
    with pytest.raises(NoWorkers) as e:
        job.result(timeout=1.5)
    assert "no live worker serves model 'fake'" in str(e.value) and e.value.job_id == job.id
    with pytest.raises(NoWorkers):  # the grace alone, without a timeout
        list(job.stream(no_worker_s=1.0))
    assert time.monotonic() - t0 < 10
    with pytest.raises(TimeoutError):  # NoWorkers is a TimeoutError: old handlers still work
        job.result(timeout=0.5)


def test_no_workers_not_raised_when_a_worker_serves(env):
    url, prefix, c = env
    with worker_thread(FakeEngine(step_delay=0.05), url, prefix):
        job = c.submit("slow", max_tokens=400)
        with pytest.raises(TimeoutError) as e:
            job.result(timeout=1.0)
        assert not isinstance(e.value, NoWorkers)
        job.cancel()


def test_redis_gone_mid_wait_is_reported(tmp_path, caplog):
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server binary")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        wait_for(lambda: _pings(url), timeout=10, what="redis-server up")
        c = Client(url, "ux", reconnect_s=1.5)
        job = c.submit("x", max_tokens=2)
        got: list = []

        def wait():
            try:
                job.result()
            except Exception as e:  # noqa: BLE001 - the test inspects it
                got.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        t.join(20)
        assert not t.is_alive(), "result() kept waiting on a Redis that is gone"
        assert isinstance(got[0], QueueUnavailable) and url in str(got[0])
        assert any("lost the connection to Redis" in r.message for r in caplog.records)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _pings(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
    except redis.RedisError:
        return False


# -- tracebacks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["submit", "hi"], ["status"], ["job", "show", "x"],
                                 ["dead", "list"]])
def test_unreachable_redis_is_one_line(cmd):
    url = f"redis://127.0.0.1:{free_port()}/0"
    p = genpool(*cmd, "--redis", url)
    assert p.returncode == 5, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert f"cannot reach Redis at {url}" in p.stderr and "GENPOOL_REDIS_URL" in p.stderr
    d = genpool("--debug", *cmd, "--redis", url)
    assert "Traceback" in d.stderr


def test_worker_with_a_wrong_model_is_one_line(redis_url):
    p = genpool("worker", "--model", "no-such-model", "--redis", redis_url,
                "--prefix", new_prefix("ux"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "unknown model 'no-such-model'" in p.stderr and "smollm2-135m" in p.stderr


@pytest.mark.parametrize("cmd,hidden,extra", [(["worker", "--model", "smollm2-135m"], "torch",
                                               "worker"),
                                              (["gateway"], "uvicorn", "gateway")])
def test_missing_extra_names_the_install(cmd, hidden, extra):
    pre = f"import sys; sys.modules[{hidden!r}] = None"  # as if the package were not installed
    p = genpool(*cmd, pre=pre)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"needs the `{extra}` extra" in p.stderr and f"pip install '.[{extra}]'" in p.stderr


# -- failures that look like success --------------------------------------------------------------
def test_failed_job_raises_job_failed(env):
    url, prefix, c = env
    with worker_thread(FakeEngine(), url, prefix):
        job = c.submit("x", max_tokens=3, model="nope")
        with pytest.raises(JobFailed) as e:
            list(job.stream(timeout=10))
        assert e.value.code == "unknown_model" and "nope" in e.value.message
        with pytest.raises(JobFailed) as e:
            c.job(job.id).result(timeout=10)
        assert e.value.code == "unknown_model" and e.value.job_id == job.id
        res = c.job(job.id).result(timeout=10, raise_on_error=False)
        assert res.error.code == "unknown_model" and res.finish_reason is None


def test_cancelled_result_keeps_the_streamed_text(env):
    url, prefix, c = env
    with worker_thread(FakeEngine(step_delay=0.02), url, prefix):
        job = c.submit("long one", max_tokens=2000)
        stream = job.stream(timeout=10)
        seen = "".join(next(stream).text for _ in range(5))
        job.cancel()
        seen += "".join(ev.text for ev in stream)  # ends normally: a cancel is no failure
        res = job.result()
        assert res.finish_reason == "cancelled" and res.text == seen and len(seen) >= 5
        assert expected_for_prompt("long one", 2000).startswith(seen)
        again = c.job(job.id).result(timeout=5)  # a fresh handle rebuilds it from the stream
        assert again.finish_reason == "cancelled" and again.text == seen
        assert again.token_ids == [ord(ch) for ch in seen]


# -- per-job and dead-letter commands -------------------------------------------------------------
def test_job_commands(env):
    url, prefix, c = env
    conn = ["--redis", url, "--prefix", prefix]
    with worker_thread(FakeEngine(), url, prefix):
        job = c.submit("hello", max_tokens=4)
        job.result(timeout=10)
        show = genpool("job", "show", job.id, *conn)
        assert show.returncode == 0 and "state             done" in show.stdout
        assert "worker" in show.stdout and "finish_reason     length" in show.stdout
        res = genpool("job", "result", job.id, *conn)
        assert res.returncode == 0 and res.stdout.strip() == expected_for_prompt("hello", 4)
        st = genpool("job", "stream", job.id, *conn)
        assert st.returncode == 0 and st.stdout == expected_for_prompt("hello", 4)
        bad = c.submit("x", model="nope")
        assert genpool("job", "result", bad.id, *conn, "--timeout", "10").returncode == 1
    queued = c.submit("later", max_tokens=4)
    show = genpool("job", "show", queued.id, *conn)
    assert "state             queued" in show.stdout and "no live worker" in show.stderr
    cancel = genpool("job", "cancel", queued.id, *conn)
    assert cancel.returncode == 0 and c.job(queued.id).info()["cancel"] == "1"
    missing = genpool("job", "show", "nope-nope", *conn)
    assert missing.returncode == 2 and "no job 'nope-nope'" in missing.stderr


def test_dead_commands(env):
    url, prefix, c = env
    conn = ["--redis", url, "--prefix", prefix]
    # a job delivered too often (max_deliveries=0 dead-letters it at once) and a junk entry
    job = c.submit("retry me", max_tokens=3)
    c.redis.xadd(c.keys.jobs("normal"), {"junk": "x"})
    with worker_thread(FakeEngine(), url, prefix, max_deliveries=0):
        wait_for(lambda: c.redis.xlen(c.keys.dead) == 2, what="two dead letters")
    with pytest.raises(JobFailed):
        job.result(timeout=5)
    ls = genpool("dead", "list", *conn)
    assert ls.returncode == 0 and f"job={job.id}" in ls.stdout and "2 shown of 2" in ls.stderr
    retry = genpool("dead", "retry", "--all", *conn)
    assert retry.returncode == 1  # the junk entry cannot be retried, and that is said
    assert f"job {job.id} queued again" in retry.stdout and "not a valid job" in retry.stderr
    with worker_thread(FakeEngine(), url, prefix):
        assert c.job(job.id).result(timeout=10).text == expected_for_prompt("retry me", 3)
    assert genpool("dead", "purge", "--all", *conn).returncode == 0
    assert c.redis.xlen(c.keys.dead) == 0
    assert genpool("dead", "purge", *conn).returncode == 2  # neither ids nor --all


# -- gateway: no silent waits, one model entry ----------------------------------------------------
def _gateway(url, prefix, **kw):
    from genpool.producer.gateway import create_app
    from tests.producer.test_gateway import serve_in_thread

    return serve_in_thread(create_app(url, prefix, **kw))


def test_gateway_answers_503_no_workers_after_the_grace(env):
    import httpx

    url, prefix, c = env
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with _gateway(url, prefix, no_worker_grace_s=1.0) as base:
        t0 = time.monotonic()
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        waited = time.monotonic() - t0
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text
    assert "no live worker serves model 'fake'" in r.json()["error"]["message"]
    assert 1.0 <= waited < 10
    assert c.status()["lanes"]["high"]["queued"] == 0  # refused before anything was enqueued


def test_gateway_queues_without_workers_when_asked(env):
    import httpx

    url, prefix, c = env
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    with _gateway(url, prefix, no_worker_grace_s=0.5, queue_without_workers=True) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=2)
        st = c.status()  # enqueued, not refused (and cancelled once the client left: not queued)
        assert st["lanes"]["high"]["queued"] + st["cancelled"]["high"] == 1, st
        # the client left: the gateway cancels the queued job (a worker will skip it)
        wait_for(lambda: [k for k in c.redis.scan_iter(f"{prefix}:job:*")
                          if not k.endswith(":events") and c.redis.hget(k, "cancel") == "1"],
                 what="the job cancelled")


def test_gateway_lists_one_model_with_aliases(env):
    import httpx
    import openai

    url, prefix, c = env
    with worker_thread(FakeEngine(), url, prefix, served_models=frozenset({"fake", "fk", "f2"}),
                       model_name="fake"), _gateway(url, prefix) as base:
        wait_for(lambda: c.job("x").serving_workers(), what="worker up")
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [(m["id"], m["aliases"]) for m in models] == [("fake", ["f2", "fk"])]
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        assert oa.models.retrieve("fk").id == "fake"
        out = oa.completions.create(model="fk", prompt="hey", max_tokens=3, temperature=0)
        assert out.choices[0].text == expected_for_prompt("hey", 3)


# -- batch: every line accounted for --------------------------------------------------------------
def test_batch_errors_out_accounts_for_every_line(env, tmp_path):
    import json

    url, prefix, c = env
    good = {"custom_id": "ok", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hey", "max_tokens": 3}}
    lines = [json.dumps(good), "{not json",
             json.dumps({**good, "custom_id": "badparam",
                         "body": {"prompt": "x", "temperature": -3}}),
             json.dumps({**good, "custom_id": "nomodel", "body": {"prompt": "x", "model": "nope"}}),
             json.dumps({"method": "POST"})]
    inp, out, errs = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    args = ["batch", str(inp), "-o", str(out), "--errors-out", str(errs), "--no-progress",
            "--redis", url, "--prefix", prefix]
    with worker_thread(FakeEngine(), url, prefix):
        p = genpool(*args)
        assert p.returncode == 1, p.stderr
        again = genpool(*args)  # a rerun adds nothing: every line is already accounted for,
    assert again.returncode == 1, again.stderr  # but four of them still have no success
    assert "4 of them failed" in again.stderr, again.stderr
    ok = [json.loads(x) for x in out.read_text().splitlines()]
    bad = [json.loads(x) for x in errs.read_text().splitlines()]
    assert [o["custom_id"] for o in ok] == ["ok"]
    assert sorted((b["custom_id"] or "", b["line"]) for b in bad) == [
        ("", 2), ("", 5), ("badparam", 3), ("nomodel", 4)]
    assert {b["error"]["code"] for b in bad} == {"invalid_line", "invalid_request",
                                                 "unknown_model"}
