"""Secure by default: what a hostile HTTP caller can and cannot do to the gateway, and where the
monitoring endpoints listen. A real `genpool gateway` process and a real Flower; no worker is
needed, since every case here is refused before a job is enqueued."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis

from genpool.producer.openai_format import scrub_paths
from genpool.schemas import Keys
from tests.pool_helpers import ROOT, drop_prefix, free_port, http_ok, new_prefix, stop_proc, wait_for

KEY = "sk-secure-test"
AUTH = {"Authorization": f"Bearer {KEY}"}




@pytest.fixture(scope="module")
def gateway(redis_url, tmp_path_factory):
    prefix, port = new_prefix("sec"), free_port()
    log = tmp_path_factory.mktemp("sec") / "gateway.log"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "genpool.workers.cli.main", "gateway", "--port", str(port),
                             "--redis", redis_url, "--prefix", prefix, "--api-key", KEY,
                             "--priority", "-1", "--log-level", "warning"], cwd=ROOT,
                            stderr=open(log, "wb"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{base}/health") or proc.poll() is not None, 60, what="gateway")
        yield base, prefix
    finally:
        stop_proc(proc, 10)
        drop_prefix(redis_url, prefix)


def openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_only_json_bodies_are_accepted(gateway):
    base, _ = gateway
    body = json.dumps({"model": "m", "prompt": "hi"})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        r = httpx.post(f"{base}/v1/completions", content=body,
                       headers={**AUTH, "Content-Type": ctype})
        assert openai_error(r, 415)["code"] == "unsupported_media_type"


def test_oversized_and_deeply_nested_json_get_openai_400s(gateway):
    base, _ = gateway
    big = json.dumps({"prompt": "x" * (9 << 20)})
    r = httpx.post(f"{base}/v1/completions", content=big,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert openai_error(r, 400)["code"] == "body_too_large"
    deep = "[" * 100_000 + "]" * 100_000
    r = httpx.post(f"{base}/v1/completions", content=deep,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert "nested too deeply" in openai_error(r, 400)["message"]


def test_callers_cannot_jump_the_priority_ceiling(gateway):
    base, prefix = gateway
    r = httpx.post(f"{base}/v1/completions", headers=AUTH,
                   json={"prompt": "me first", "max_tokens": 2, "priority": -9})
    err = openai_error(r, 400)
    assert err["param"] == "priority" and "-1" in err["message"]


def test_poisoned_sampling_parameters_are_a_400(gateway):
    base, _ = gateway
    for extra in ({"repetition_penalty": 1e-45}, {"stop_token_ids": [-1]},
                  {"stop": ["x" * 5000]}):
        r = httpx.post(f"{base}/v1/completions", headers=AUTH,
                       json={"prompt": "Tell me a joke", "max_tokens": 8, **extra})
        assert openai_error(r, 400)["code"] == "invalid_value", extra


def test_models_never_show_filesystem_paths(gateway, redis_url):
    base, prefix = gateway
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    doc = json.dumps({"model": "/home/ops/.cache/genpool/models/smol,smol", "started": 1})
    keys = Keys(prefix)
    r.hset(keys.workers, "w1", doc)
    r.set(keys.worker("w1"), doc, ex=60)
    ids = [m["id"] for m in httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"]]
    assert ids == ["smol"]
    assert scrub_paths("model /srv/models/x is not served; unix socket /run/r.sock") == \
        "model <path> is not served; unix socket <path>"


def test_the_apis_own_endpoints_are_not_taken_for_file_paths():
    """A batch line's error names the endpoints it mixed up; they are this API's, not files."""
    msg = "url /v1/completions is not this batch's endpoint /v1/chat/completions"
    assert scrub_paths(msg) == msg
    assert scrub_paths("weights at /srv/v1/chat.bin") == "weights at <path>"
    assert scrub_paths("no /v1/models-7b/config.json here") == "no <path> here"
    assert scrub_paths("see /v1/batches/x/y.") == "see <path>"
    assert scrub_paths("POST /v1/completions.") == "POST /v1/completions."


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port` (from /proc/net/tcp{,6})."""
    out = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


def test_flower_and_metrics_listen_on_loopback_by_default(redis_url, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    env.update(GENPOOL_REDIS_URL=redis_url)
    flower = subprocess.Popen([sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app",
                               "flower", f"--port={port}"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "f.log", "wb"))
    try:
        wait_for(lambda: listening_addresses(port), 60, 0.3, "Flower listening")
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
    finally:
        stop_proc(flower, 10)
    from genpool.workers.integrations.metrics import MetricsObserver

    obs = MetricsObserver("m")
    server = obs.serve(0)
    try:
        time.sleep(0.1)
        assert listening_addresses(server.server_port) == {"0100007F"}
    finally:
        server.shutdown()


def test_a_keyless_gateway_refuses_cross_site_browser_requests(redis_url):
    """Without keys, a page on another site could make its visitor's browser POST to the gateway
    with no preflight: fetch() with a Blob body sends no Content-Type, and an HTML form sends
    multipart/form-data to /v1/files. Browsers name the page's origin in `Origin`; a request
    from another origin is refused before anything is read or queued. Clients that are not
    browsers send no Origin and are served as before."""
    from genpool.producer.gateway import create_app
    from tests.producer.test_gateway_limits import serve

    prefix = new_prefix("secorigin")
    app, r = create_app(redis_url, prefix, queue_without_workers=True), redis.Redis.from_url(redis_url)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1})
    try:
        with serve(app) as port:
            base, evil = f"http://127.0.0.1:{port}", {"Origin": "https://evil.example"}
            for origin in (evil, {"Origin": "null"}):
                err = openai_error(httpx.post(f"{base}/v1/completions", content=body,
                                              headers=origin), 403)
                assert err["code"] == "cross_origin", err
            up = httpx.post(f"{base}/v1/files", headers=evil, data={"purpose": "batch"},
                            files={"file": ("x.jsonl", b'{"custom_id": "a"}\n')})
            assert openai_error(up, 403)["code"] == "cross_origin"
            assert sum(r.xlen(k) for k in Keys(prefix).all_jobs()) == 0  # nothing queued
            assert httpx.get(f"{base}/health", headers=evil).status_code == 403
            same = httpx.get(f"{base}/v1/models", headers={"Origin": base})
            assert same.status_code == 200, same.text
            # no Origin: not a browser; served (this body's checks answer it)
            plain = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": -1})
            assert openai_error(plain, 400)["param"] == "max_tokens"
    finally:
        r.close()
        drop_prefix(redis_url, prefix)


def test_a_gateway_with_keys_serves_browser_clients_of_any_origin(gateway):
    """With keys, a cross-site page cannot send one without a preflight: Origin is not looked
    at, so a browser app behind a proxy that rewrites Host (or adds CORS) keeps working."""
    base, _ = gateway
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": -1},
                   headers={**AUTH, "Origin": "https://app.example"})
    assert openai_error(r, 400)["param"] == "max_tokens"
    assert httpx.get(f"{base}/v1/models", headers={**AUTH, "Origin": "null"}).status_code == 200
