"""A Redis password never leaves a genpool process: not to an HTTP caller, a log, the terminal,
an exception's message, `genpool status` or the heartbeat. Real redis-server processes with
`requirepass` (one killed while a job waits on it), a real gateway, real CLIs and workers."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import redis

from genpool.producer import Client, QueueUnavailable
from genpool.schemas import Keys
from genpool.schemas.connection import parse, redact, redact_text
from tests.pool_helpers import drop_prefix, free_port, new_prefix, spawn_worker, stop_proc, wait_for, workers_alive
from tests.producer.test_ux import genpool

SECRET = "S3cretPassw0rd"
SENTINEL_SECRET = "Sent1nelS3cret"

# every URL form schemas/connection.py parses, with credentials, and what may be shown of it
FORMS = [
    (f"redis://:{SECRET}@127.0.0.1:6406/0", "redis://:***@127.0.0.1:6406/0"),
    (f"redis://alice:{SECRET}@127.0.0.1:6406/0", "redis://alice:***@127.0.0.1:6406/0"),
    (f"rediss://alice:{SECRET}@cache.example:6380/2", "rediss://alice:***@cache.example:6380/2"),
    (f"REDIS://:{SECRET}@h:1", "REDIS://:***@h:1"),
    (f"redis://{SECRET}@h:1/0", "redis://***@h:1/0"),  # a lone token may be the password
    ("redis://:p%40ss%3Aw0rd@h:1/0", "redis://:***@h:1/0"),  # percent-encoded
    (f"redis://:p@ss{SECRET}@h:1/0", "redis://:***@h:1/0"),  # a raw '@' in the password
    (f"redis://:a?b/{SECRET}#x@h:1/0", "redis://:***@h:1/0"),  # and '?', '/', '#'
    (f"unix://:{SECRET}@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
    (f"unix:///run/redis.sock?db=0&password={SECRET}", "unix:///run/redis.sock?db=0&password=***"),
    (f"redis://h:1/0?password={SECRET}&ssl_password={SECRET}",
     "redis://h:1/0?password=***&ssl_password=***"),
    (f"redis+sentinel://:{SECRET}@s1:26379,s2:26379/mymaster/0?sentinel_password="
     f"{SENTINEL_SECRET}", "redis+sentinel://:***@s1:26379,s2:26379/mymaster/0?sentinel_password=***"),
    (f"redis+cluster://alice:{SECRET}@n1:7000,n2:7001", "redis+cluster://alice:***@n1:7000,n2:7001"),
    (f"rediss+cluster://:{SECRET}@n1:7000", "rediss+cluster://:***@n1:7000"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing to hide: unchanged
    ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
]


@pytest.mark.parametrize("url,shown", FORMS)
def test_redact_hides_the_credentials_of_every_url_form(url, shown):
    assert redact(url) == shown
    assert redact(shown) == shown  # idempotent: a redacted URL can be redacted again
    t = parse(url)
    for secret in (t.password, t.sentinel_password, SECRET, SENTINEL_SECRET, "p@ss"):
        assert not secret or secret not in redact(url)
    if t.kind != "single":  # still says where it points
        assert parse(redact(url)).nodes == t.nodes


def test_redact_text_finds_every_url_in_a_message():
    text = (f"cannot reach Redis at redis://:{SECRET}@127.0.0.1:1/0 (refused); broker "
            f"sentinel://:{SECRET}@a:1/0;sentinel://:{SECRET}@b:2/0, see 'rediss://u:{SECRET}@c:3'")
    out = redact_text(text)
    assert SECRET not in out
    assert ("redis://:***@127.0.0.1:1/0 (refused); broker sentinel://:***@a:1/0;"
            "sentinel://:***@b:2/0, see 'rediss://u:***@c:3'") in out


@pytest.fixture
def password_redis(tmp_path):
    """A redis-server on a free port that requires SECRET; stop() kills it (for good)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--requirepass", SECRET, "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://:{SECRET}@127.0.0.1:{port}"  # the form (no /db: nothing else hides it)

    def pings() -> bool:
        try:
            return redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
        except redis.RedisError:
            return False

    def stop() -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    wait_for(pings, 10, what="redis-server with a password")
    yield url, port, stop
    stop()


