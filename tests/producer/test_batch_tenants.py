"""Files and batches belong to the tenant of the key that made them: another tenant's key finds
none of them (404, as for an id that does not exist), and a batch's jobs run as its tenant's.
A gateway with stored keys (issue 31), a fake-engine worker, the official client."""
from __future__ import annotations

import http.client
import io
import time

import openai
import pytest

from genpool.producer.batch_lines import line_job_id
from genpool.producer.keys_store import KeyStore
from genpool.producer.openai_files import FORM_SLACK
from genpool.schemas import Keys
from genpool.schemas.connection import connect
from tests.batch_api_helpers import Gateway, fake_worker, jsonl, line, wait_done
from tests.pool_helpers import drop_prefix, new_prefix, stop_proc, wait_for, workers_alive


@pytest.fixture
def tenants(redis_url, tmp_path):
    prefix = new_prefix("btenant")
    r = connect(redis_url, decode_responses=True)
    store = KeyStore(r, Keys(prefix))
    key_a, _ = store.create("team-a", [], 1)
    key_b, _ = store.create("team-b", [], 1)
    key_c, _ = store.create("team-c", ["some-other-model"], 1)
    worker = fake_worker(redis_url, prefix, tmp_path, "w")
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--stored-keys", "--batch-window", "600")
    try:
        gw.start()
        wait_for(lambda: workers_alive(redis_url, prefix), 60, what="worker up")
        yield gw, key_a, key_b, r, prefix, key_c
    finally:
        gw.stop()
        stop_proc(worker)
        r.close()
        drop_prefix(redis_url, prefix)


@pytest.fixture
def narrow(redis_url, tmp_path):
    """Two tenants, a slow worker (2 slots) and a gateway that keeps 4 lines of a batch in
    flight: a batch of 60 lines has most of them still to submit for seconds."""
    prefix = new_prefix("bnarrow")
    r = connect(redis_url, decode_responses=True)
    store = KeyStore(r, Keys(prefix))
    key_a, _ = store.create("team-a", [], 1)
    key_b, _ = store.create("team-b", [], 1)
    worker = fake_worker(redis_url, prefix, tmp_path, "w", step_delay=0.02, seqs=2)
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--stored-keys", "--batch-window", "600",
                 "--batch-in-flight", "4")
    try:
        gw.start()
        wait_for(lambda: workers_alive(redis_url, prefix), 60, what="worker up")
        yield gw, key_a, key_b, r, prefix
    finally:
        gw.stop()
        stop_proc(worker)
        r.close()
        drop_prefix(redis_url, prefix)


def two_tenants(redis_url: str, name: str):
    """A new prefix, a connection and stored keys of tenants team-a and team-b."""
    prefix = new_prefix(name)
    r = connect(redis_url, decode_responses=True)
    store = KeyStore(r, Keys(prefix))
    return prefix, r, store.create("team-a", [], 1)[0], store.create("team-b", [], 1)[0]


def as_key(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.base}/v1", api_key=key, max_retries=0)


def test_another_tenants_files_and_batches_are_not_found(tenants):
    gw, key_a, key_b, r, prefix, _ = tenants
    a, b = as_key(gw, key_a), as_key(gw, key_b)
    f = a.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("x", "p x"), line("y", "p y")]))),
                       purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                             completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.files.delete(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [x.id for x in b.files.list()] == [] and [x.id for x in b.batches.list()] == []
    assert [x.id for x in a.batches.list()] == [batch.id]
    done = wait_done(a, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    assert len(a.files.content(done.output_file_id).text.splitlines()) == 2
    keys = Keys(prefix)
    assert r.hget(keys.job(line_job_id(batch.id, "x")), "tenant") == "team-a"
    with pytest.raises(openai.AuthenticationError):
        as_key(gw, "sk-nope").files.list()


def test_a_keys_models_bind_its_batch_lines(tenants):
    """A key limited to other models: its batch's lines for this pool's model fail alone, as its
    single requests would (model_not_found)."""
    gw, *_, key_c = tenants
    c = as_key(gw, key_c)
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl([line("x", "p x")]))), purpose="batch")
    done = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                         completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.failed == 1
    (err,) = [x for x in c.files.content(done.error_file_id).text.splitlines()]
    assert '"model_not_found"' in err


