"""Gateway connection hygiene (issue 28, item 11): bounds on open requests per client and in all,
a reader that stops reading is dropped and its job cancelled, and header / idle timeouts.

Real uvicorn servers (in a thread, with the config `genpool gateway` runs, or the CLI itself),
real sockets and httpx clients, real Redis and an in-process worker on the fake engine. Scaled
from the report (200 unread streams, 500 slowloris connections) to a handful of each. Clients
tell apart by source address: 127.0.0.2 and .3 are loopback addresses too.
"""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis

from tests.fake_engine import FakeEngine
from tests.pool_helpers import ROOT, drop_prefix, free_port, http_ok, new_prefix, stop_proc, wait_for, worker_thread


@contextlib.contextmanager
def serve(app, **timeouts):
    """uvicorn in a thread with the gateway's own config (its protocol and timeouts)."""
    import uvicorn

    from genpool.producer.gateway_http import server_config

    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="warning",
                                          **timeouts))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 30, what="gateway up")
        yield port
    finally:
        server.should_exit = True
        t.join(10)


def raw_post(port: int, body: dict, source: str = "127.0.0.1", rcvbuf: int = 0,
             path: str = "/v1/completions") -> socket.socket:
    """A request sent whole on a socket that nobody reads (unless a test does)."""
    s = socket.socket()
    if rcvbuf:  # before connect: the window it advertises stays this small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def status_of(s: socket.socket, timeout: float = 30) -> tuple[int, bytes]:
    """The response's status and its head, with its body when it has a Content-Length (a
    stream's body is left unread)."""
    s.settimeout(timeout)
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(4096) or b"\r\n\r\n"
    head, _, body = got.partition(b"\r\n\r\n")
    size = [int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"]
    while size and len(body) < size[0]:
        body += s.recv(4096) or b" " * size[0]
    return int(head.split()[1]), head + b"\r\n\r\n" + body


def stream_body(job_id: str, max_tokens: int) -> dict:
    return {"model": "fake", "prompt": f"unread {job_id}", "max_tokens": max_tokens,
            "stream": True}


def test_one_clients_unread_streams_cannot_starve_another_caller(redis_url):
    """A opens 6 streams it never reads on a 4-slot worker; B's short request must still run.
    Without a per-client bound A's jobs held every slot and B waited behind them."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwfair")
    app = create_app(redis_url, prefix, max_open_per_client=2)
    socks = []
    try:
        with worker_thread(FakeEngine(max_num_seqs=4, step_delay=0.05), redis_url, prefix), \
                serve(app) as port:
            socks = [raw_post(port, stream_body(f"a{i}", 2000)) for i in range(6)]
            got = sorted(status_of(s) for s in socks)
            assert [st for st, _ in got] == [200, 200, 429, 429, 429, 429], got
            assert all(b"too_many_open_requests" in head for st, head in got if st == 429), got
            t0 = time.monotonic()
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"),
                              timeout=15) as b:
                r = b.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": "fake", "prompt": "B's turn", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
            assert time.monotonic() - t0 < 10
            for s in socks:  # A hangs up: its jobs are cancelled before the worker stops
                s.close()
            wait_for(lambda: app.state.gateway.open.open == 0, 10, what="A's streams closed")
    finally:
        for s in socks:
            s.close()
        drop_prefix(redis_url, prefix)


def test_a_jobs_event_streams_count_against_the_open_request_bounds(redis_url):
    """GET /v1/jobs/{id}/events holds a Redis connection as a completion's stream does, so it
    counts against the per-client bound: one caller cannot open streams past it."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwevents")
    app = create_app(redis_url, prefix, max_open_per_client=1)
    try:
        with worker_thread(FakeEngine(max_num_seqs=2, step_delay=0.05), redis_url, prefix), \
                serve(app) as port, httpx.Client(timeout=30) as http:
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as other, \
                    other.stream("POST", f"{base}/v1/completions", json=stream_body("long", 5000)) as run:
                first = next(line for line in run.iter_lines() if line.startswith("data: "))
                events = f"{base}/v1/jobs/{json.loads(first[6:])['id'].split('-', 1)[1]}/events"
                with http.stream("GET", events) as held:  # the job runs on: this stream stays open
                    assert held.status_code == 200
                    second = http.get(events)
                    assert second.status_code == 429, second.text
                    assert second.json()["error"]["code"] == "too_many_open_requests"
            wait_for(lambda: app.state.gateway.open.open == 0, 10, what="both streams released")
    finally:
        drop_prefix(redis_url, prefix)


