"""Importing the Celery app (what `celery -A genpool.workers.integrations.celery_app` and every Celery user
does) must not touch the network: no broker, result backend or Redis connection at import."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import socket
tried = []
real_connect = socket.socket.connect
def connect(self, addr):
    tried.append(addr)
    raise OSError("network I/O at import")
socket.socket.connect = connect
socket.create_connection = lambda addr, *a, **k: (tried.append(addr), connect(None, addr))[1]
import genpool.workers.integrations.celery_app as m
assert m.app is not None
print("connects:", tried)
"""


def test_importing_the_celery_app_does_no_network_io():
    # An address nothing listens on: had the import connected, it would have been recorded first.
    env = {"GENPOOL_REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-P", "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "connects: []" in res.stdout, res.stdout
