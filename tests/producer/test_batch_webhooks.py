"""Signed batch webhooks: a real gateway POSTs OpenAI's event, signed as OpenAI signs them, to a
receiver in this process; failed tries are retried with backoff, every try carries the same
event id, and after the last try the event is dead-lettered."""
from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from genpool.schemas import Keys
from genpool.schemas.connection import connect
from tests.batch_api_helpers import Gateway, fake_worker, jsonl, line, wait_done
from tests.pool_helpers import drop_prefix, new_prefix, stop_proc, wait_for, workers_alive

KEY_BYTES = b"batch-webhook-test-key-32-bytes!"
SECRET = "whsec_" + base64.b64encode(KEY_BYTES).decode()


class Receiver:
    """Records every POST; answers 500 to the first `fail` of them (all: fail=None)."""

    def __init__(self, fail):
        self.fail, self.got = fail, []
        self.hang_s = 0.0  # how long it takes before it answers
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"])).decode()
                receiver.got.append((dict(self.headers), body))
                time.sleep(receiver.hang_s)
                bad = receiver.fail is None or len(receiver.got) <= receiver.fail
                self.send_response(500 if bad else 200)
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hooked(redis_url, tmp_path, request):
    prefix = new_prefix("bhook")
    receiver = Receiver(request.param)
    worker = fake_worker(redis_url, prefix, tmp_path, "w")
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--batch-window", "600",
                 "--batch-webhook", receiver.url, "--batch-webhook-tries", "3",
                 "--batch-webhook-backoff", "0.2", env={"GENPOOL_WEBHOOK_SECRET": SECRET})
    try:
        gw.start()
        wait_for(lambda: workers_alive(redis_url, prefix), 60, what="worker up")
        yield gw, receiver, redis_url, prefix
    finally:
        gw.stop()
        stop_proc(worker)
        receiver.close()
        drop_prefix(redis_url, prefix)


def run_batch(gw: Gateway, cancel: bool = False):
    c = gw.client()
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("a", "p a")]))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    if cancel:
        c.batches.cancel(b.id)
    return wait_done(c, b.id)


def verify(headers: dict, body: str) -> None:
    mac = hmac.new(KEY_BYTES, f"{headers['webhook-id']}.{headers['webhook-timestamp']}.{body}"
                   .encode(), hashlib.sha256)
    assert headers["webhook-signature"] == "v1," + base64.b64encode(mac.digest()).decode()


@pytest.mark.parametrize("hooked", [2], indirect=True)
def test_the_end_event_is_signed_and_retried_until_delivered(hooked):
    gw, receiver, _, _ = hooked
    done = run_batch(gw)
    wait_for(lambda: len(receiver.got) >= 3, 30, what="three tries")
    time.sleep(1.0)  # nothing more once one try was answered 200
    assert len(receiver.got) == 3
    assert len({h["webhook-id"] for h, _ in receiver.got}) == 1
    for headers, body in receiver.got:
        verify(headers, body)
        event = json.loads(body)
        assert (event["object"], event["type"], event["data"]) == (
            "event", "batch.completed", {"id": done.id})
        assert event["id"] == headers["webhook-id"] and event["created_at"] == done.completed_at


@pytest.mark.parametrize("hooked", [0], indirect=True)
def test_a_cancelled_batch_says_so(hooked):
    gw, receiver, _, _ = hooked
    done = run_batch(gw, cancel=True)
    assert done.status == "cancelled"
    wait_for(lambda: receiver.got, 30, what="the event")
    assert json.loads(receiver.got[0][1])["type"] == "batch.cancelled"


@pytest.mark.parametrize("hooked", [None], indirect=True)
def test_an_event_that_keeps_failing_is_dead_lettered(hooked):
    gw, receiver, url, prefix = hooked
    done = run_batch(gw)
    r = connect(url, decode_responses=True)
    try:
        wait_for(lambda: r.zscore(Keys(prefix).webhooks_dead, done.id) is not None, 30,
                 what="the event dead-lettered")
        time.sleep(1.0)
        assert len(receiver.got) == 3  # --batch-webhook-tries 3, then no more
    finally:
        r.close()


@pytest.mark.parametrize("hooked", [0], indirect=True)
def test_a_receiver_that_hangs_holds_up_no_batch(hooked):
    """Events were sent inline in the driver's pass, one after another, each waiting up to the
    webhook timeout (10 s): a hung receiver stopped every batch of the gateway meanwhile."""
    gw, receiver, _, _ = hooked
    receiver.hang_s = 12.0
    assert run_batch(gw).status == "completed"
    wait_for(lambda: receiver.got, 30, what="the first event's try")
    t0 = time.monotonic()
    assert run_batch(gw).status == "completed"  # while the first event's try hangs
    took = time.monotonic() - t0
    assert took < 6, f"the second batch took {took:.1f} s behind the hung webhook"
