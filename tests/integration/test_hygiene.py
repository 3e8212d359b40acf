"""The suite's own hygiene checks fail a run that leaks (tests/hygiene.py, wired in conftest)."""
from __future__ import annotations

import os
import subprocess
import sys

import redis

from tests import hygiene
from tests.pool_helpers import new_prefix

LEAKY = '''
import subprocess, redis, os
def test_leaks():
    p = subprocess.Popen(["sleep", "300"])  # never stopped
    open(os.environ["PROBE_PID"], "w").write(str(p.pid))
    r = redis.Redis.from_url(os.environ["PROBE_URL"])
    r.set(os.environ["PROBE_KEY"], "x")  # no TTL, never deleted
'''


def test_a_leaking_run_fails_and_is_cleaned_up(redis_url, tmp_path):
    (tmp_path / "test_probe.py").write_text(LEAKY)
    key = new_prefix("hyg")  # under this run's checked prefix (the probe run inherits the id)
    env = dict(os.environ, PROBE_URL=redis_url, PROBE_KEY=key,
               PROBE_PID=str(tmp_path / "pid"),
               GENPOOL_TEST_REDIS_URL=redis_url)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                        "-p", "no:cacheprovider", str(tmp_path / "test_probe.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out  # the test itself passed: the hygiene checks failed the run
    assert "1 passed" in out and "processes outlived the test session" in out and "sleep 300" in out
    assert f"Redis keys written without a TTL and not deleted (deleted now): {key}" in out
    assert "genpool suite: peak RSS" in out
    assert not redis.Redis.from_url(redis_url).exists(key)
    pid = int((tmp_path / "pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2], \
        "the leaked process is still alive"


def test_only_this_runs_keys_are_its_business(redis_url):
    """Another run on the same database (CI beside a developer) keeps its keys and kombu bindings."""
    mine, theirs = new_prefix("hyg"), new_prefix("hyg").replace(hygiene.SESSION, "0ther0", 1)
    keys = [f"_kombu.binding.{mine}", f"_kombu.binding_permanent.{mine}", f"_kombu.binding.{theirs}", theirs]
    r = redis.Redis.from_url(redis_url)
    try:
        for k in keys:
            r.set(k, "x")  # no TTL: what the check looks for
        _, new = hygiene.unexpired_keys(redis_url, set())
        assert keys[0] in new and keys[1] in new
        assert keys[2] not in new and keys[3] not in new
    finally:
        r.delete(*keys)
        r.close()
