"""Issue 31: a tenant's key sees only its own jobs through `genpool job` (another tenant's job
reads as a job that does not exist), and an invalid key is refused. Real Redis, the CLI."""
from __future__ import annotations

import subprocess
import sys

import pytest

from genpool.producer import Client
from genpool.producer.keys_store import KeyStore
from tests.pool_helpers import ROOT, drop_prefix, new_prefix


@pytest.fixture()
def jobs(redis_url):
    prefix = new_prefix("iso")
    a, b = Client(redis_url, prefix, tenant="team-a"), Client(redis_url, prefix, tenant="team-b")
    try:
        store = KeyStore(a.redis, a.keys)
        key_a, _ = store.create("team-a", [], 0)
        key_b, _ = store.create("team-b", [], 0)
        a.submit("a's prompt", job_id="job-a")
        b.submit("b's prompt", job_id="job-b")
        yield redis_url, prefix, key_a, key_b
    finally:
        a.close()
        b.close()
        drop_prefix(redis_url, prefix)


def job_cli(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "genpool.workers.cli.main", "job", *args,
                           "--redis", url, "--prefix", prefix], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("action", ["show", "cancel", "result", "stream"])
def test_another_tenants_job_is_not_found(jobs, action):
    url, prefix, key_a, key_b = jobs
    extra = ["--timeout", "0.5"] if action in ("result", "stream") else []
    theirs = job_cli(url, prefix, action, "job-a", "--api-key", key_b, *extra)
    unknown = job_cli(url, prefix, action, "no-such-job", "--api-key", key_b, *extra)
    assert theirs.returncode == unknown.returncode == 2
    assert theirs.stderr.replace("job-a", "X") == unknown.stderr.replace("no-such-job", "X")
    assert key_b not in theirs.stderr + theirs.stdout


def test_a_tenant_sees_and_cancels_its_own_job(jobs):
    url, prefix, key_a, _ = jobs
    shown = job_cli(url, prefix, "show", "job-a", "--api-key", key_a, "--json")
    assert shown.returncode == 0 and '"tenant": "team-a"' in shown.stdout
    cancelled = job_cli(url, prefix, "cancel", "job-a", "--api-key", key_a)
    assert cancelled.returncode == 0, cancelled.stderr
    r = Client(url, prefix)
    assert r.redis.hget(r.keys.job("job-a"), "cancel") == "1"
    assert r.redis.hget(r.keys.job("job-b"), "cancel") is None
    r.close()


def test_without_a_key_the_operator_sees_every_job_and_a_bad_key_is_refused(jobs):
    url, prefix, _, _ = jobs
    assert job_cli(url, prefix, "show", "job-b").returncode == 0
    bad = job_cli(url, prefix, "show", "job-b", "--api-key", "gp-not-a-key")
    assert bad.returncode == 2 and "not valid" in bad.stderr and "gp-not-a-key" not in bad.stderr
