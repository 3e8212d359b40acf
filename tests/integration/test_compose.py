"""compose.yaml is a valid Compose file (docker-compose validates it offline, no engine needed)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.pool_helpers import ROOT

COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed "
                    "(apt-get install -y --no-install-recommends docker-compose)")
def test_compose_config_is_valid():
    env = dict(os.environ, FLOWER_BASIC_AUTH="admin:test-only", GENPOOL_API_KEYS="sk-test")
    out = subprocess.run([COMPOSE, "-f", "compose.yaml", "config", "-q"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed")
@pytest.mark.parametrize("missing,other", [("FLOWER_BASIC_AUTH", ("GENPOOL_API_KEYS", "sk-test")),
                                           ("GENPOOL_API_KEYS", ("FLOWER_BASIC_AUTH", "admin:test-only"))])
def test_compose_refuses_to_start_without_its_secrets(missing, other):
    """Flower without basic auth, the gateway without an API key: `compose config` fails, naming it."""
    env = {k: v for k, v in os.environ.items() if k != missing}
    env[other[0]] = other[1]
    out = subprocess.run([COMPOSE, "-f", "compose.yaml", "config", "-q"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and missing in out.stderr


def test_compose_builds_what_it_runs():
    text = (ROOT / "compose.yaml").read_text()
    assert (ROOT / "Dockerfile").is_file() and "build: ." in text
    for service in ("redis:", "worker:", "flower:", "gateway:"):
        assert f"\n  {service}" in text, service
