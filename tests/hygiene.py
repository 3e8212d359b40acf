"""Test-suite hygiene, wired in by tests/conftest.py: the suite is a good citizen on a laptop.

- Every process a test spawns (subprocess.Popen, so subprocess.run too) starts in its own
  process group; at the end of the session every group still alive is killed, and the run FAILS
  if a process of those groups survives the kill (it would outlive the suite).
- Every Redis key a test writes must have a TTL or be deleted: at the end, keys in the test
  database without a TTL that were not there at the start fail the run (and are deleted).
- The product's own temporary directories (tensor-parallel rendezvous, genpool-tp-*) must be gone
  at the end: a run that leaves one fails.
- A sampler adds up the resident memory of the pytest process and all its descendants twice a
  second; the summary prints the suite's peak (the target is <= 6 GB).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Optional

_groups: set[int] = set()  # process group ids of spawned children (each its own leader)
_orig_init = subprocess.Popen.__init__


def _popen_init(self, *args, **kwargs):
    # Respect a caller that chose its own session/group; otherwise: a group of its own.
    if not kwargs.get("start_new_session") and kwargs.get("process_group") is None:
        kwargs["start_new_session"] = True
    _orig_init(self, *args, **kwargs)
    if kwargs.get("start_new_session"):
        _groups.add(self.pid)


def install_process_groups() -> None:
    subprocess.Popen.__init__ = _popen_init


def _group_members(pgids: set[int]) -> list[tuple[int, int, str]]:
    """(pid, pgid, command) of live (non-zombie) processes in any of `pgids`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            state, _, pgid = stat.rsplit(")", 1)[1].split()[:3]
            if int(pgid) in pgids and state != "Z":
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
                out.append((int(d), int(pgid), cmd))
        except (OSError, ValueError, IndexError):
            continue
    return out


def still_running() -> list[tuple[int, int, str]]:
    """Spawned processes alive now (at the session's end: leaked by a test)."""
    return _group_members(_groups)


def kill_spawned(grace_s: float = 3.0) -> list[tuple[int, int, str]]:
    """SIGTERM then SIGKILL every spawned group still alive; returns survivors (should be [])."""
    alive = {pgid for _, pgid, _ in _group_members(_groups)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in alive:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_members(alive):
            time.sleep(0.05)
        alive = {pgid for _, pgid, _ in _group_members(alive)}
        if not alive:
            break
    return _group_members(_groups)


def _children_of(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PeakRSS:
    """Peak of (pytest + every descendant) resident memory, sampled every `every_s`."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak, self.peak_procs = every_s, 0, 0
        self.test, self.peak_test = "", ""  # the test running now (conftest sets it), and at the peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def start(self) -> "PeakRSS":
        self._thread.start()
        return self

    def sample(self) -> None:
        pids = _children_of(os.getpid())
        total = sum(_rss(p) for p in pids)
        if total > self.peak:
            self.peak, self.peak_procs, self.peak_test = total, len(pids), self.test

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sample()


# One id per suite run, inherited by the processes it starts: tests.pool_helpers.new_prefix puts it
# in every test prefix, so the key check below looks at this run's keys only. Several runs may
# share the test database (two developers, a CI run beside a session); without the id a run
# would count, and delete, another run's live keys as its own leaks.
SESSION = os.environ.setdefault("GENPOOL_TEST_SESSION", os.urandom(3).hex())
TEST_KEYS = f"test-{SESSION}-*"


def unexpired_keys(url: str, before: Optional[set] = None) -> tuple[set, list[str]]:
    """(test keys without a TTL now, those of them not in `before`). Only keys under this run's
    prefixes (and the kombu bindings of its queues, which the tests' apps create) count: the database may be shared with other processes (a developer's pool, Celery's
    routing keys), whose keys are none of the suite's business and must never be deleted."""
    import redis

    r = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        keys = set(r.scan_iter(match=TEST_KEYS, count=1000))
        # this run's Celery tests' kombu bindings (pool_helpers.drop_prefix deletes or expires
        # them): `_kombu.binding[_permanent].<queue>`, the queue named by the test's prefix. Not
        # every binding: a run beside this one (CI and a developer on one Redis) had its
        # bindings deleted under it and was failed for them.
        keys |= set(r.scan_iter(match=f"_kombu.binding*.{TEST_KEYS}", count=1000))
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.ttl(k)
        no_ttl = {k for k, ttl in zip(keys, pipe.execute()) if ttl == -1}
    finally:
        r.close()
    new = sorted(k.decode(errors="replace") for k in no_ttl - (before or set()))
    return no_ttl, new


def delete_keys(url: str, keys: list[str]) -> None:
    import redis

    r = redis.Redis.from_url(url)
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])
    r.close()


def leftover_dirs() -> set[str]:
    """The product's temporary directories now present (engine/tp_runner.py's rendezvous)."""
    import glob
    import tempfile
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "genpool-tp-*")))
