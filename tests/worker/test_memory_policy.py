"""Issue 28, item 14a: an evicting `maxmemory-policy` loses jobs (under allkeys-lru 56 of 300
never got a terminal event), so workers and the gateway check it at start and warn loudly.
A server whose CONFIG is disabled (managed Redis) is said once, and serving goes on."""
from __future__ import annotations

import asyncio
import logging

import pytest

from genpool.producer import Client
from tests.fake_engine import FakeEngine, expected_for_prompt
from tests.pool_helpers import drop_prefix, new_prefix, worker_thread
from tests.worker.refusal_helpers import private_server, server_binaries

BINARY = next(iter(server_binaries().values()))


def policy_warnings(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == logger and r.levelno >= logging.WARNING and "maxmemory-policy" in
            r.getMessage()]


def serve_one_job(url: str) -> None:
    prefix = new_prefix("policy")
    c = Client(url, prefix)
    try:
        with worker_thread(FakeEngine(), url, prefix) as w:
            assert c.submit("policy", max_tokens=3).result(timeout=10).text == \
                expected_for_prompt("policy", 3)
            assert w.started
    finally:
        c.close()
        drop_prefix(url, prefix)


def start_gateway(url: str) -> None:
    pytest.importorskip("fastapi")
    from genpool.producer.gateway import Gateway

    async def main():
        gw = Gateway(url, new_prefix("policy"), [], None, -1, None, 8)
        await gw.start()
        await gw.stop()
    asyncio.run(main())


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_an_evicting_policy_is_warned_about_at_start(tmp_path, caplog, policy):
    """volatile-* evicts too: job hashes and event streams carry TTLs."""
    caplog.set_level(logging.WARNING)
    with private_server(BINARY, tmp_path / "redis", "--maxmemory-policy", policy) as url:
        serve_one_job(url)
        start_gateway(url)
    for logger in ("genpool.worker", "genpool.gateway"):
        said = policy_warnings(caplog, logger)
        assert len(said) == 1 and policy in said[0] and "noeviction" in said[0], (logger, said)


def test_noeviction_is_not_warned_about(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with private_server(BINARY, tmp_path / "redis", "--maxmemory-policy", "noeviction") as url:
        serve_one_job(url)
        start_gateway(url)
    assert policy_warnings(caplog, "genpool.worker") == []
    assert policy_warnings(caplog, "genpool.gateway") == []


def test_a_server_without_config_is_said_once_and_served(tmp_path, caplog):
    """Managed Redis often renames or disables CONFIG: say that the policy could not be read
    (once, not at every reconnect), then serve as usual."""
    caplog.set_level(logging.INFO)
    hidden = ("--rename-command", "CONFIG", "config-hidden-by-the-test")
    with private_server(BINARY, tmp_path / "redis", *hidden) as url:
        serve_one_job(url)
        serve_one_job(url)  # a second worker in this process: still said only once
        start_gateway(url)
    for logger in ("genpool.worker", "genpool.gateway"):
        said = [r.getMessage() for r in caplog.records if r.name == logger
                and "maxmemory-policy" in r.getMessage()]
        assert len(said) == 1 and "could not" in said[0], (logger, said)


def test_each_reachable_cluster_node_is_checked(cluster_url, caplog):
    """A cluster: every master is asked, and the one that evicts is named."""
    import redis

    from genpool.schemas.connection import connect

    caplog.set_level(logging.WARNING)
    rc = connect(cluster_url)
    node = rc.get_primaries()[-1]
    direct = redis.Redis(host=node.host, port=node.port)
    before = direct.config_get("maxmemory-policy")["maxmemory-policy"]
    direct.config_set("maxmemory-policy", "allkeys-random")
    try:
        serve_one_job(cluster_url)
    finally:
        direct.config_set("maxmemory-policy", before)
        direct.close()
        rc.close()
    said = policy_warnings(caplog, "genpool.worker")
    assert len(said) == 1 and "allkeys-random" in said[0] and str(node.port) in said[0], said
