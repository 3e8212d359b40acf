"""A client that hangs up takes its gateway work with it: no Redis reader left running for a
stream nobody reads, no ERROR traceback for a body cut short. A real uvicorn server in a thread
(the config `genpool gateway` runs), real Redis, httpx and raw sockets; no worker (the jobs stay
queued, so a reader would wait on them for ever)."""
from __future__ import annotations

import logging
import socket
import uuid

import httpx
import redis

from genpool.producer import Client
from tests.pool_helpers import drop_prefix, new_prefix, wait_for
from tests.producer.test_gateway_limits import serve


def blocked_readers(r: redis.Redis, name: str) -> int:
    """Connections named `name` blocked in a command (an XREAD BLOCK on a job's events)."""
    return sum(1 for cl in r.client_list() if cl.get("name") == name and "b" in cl["flags"])


def test_a_hung_up_event_stream_leaves_no_reader_behind(redis_url):
    from genpool.producer.gateway import create_app

    prefix, name = new_prefix("gwhang"), f"gwhang-{uuid.uuid4().hex[:8]}"
    app = create_app(f"{redis_url}?client_name={name}", prefix, queue_without_workers=True)
    r, c = redis.Redis.from_url(redis_url, decode_responses=True), Client(redis_url, prefix)
    try:
        job = c.submit("nobody serves this", max_tokens=2)
        with serve(app) as port, httpx.Client(timeout=30) as http:
            for _ in range(3):
                with http.stream("GET", f"http://127.0.0.1:{port}/v1/jobs/{job.id}/events") as s:
                    assert s.status_code == 200
                    wait_for(lambda: blocked_readers(r, name) >= 1, 10, what="its reader")
            # each reader's XREAD BLOCK lasts 5 s and then starts again while the task lives
            wait_for(lambda: blocked_readers(r, name) == 0, 12,
                     what="the hung-up streams' readers ended")
            assert app.state.gateway.open.open == 0
    finally:
        c.close()
        r.close()
        drop_prefix(redis_url, prefix)


def test_a_body_cut_short_is_no_server_error(redis_url, caplog):
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwcut")
    app = create_app(redis_url, prefix, queue_without_workers=True)
    try:
        with serve(app) as port, caplog.at_level(logging.INFO):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": \"fake\"")
            s.close()  # 985 bytes short
            with httpx.Client(timeout=10) as http:  # the server answers on: a later request
                wait_for(lambda: http.get(f"http://127.0.0.1:{port}/health").status_code == 200,
                         10, what="health")
            wait_for(lambda: app.state.gateway.open.open == 0, 10, what="request released")
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert not errors, [rec.getMessage() for rec in errors]
    finally:
        drop_prefix(redis_url, prefix)