def no_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text, text


def test_queue_unavailable_names_redis_without_its_password(password_redis, caplog):
    url, port, stop = password_redis
    err = QueueUnavailable(url, 31, redis.ConnectionError(f"gone: {url}"))
    no_secret(str(err), err.url, repr(err))
    assert f"127.0.0.1:{port}" in str(err)
    # the real thing: Redis goes away while a producer waits on a job
    c = Client(url, new_prefix("redact"), reconnect_s=1.5)
    job = c.submit("x", max_tokens=2)
    got: list = []
    t = threading.Thread(target=lambda: got.append(_raised(job.result)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="genpool.client"):
        t.start()
        time.sleep(0.3)
        stop()
        t.join(20)
    assert isinstance(got[0], QueueUnavailable), got
    no_secret(str(got[0]), *(r.getMessage() for r in caplog.records))
    assert f"redis://:***@127.0.0.1:{port}" in str(got[0])
    assert any("lost the connection to Redis" in r.getMessage() for r in caplog.records)


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


def test_gateway_503_and_its_log_hide_the_password(password_redis, caplog):
    """The issue's case: a gateway on a password URL, Redis down while a caller waits."""
    from genpool.producer.gateway import create_app
    from tests.producer.test_gateway import serve_in_thread

    url, port, stop = password_redis
    app = create_app(url, new_prefix("redact"), queue_without_workers=True)
    with caplog.at_level(logging.INFO), serve_in_thread(app) as base:
        app.state.gateway.client.reconnect_s = 1.5  # give up on Redis after 1.5 s, not 30
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(httpx.post(
            f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)))
        t.start()
        time.sleep(0.5)  # the job is queued; the request waits for its result
        stop()
        t.join(60)
        after = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=30)
    r = answer[0]
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable", r.text
    no_secret(r.text, after.text, *(rec.getMessage() for rec in caplog.records))


@pytest.mark.parametrize("cmd", [["status"], ["submit", "hi"], ["job", "show", "x"]])
def test_cli_error_line_hides_the_password(cmd):
    port = free_port()  # nothing listens there
    p = genpool(*cmd, "--redis", f"redis://:{SECRET}@127.0.0.1:{port}/0")
    assert p.returncode == 5, p.stderr
    no_secret(p.stdout, p.stderr)
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in p.stderr


def test_status_heartbeat_metrics_and_worker_logs_hide_the_password(password_redis, tmp_path):
    """A live worker (engine inside Celery, with /metrics) on a password URL."""
    url, _, _ = password_redis
    prefix, log, mport = new_prefix("redact"), tmp_path / "worker.log", free_port()
    proc = spawn_worker(url, prefix, "fake", "w-redact", "--engine-factory",
                        "tests.fake_engine:make", "--celery", "--celery-queue", prefix,
                        "--heartbeat-s", "0.5", "--metrics-port", str(mport), log_path=log)
    try:
        wait_for(lambda: workers_alive(url, prefix) or proc.poll() is not None, 60, what="worker")
        assert proc.poll() is None, log.read_text()[-3000:]
        wait_for(lambda: "ready" in log.read_text(), 30, what="the Celery worker ready")
        table = genpool("status", "--redis", url, "--prefix", prefix)
        as_json = genpool("status", "--json", "--redis", url, "--prefix", prefix)
        beat = redis.Redis.from_url(url).hget(Keys(prefix).workers, "w-redact").decode()
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10).text
        assert table.returncode == 0 and "w-redact" in table.stdout, table.stderr
        assert json.loads(as_json.stdout)["workers"][0]["name"] == "w-redact"
    finally:
        stop_proc(proc, 20)
        r = redis.Redis.from_url(url)
        r.delete(prefix)
        drop_prefix(url, prefix)
    text = log.read_text()
    no_secret(table.stdout, table.stderr, as_json.stdout, beat, metrics, text)
    assert "redis://:**@127.0.0.1" in text  # Celery's banner names its broker, masked
