"""File uploads (`POST /v1/files`) under hostile senders: a body that goes quiet gets 408, a
chunked body past the file limit is refused while it is still arriving (nothing spools it to disk
to the end), and uploads count against the open-request bounds as completions do.

Real uvicorn servers (in a thread with the gateway's config, or `genpool gateway` itself), real
sockets, real Redis. Clients tell apart by source address (127.0.0.2 and .3 are loopback too).
"""
from __future__ import annotations

import contextlib
import socket
import time

import httpx

from genpool.producer.openai_batches import BatchOptions
from tests.pool_helpers import drop_prefix, new_prefix, wait_for
from tests.producer.test_gateway_limits import cli_gateway, serve, status_of  # noqa: F401 (fixture)

BOUNDARY = "genpool-test-boundary"
PART_HEAD = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
             f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
             f"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()
LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        b'"body": {"model": "m", "prompt": "p"}}\n')


def start_upload(port: int, source: str = "127.0.0.1", length: int | None = 100_000) -> socket.socket:
    """An upload's head and the start of its file, the rest never sent (unless a test sends it).
    `length` None: a chunked body (no Content-Length to refuse it by)."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    head = (f"POST /v1/files HTTP/1.1\r\nHost: gw\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n")
    if length is None:
        s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunk(PART_HEAD + LINE))
    else:
        s.sendall(f"{head}Content-Length: {length}\r\n\r\n".encode() + PART_HEAD + LINE)
    return s


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def upload(http: httpx.Client, port: int) -> httpx.Response:
    return http.post(f"http://127.0.0.1:{port}/v1/files", data={"purpose": "batch"},
                     files={"file": ("in.jsonl", LINE)})


def test_a_stalled_upload_gets_408_and_its_connection_closed(cli_gateway):  # noqa: F811
    port = cli_gateway  # --idle-timeout 1
    s = start_upload(port)
    t0 = time.monotonic()
    st, resp = status_of(s, 10)
    s.close()
    assert st == 408 and b"request_timeout" in resp and b"connection: close" in resp.lower(), resp
    assert time.monotonic() - t0 < 5


def test_a_chunked_upload_past_the_limit_is_refused_before_it_ends(redis_url):
    from genpool.producer.gateway import create_app
    from genpool.producer.openai_files import FORM_SLACK

    prefix = new_prefix("gwupbig")
    app = create_app(redis_url, prefix, batch=BatchOptions(max_file_bytes=4096))
    try:
        with serve(app) as port:
            s = start_upload(port, length=None)
            filler = LINE * ((FORM_SLACK + 8192) // len(LINE))  # past file limit + framing slack
            with contextlib.suppress(OSError):  # the server may close as soon as it answers
                for k in range(0, len(filler), 8192):
                    s.sendall(chunk(filler[k:k + 8192]))
            st, resp = status_of(s, 10)  # the body never ends: only a refusal mid-body answers
            s.close()
            assert st == 413 and b"file_too_large" in resp, resp
    finally:
        drop_prefix(redis_url, prefix)


def test_uploads_count_against_the_open_request_bounds(redis_url):
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwupopen")
    app = create_app(redis_url, prefix, max_open_per_client=1)
    try:
        with serve(app) as port, \
                httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as same, \
                httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=30) as other:
            gw = app.state.gateway
            held = start_upload(port, "127.0.0.2")  # arriving slowly: it holds its client's place
            wait_for(lambda: gw.open.open == 1, 10, what="the slow upload counted")
            second = upload(same, port)
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "too_many_open_requests"
            assert upload(other, port).status_code == 200  # another client is not held up
            held.close()
            wait_for(lambda: gw.open.open == 0, 10, what="the dropped upload gives its place back")
            assert upload(same, port).status_code == 200
    finally:
        drop_prefix(redis_url, prefix)


def test_a_list_limit_in_other_digits_is_a_400(redis_url):
    """"²".isdigit() is True and int("²") raises: the listing was a 500."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwlimit")
    app = create_app(redis_url, prefix)
    try:
        with serve(app) as port, httpx.Client(timeout=30) as http:
            for path in ("/v1/files", "/v1/batches"):
                got = http.get(f"http://127.0.0.1:{port}{path}", params={"limit": "²"})
                assert got.status_code == 400 and got.json()["error"]["param"] == "limit", got.text
    finally:
        drop_prefix(redis_url, prefix)


def side_by_side(n: int, call) -> list[int]:
    """The status of `n` calls of call(http) made at once, each on its own connection."""
    import threading

    statuses, start = [], threading.Barrier(n)

    def one():
        with httpx.Client(timeout=60) as http:
            start.wait()
            statuses.append(call(http).status_code)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return sorted(statuses)


def test_concurrent_uploads_and_creates_keep_the_tenants_byte_limits(redis_url):
    """Each request checked the tenant's bytes, then wrote: requests side by side each saw the
    others' bytes not yet there, and all passed (the limits bound nothing against a loop of
    concurrent creates). Room for one file and one batch of it: of 8 at once, one passes."""
    from genpool.producer.gateway import create_app

    prefix = new_prefix("gwuprace")
    data = b"".join(LINE.replace(b'"custom_id": "a"', f'"custom_id": "c{i}"'.encode())
                    for i in range(200))
    size = len(data)
    app = create_app(redis_url, prefix, batch=BatchOptions(
        max_tenant_file_bytes=size + size // 2, max_active_bytes=size + size // 2, drive=False))
    try:
        with serve(app) as port:
            base = f"http://127.0.0.1:{port}"

            def put(http):
                return http.post(f"{base}/v1/files", data={"purpose": "batch"},
                                 files={"file": ("in.jsonl", data)})

            assert side_by_side(8, put) == [200] + [429] * 7
            with httpx.Client(timeout=30) as http:
                fid = http.get(f"{base}/v1/files").json()["data"][0]["id"]

            def create(http):
                return http.post(f"{base}/v1/batches", json={
                    "input_file_id": fid, "endpoint": "/v1/completions",
                    "completion_window": "24h"})

            assert side_by_side(8, create) == [200] + [429] * 7
    finally:
        drop_prefix(redis_url, prefix)
