"""WorkerInfo (schemas/workers.py): the heartbeat document parsed as untrusted input, and the
readers that skip a document that does not parse instead of failing (status, liveness)."""
from __future__ import annotations

import json
import time

import pytest

from genpool.producer import Client
from genpool.producer.liveness import live_workers, serving
from genpool.producer.status import format_status
from genpool.schemas.workers import WorkerInfo, parse_worker_info
from tests.pool_helpers import drop_prefix, new_prefix

GOOD = {"model": "m,alias", "model_name": "m", "pid": 12, "host": "h", "running": 2,
        "state": "running", "steps": 40, "done": 3, "failed": 1, "reconnects": 0, "lost": 0,
        "busy_s": 1.5, "engine_s": 1, "stall_max_s": 0.25, "routed_affinity": 4, "routed_load": 1,
        "routed_fallback": 0, "handed_off": 2, "handed_in": 0, "backlog": 0,
        "prefix_hit_rate": 0.5, "prefix_routing": True, "name": "w1", "started": 1.7e9,
        "beat": 1.7e9 + 5, "ttl_s": 7, "from_a_newer_worker": [1, 2]}


def test_a_good_document_parses_with_its_types():
    info, why = parse_worker_info(json.dumps(GOOD))
    assert why == "" and isinstance(info, WorkerInfo)
    assert (info.running, info.engine_s, info.prefix_hit_rate, info.beat) == (2, 1.0, 0.5, 1.7e9 + 5)
    assert info.served_names() == {"m", "alias"} and info.serves("alias") and info.serves(None)
    assert not info.serves("other")
    assert parse_worker_info(json.dumps(GOOD).encode())[0] == info  # bytes from a raw client
    assert parse_worker_info(GOOD)[0] == info  # a dict, as the worker builds it


def test_missing_fields_take_defaults_and_the_hash_field_names_it():
    info, why = parse_worker_info('{"model": "m"}', name="from-the-hash")
    assert why == "" and info.name == "from-the-hash" and info.running == 0
    assert info.routed_affinity is None and info.state == "running"  # no router status published
    assert parse_worker_info('{"state": "draining", "model": "m"}')[0].serves("m") is False


@pytest.mark.parametrize("raw, words", [
    (None, "no worker document"),
    ("not json {", "not a JSON document"),
    (b"\xff\xfe", "not a JSON document"),
    ("[1, 2]", "not a JSON object"),
    ('"a string"', "not a JSON object"),
    ('{"running": "2"}', "running"),  # strict: "2" is not 2
    ('{"running": -1}', "running"),
    ('{"busy_s": NaN}', "busy_s"),
    ('{"model": 5}', "model"),
    ('{"prefix_hit_rate": 3}', "prefix_hit_rate"),
    ('{"prefix_routing": "yes"}', "prefix_routing"),
])
def test_junk_and_wrong_types_are_refused_with_the_reason(raw, words):
    info, why = parse_worker_info(raw)
    assert info is None and words in why


@pytest.fixture
def client(redis_url):
    prefix = new_prefix("winfo")
    c = Client(redis_url, prefix)
    yield c
    c.close()
    drop_prefix(redis_url, prefix)


def publish(c: Client, name: str, doc: str) -> None:
    c.redis.set(c.keys.worker(name), doc, ex=30)
    c.redis.hset(c.keys.workers, name, doc)
    c.redis.expire(c.keys.workers, 60)


def test_status_and_liveness_skip_an_unreadable_document(client):
    publish(client, "good", json.dumps({**GOOD, "beat": time.time()}))
    publish(client, "junk", '{"running": "lots"}')
    publish(client, "garbage", "\x00 not json")
    st = client.status()
    assert [w["name"] for w in st["workers"]] == ["good"] and st["workers"][0]["alive"]
    assert {w["name"] for w in st["unreadable_workers"]} == {"junk", "garbage"}
    text = format_status(st)
    assert "junk" in text and "unreadable" in text and "running" in text
    assert "prefix_hit=50%" in text
    live = live_workers(client.redis, client.keys)
    assert [w.name for w in live] == ["good"] and [w.name for w in serving(live, "m")] == ["good"]
    assert client.job("x", model="alias").serving_workers()[0].model_name == "m"


def test_the_registry_of_killed_workers_expires_on_its_own(client):
    """A worker killed without its goodbye leaves its entry until a peer prunes it (after
    WORKER_STALE_S): with no peer left, the registry stayed for ever (a key with no TTL)."""
    from genpool.schemas.keys import WORKER_STALE_S
    from genpool.workers.heartbeat import Heartbeat

    hb = Heartbeat(client.redis, client.keys, "killed", interval_s=1.0)
    hb.beat(WorkerInfo.model_validate({**GOOD, "name": "killed"}))
    assert client.redis.hexists(client.keys.workers, "killed")  # (never says goodbye)
    assert 0 < client.redis.ttl(client.keys.workers) <= WORKER_STALE_S