def test_total_open_requests_are_bounded(redis_url):
    """Past max_open every client gets 503 gateway_busy; closing one frees its place."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwtotal")
    app = create_app(redis_url, prefix, max_open=2, queue_without_workers=True)
    socks = []
    try:
        with serve(app) as port:  # no worker: each stream waits for its first event, open
            gw = app.state.gateway
            socks = [raw_post(port, stream_body(f"t{i}", 5), f"127.0.0.{i + 1}") for i in range(2)]
            wait_for(lambda: gw.open.open == 2, 10, what="two streams open")
            third = raw_post(port, stream_body("t2", 5), "127.0.0.3")
            st, head = status_of(third)
            third.close()
            assert st == 503 and b"gateway_busy" in head, head
            socks.pop().close()
            wait_for(lambda: gw.open.open == 1, 10, what="a closed stream gives its place back")
            socks.pop().close()
            wait_for(lambda: gw.open.open == 0, 10, what="all closed")
    finally:
        for s in socks:
            s.close()
        drop_prefix(redis_url, prefix)


def test_a_reader_that_stops_reading_is_dropped_and_its_job_cancelled(redis_url):
    """The job streams far more than the socket buffers hold; the client reads nothing. After
    send_timeout_s without progress the gateway drops the connection and cancels the job, and
    the client's place is free again. (8 KiB buffers, so the ~25 KB/s the fake worker streams
    here fill them in about a second; the default is 128 KiB.)"""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwstall")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    app = create_app(redis_url, prefix, max_open_per_client=1)

    def job_keys():
        return [k for k in r.scan_iter(f"{prefix}:job:*", count=1000) if not k.endswith(":events")]
    try:
        with worker_thread(FakeEngine(max_num_seqs=2, step_delay=0.0), redis_url, prefix), \
                serve(app, send_timeout_s=1.0, send_buffer_bytes=8192) as port:
            s = raw_post(port, stream_body("stall", 60000), rcvbuf=4096)  # minutes of tokens
            gw = app.state.gateway
            key = wait_for(job_keys, 10, what="job submitted")[0]
            t0 = time.monotonic()
            wait_for(lambda: gw.open.open == 0, 40, what="the stalled reader dropped")
            err = wait_for(lambda: r.hget(key, "error"), 20, what="job cancelled")
            took = time.monotonic() - t0
            s.close()
    finally:
        drop_prefix(redis_url, prefix)
    assert json.loads(err)["code"] == "cancelled", err
    assert took < 40, took


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed `s` (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


@pytest.fixture
def cli_gateway(redis_url, tmp_path):
    """`genpool gateway` with 1 s header and idle timeouts; no worker (nothing here needs one)."""
    prefix, port = new_prefix("gwloris"), free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway",
                             "--port", str(port), "--redis", redis_url, "--prefix", prefix,
                             "--header-timeout", "1", "--idle-timeout", "1",
                             "--no-worker-grace", "0.1", "--log-level", "warning"],
                            cwd=ROOT, stderr=open(tmp_path / "gateway.log", "wb"))
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health") or proc.poll() is not None,
                 60, what="gateway up")
        assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-2000:]
        yield port
    finally:
        stop_proc(proc, 10)
        drop_prefix(redis_url, prefix)


def test_slowloris_connections_are_closed_after_the_header_timeout(cli_gateway):
    port = cli_gateway
    quiet = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    trickle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    for s in trickle:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
    t0 = time.monotonic()
    for k in range(8):  # a header line every 0.4 s: each keeps the connection busy, never done
        time.sleep(0.4)
        for s in trickle:
            with contextlib.suppress(OSError):
                s.sendall(f"X-Trickle-{k}: 1\r\n".encode())
    closed = [closed_by_server(s) for s in quiet + trickle]
    for s in quiet + trickle:
        s.close()
    assert all(closed), f"{closed.count(False)} of 20 still open {time.monotonic() - t0:.1f} s on"
    assert http_ok(f"http://127.0.0.1:{port}/health")  # honest clients are served as before


def test_idle_keepalive_and_stalled_bodies_time_out(cli_gateway):
    port = cli_gateway
    sock = socket.create_connection(("127.0.0.1", port))  # keep-alive, then idle past 1 s
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert status_of(sock)[0] == 200
    # polled (a busy CI machine may close it late): 3.5 s is still well short of the 5 s
    # default idle timeout, and of the 10 s header timeout, that an ignored flag would leave
    t0 = time.monotonic()
    while not closed_by_server(sock):
        assert time.monotonic() - t0 < 3.5, "an idle keep-alive connection was kept"
        time.sleep(0.05)
    sock.close()
    body = b'{"prompt": "a body that stops'
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
              b"Content-Length: 200\r\n\r\n" + body)
    t0 = time.monotonic()
    st, resp = status_of(s, 10)
    assert st == 408 and b"request_timeout" in resp and b"connection: close" in resp.lower(), resp
    assert time.monotonic() - t0 < 5
    s.close()


def test_cli_defaults_are_the_modules_defaults():
    """`genpool gateway --help` must work without fastapi, so the CLI writes its defaults out."""
    import argparse

    from genpool.producer import gateway, gateway_http
    from genpool.producer.cli_bulk import register_gateway

    sub = argparse.ArgumentParser().add_subparsers()
    register_gateway(sub)
    a = sub.choices["gateway"].parse_args([])
    assert (a.max_open, a.max_open_per_client) == (gateway.MAX_OPEN, gateway.MAX_OPEN_PER_CLIENT)
    assert (a.header_timeout, a.idle_timeout, a.send_timeout) == (
        gateway_http.HEADER_TIMEOUT_S, gateway_http.IDLE_TIMEOUT_S, gateway_http.SEND_TIMEOUT_S)
    assert gateway.IDLE_TIMEOUT_S == gateway_http.IDLE_TIMEOUT_S
    assert a.no_worker_wait == gateway.NO_WORKER_WAIT_S
    from genpool.producer.cli_bulk import _batch_options
    from genpool.producer.openai_batches import BatchOptions
    assert _batch_options(a) == BatchOptions()


def test_a_request_whose_workers_all_left_ends_with_503_and_its_job_cancelled(redis_url):
    """The only worker stops mid-job (its job handed back to the queue): after no_worker_wait_s
    without a live worker for the model, a stream ends with a no_workers error chunk and a plain
    request answers 503, instead of both waiting, silent, until the client leaves."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwgone")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    app = create_app(redis_url, prefix, no_worker_wait_s=1.0)

    def jobs() -> list[str]:
        return [k for k in r.scan_iter(f"{prefix}:job:*", count=1000) if not k.endswith(":events")]

    def running() -> list[str]:
        return [k for k in jobs() if r.hget(k, "state") == "running"]
    try:
        with serve(app) as port:
            base = f"http://127.0.0.1:{port}/v1/completions"
            with worker_thread(FakeEngine(max_num_seqs=4, step_delay=0.05), redis_url, prefix,
                               drain_timeout_s=0.1) as w, httpx.Client(timeout=60) as http:
                answers: dict = {}
                plain = threading.Thread(target=lambda: answers.setdefault(
                    "plain", http.post(base, json={"model": "fake", "prompt": "p", "max_tokens": 5000})))
                plain.start()
                with http.stream("POST", base, json=stream_body("gone", 5000)) as resp:
                    lines = resp.iter_lines()
                    assert resp.status_code == 200 and next(lines).startswith("data: ")
                    wait_for(lambda: len(running()) == 2, 20, what="both jobs running")
                    t0 = time.monotonic()
                    w.stop(drain_timeout_s=0.1)
                    rest = [line for line in lines if line]
                took = time.monotonic() - t0
                plain.join(60)
            errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {\"error\"")]
            assert errors and errors[-1]["error"]["code"] == "no_workers", rest[-3:]
            assert took < 30, took
            assert answers["plain"].status_code == 503, answers["plain"].text
            assert answers["plain"].json()["error"]["code"] == "no_workers"
            assert "started but its worker left" in answers["plain"].json()["error"]["message"]
            assert "started but its worker left" in errors[-1]["error"]["message"]
            assert len(jobs()) == 2 and all(r.hget(k, "cancel") == "1" for k in jobs())  # for whoever claims them
    finally:
        r.close()
        drop_prefix(redis_url, prefix)