def test_one_tenants_batch_does_not_hold_back_anothers(narrow):
    """Tenant b's batch, created while tenant a's 40-line batch runs (same window, so it ends
    later), is fed beside it: deadline order across tenants held b's lines back until every one
    of a's had been submitted. Judged by when the lines were submitted (what the driver
    decides); which runs first then is fair pull's (turns of FAIR_QUANTUM tokens)."""
    gw, key_a, key_b, r, prefix = narrow
    a, b = as_key(gw, key_a), as_key(gw, key_b)

    def batch(c: openai.OpenAI, tag: str, n: int):
        f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(
            [line(f"{tag}{i}", f"{tag} {i}", max_tokens=20) for i in range(n)]))), purpose="batch")
        return c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                completion_window="24h")
    first = batch(a, "a", 40)
    wait_for(lambda: a.batches.retrieve(first.id).status == "in_progress", 30,
             what="a's batch running")
    time.sleep(1.1)  # windows end on whole seconds: b's must end after a's
    second = batch(b, "b", 4)
    assert second.expires_at > first.expires_at
    assert wait_done(b, second.id, 120).status == "completed"
    assert wait_done(a, first.id, 120).request_counts.completed == 40
    keys = Keys(prefix)

    def submitted(bt, custom_id: str) -> float:
        return float(r.hget(keys.job(line_job_id(bt.id, custom_id)), "submitted_at"))
    b_last = max(submitted(second, f"b{i}") for i in range(4))
    a_after = sum(submitted(first, f"a{i}") > b_last for i in range(40))
    assert a_after >= 15, a_after  # deadline order: 0 (b went after a's last submission)


def test_a_tenants_unended_batches_are_bounded_in_bytes(redis_url, tmp_path):
    """Each batch copies its file's lines into Redis: one file and a loop of creates would fill
    it. Past --batch-max-active-bytes a tenant's create is a 429; another tenant's is not held."""
    prefix, r, key_a, key_b = two_tenants(redis_url, "bbytes")
    data = jsonl([line(f"x{i}", f"p {i}") for i in range(10)])
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--stored-keys",
                 "--batch-max-active-bytes", str(2 * len(data) + 10))
    try:
        gw.start()  # no worker: the batches stay unended
        a, b = as_key(gw, key_a), as_key(gw, key_b)

        def create(c: openai.OpenAI):
            f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
            return c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                    completion_window="24h")
        create(a), create(a)
        with pytest.raises(openai.RateLimitError) as e:
            create(a)
        assert e.value.code == "batch_limit_exceeded", e.value
        assert create(b).status in ("validating", "in_progress")
    finally:
        gw.stop()
        r.close()
        drop_prefix(redis_url, prefix)


def test_a_tenants_uploaded_files_are_bounded_in_bytes(redis_url, tmp_path):
    """Files are kept in Redis for 30 days: a loop of uploads would fill it. Past
    --files-max-bytes a tenant's upload is a 429 (before its body is read when it says its
    length); deleting a file frees its bytes, and another tenant's uploads are not held."""
    prefix, r, key_a, key_b = two_tenants(redis_url, "fbytes")
    data = jsonl([line(f"x{i}", f"p {i}") for i in range(10)])
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--stored-keys", "--no-batch-driver",
                 "--files-max-bytes", str(2 * len(data) + 10))
    try:
        gw.start()
        a, b = as_key(gw, key_a), as_key(gw, key_b)

        def upload(c: openai.OpenAI):
            return c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        first, _ = upload(a), upload(a)
        with pytest.raises(openai.RateLimitError) as e:
            upload(a)
        assert e.value.code == "file_storage_limit_exceeded", e.value
        # a body that says it is over the room left, and never comes: refused at once (the
        # gateway would wait --idle-timeout, 5 s, for a body it reads, then answer 408)
        host, port = gw.base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=3)
        try:
            conn.putrequest("POST", "/v1/files")
            conn.putheader("Authorization", f"Bearer {key_a}")
            conn.putheader("Content-Type", "multipart/form-data; boundary=x")
            conn.putheader("Content-Length", str(FORM_SLACK + 100))
            conn.endheaders()
            assert conn.getresponse().status == 429
        finally:
            conn.close()
        assert upload(b).bytes == len(data)
        a.files.delete(first.id)
        assert upload(a).bytes == len(data)
    finally:
        gw.stop()
        r.close()
        drop_prefix(redis_url, prefix)
