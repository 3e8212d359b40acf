"""Simulated fleet: how much of a genpool fleet one Redis, Sentinel, or a 3-node Cluster carries.

No model: each worker is a real `Worker` (workers/worker.py) around a fake engine that emits one
token per running job per step at a fixed step rate, each token's text being the time it was
produced. One process hosts all the workers (threads); another submits jobs (keeping every
worker's slots full) and reads a sample of the jobs' event streams, timing each token from
production to the reader. Per level it reports jobs/s and token events/s finished, the p50/p99
production->reader latency, the step rate the workers achieved against the target, and the CPU
each redis-server used, from which the Redis cost per job and per token event is fitted.

  python benchmarks/fleet_bench.py --topologies single,sentinel,cluster --workers 2,6,12 \\
      --json out/fleet.json
Servers are started for the run on loopback (tests/redis_topologies.py) and stopped after it.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

from genpool.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from tests.fake_engine import FakeEngine  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


class RateEngine(FakeEngine):
    """Steps on a fixed clock (`step_hz`); each token's text is its production time."""

    def __init__(self, max_num_seqs: int, step_hz: float):
        super().__init__(max_num_seqs=max_num_seqs, num_blocks=1 << 20)
        self.period, self.next_at, self.late, self.emitted = 1.0 / step_hz, time.monotonic(), 0, 0

    def step(self) -> list[RequestOutput]:
        outs, self._aborted = self._aborted, []
        self.next_at += self.period
        delay = self.next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:  # this host cannot keep the rate: count it, do not try to catch up
            self.late += 1
            self.next_at = time.monotonic()
        self.step_count += 1
        now = f"{time.time():.6f} "
        for q in self._running():
            q.done += 1
            fin = "length" if q.done >= q.max_tokens else None
            if fin:
                del self.requests[q.rid]
            outs.append(RequestOutput(q.rid, None, q.ids, [CompletionOutput(0, now, [7], fin)],
                                      fin is not None))
            self.emitted += 1
        return outs


# -- the fleet process --------------------------------------------------------------------------
def run_fleet(a) -> None:
    """`--role fleet`: host a.workers workers for a.seconds, then print their totals as JSON."""
    from genpool.schemas import Keys
    from genpool.schemas.connection import connect
    from genpool.workers.worker import Worker, WorkerConfig

    workers = []
    for i in range(a.workers):
        cfg = WorkerConfig(name=f"sim-{i}", served_models=frozenset({"sim"}), heartbeat_s=1.0,
                           claim_idle_ms=60_000, drain_timeout_s=0.0)
        workers.append(Worker(RateEngine(a.seqs, a.step_hz), connect(a.url, socket_timeout=30),
                              Keys(a.prefix, a.lane_shards), cfg))
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    print("ready", flush=True)
    time.sleep(a.warmup)
    snap = [(w.counts["done"], w.engine.step_count, w.engine.late, w.engine.emitted)
            for w in workers]
    cpu0, t0 = os.times(), time.monotonic()
    time.sleep(a.seconds)
    dt, cpu1 = time.monotonic() - t0, os.times()
    done = sum(w.counts["done"] - s[0] for w, s in zip(workers, snap))
    steps = sum(w.engine.step_count - s[1] for w, s in zip(workers, snap))
    late = sum(w.engine.late - s[2] for w, s in zip(workers, snap))
    events = sum(w.engine.emitted - s[3] for w, s in zip(workers, snap))
    for w in workers:
        w.stop(0.0)
        w.stop(0.0)
    for t in threads:
        t.join(30)
    print(json.dumps({"jobs_per_s": done / dt, "steps_per_s": steps / dt,
                      "events_per_s": events / dt,
                      "late_steps_frac": late / max(1, steps),
                      "fleet_cpu_frac": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / dt}),
          flush=True)


# -- producer + readers (the main process) ------------------------------------------------------
async def drive(a, prefix: str, fleet: subprocess.Popen, pids: tuple[list, list]) -> dict:
    """Keep the queue topped up; read every `a.sample_every`-th job's events; time tokens."""
    from genpool.producer.aio import AsyncClient
    from genpool.schemas.connection import connect_async, lane_depths, queue_lane_depths
    from genpool.schemas.tenants import known_sub_streams, queue_known

    client = AsyncClient(a.url, prefix, redis_client=connect_async(
        a.url, max_connections=2000, decode_responses=True))
    lat: list[float] = []
    tokens_read, n, readers = [0], 0, set()
    target = a.workers * a.seqs
    t_measure = time.monotonic() + a.warmup
    t_end = t_measure + a.seconds
    cpu0 = None

    async def read(job):
        async for ev in job.events(timeout=120):
            if ev.type == "token" and time.monotonic() > t_measure:
                lat.append(time.time() - float(ev.text))
                tokens_read[0] += 1

    while time.monotonic() < t_end and fleet.poll() is None:
        if cpu0 is None and time.monotonic() >= t_measure:
            cpu0 = ([cpu_seconds(p) for p in pids], time.monotonic())
        keys = await client.lane_keys()
        pipe = client.redis.pipeline(transaction=False)
        queue_known(pipe, keys)  # tenants' sub-streams (fair pull) hold queued jobs too
        subs = known_sub_streams(keys, await pipe.execute(raise_on_error=False))
        pipe = client.redis.pipeline(transaction=False)
        queue_lane_depths(pipe, keys, subs)
        queued = sum(q for q, _ in lane_depths(await pipe.execute(raise_on_error=False),
                                               [keys.lane_of_stream(s) for s in subs]).values())
        want = max(0, target // 2 + 1 - queued)
        if want:
            specs = [{"prompt": "s", "max_tokens": a.max_tokens, "model": "sim",
                      "job_id": f"{prefix}-{n + i}"} for i in range(want)]
            if a.tenant_count:  # fair pull: each tenant its own sub-stream, round robin
                for i, spec in enumerate(specs):
                    spec["tenant"] = f"t{(n + i) % a.tenant_count}"
            for k, job in enumerate(await client.submit_many(specs)):
                if (n + k) % a.sample_every == 0:
                    task = asyncio.ensure_future(read(job))
                    readers.add(task)
                    task.add_done_callback(readers.discard)
            n += want
        await asyncio.sleep(0.05)
    cpu = [None, None]  # cores: every data server, the masters
    if cpu0 is not None:
        dt = time.monotonic() - cpu0[1]
        cpu = [(cpu_seconds(p) - c) / dt for p, c in zip(pids, cpu0[0])]
    for task in list(readers):
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    await client.close()
    lat.sort()
    pct = (lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000) if lat else (lambda p: None)
    return {"redis_cpu_cores": cpu[0], "redis_cpu_masters": cpu[1], "submitted": n, "latency_samples": len(lat), "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "max_ms": lat[-1] * 1000 if lat else None}


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / CLK


def run_level(a, url: str, server_pids: tuple[list, list], workers: int, max_tokens: int,
              tenants: int = 0) -> dict:
    """server_pids: (every data server, the masters among them). tenants: jobs spread over
    this many tenants (0: all the default tenant's, on the lane streams themselves)."""
    prefix = f"fleet-{uuid.uuid4().hex[:6]}"
    lvl = argparse.Namespace(**{**vars(a), "url": url, "workers": workers,
                                "max_tokens": max_tokens, "tenant_count": tenants})
    cmd = [sys.executable, __file__, "--role", "fleet", "--url", url, "--prefix", prefix,
           "--workers", str(workers), "--seqs", str(a.seqs), "--step-hz", str(a.step_hz),
           "--seconds", str(a.seconds), "--warmup", str(a.warmup),
           "--lane-shards", str(a.lane_shards)]
    # the script puts the root last on its own sys.path; PYTHONPATH=ROOT would put it first
    # and shadow installed packages (Hugging Face's kernels)
    fleet = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if fleet.stdout.readline().strip() != "ready":  # both windows start from here
        raise SystemExit(f"fleet process failed (exit {fleet.wait()})")
    try:
        result = asyncio.run(drive(lvl, prefix, fleet, server_pids))
    finally:
        out, _ = fleet.communicate(timeout=120)
    fleet_stats = json.loads(out.strip().splitlines()[-1])
    row = {"workers": workers, "max_tokens": max_tokens, "tenants": tenants,
           "offered_events_per_s": workers * a.seqs * a.step_hz, **fleet_stats, **result}
    print(json.dumps(row), flush=True)
    _drop(url, prefix)
    return row


def _drop(url: str, prefix: str) -> None:
    from genpool.schemas.connection import connect, delete_prefix

    r = connect(url)
    delete_prefix(r, prefix, batch=1000)
    r.close()


def start_topology(name: str):
    """(url, (pids of every data server, pids of the masters), stop function)."""
    from tests import redis_topologies as rt

    if name == "single":
        servers = rt.Servers(Path(tempfile.mkdtemp(prefix="genpool-fleet-", dir="/tmp")))
        (port,) = rt.free_ports(1, rt.DATA_PORTS)
        servers.start(port)
        pid = servers.procs[port].pid
        return f"redis://127.0.0.1:{port}/0", ([pid], [pid]), servers.stop
    if name == "sentinel":
        s = rt.start_sentinel()
        pids = [s.servers.procs[p].pid for p in (s.master_port, s.replica_port)]
        return s.url, (pids, pids[:1]), s.stop
    c = rt.start_cluster()
    masters = [p for p in c.ports
               if subprocess.run([rt.binary("redis-cli"), "-p", str(p), "role"],
                                 capture_output=True, text=True).stdout.startswith("master")]
    return c.url, ([c.servers.procs[p].pid for p in c.ports],
                   [c.servers.procs[p].pid for p in masters]), c.stop


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="bench", choices=["bench", "fleet"])
    ap.add_argument("--topologies", default="single,sentinel,cluster")
    ap.add_argument("--workers", default="2,6,12", help="fleet sizes (comma list)")
    ap.add_argument("--short-jobs", type=int, default=4,
                    help="max_tokens of one extra level at the middle size (per-job cost)")
    ap.add_argument("--seqs", type=int, default=64, help="jobs per worker (engine slots)")
    ap.add_argument("--step-hz", type=float, default=30.0, help="engine steps per second")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--sample-every", type=int, default=10, help="read every n-th job's stream")
    ap.add_argument("--lane-shards", type=int, default=1)
    ap.add_argument("--tenants", default="0", help="tenant counts to run each level with "
                    "(comma list; 0: the default tenant only, N: jobs spread over N tenants, "
                    "each with its sub-stream: fair pull)")
    ap.add_argument("--url", default=None)
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--json", default=None)
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    if a.role == "fleet":
        run_fleet(argparse.Namespace(**{**vars(a), "workers": int(a.workers)}))
        return 0
    sizes = [int(x) for x in a.workers.split(",")]
    rows = []
    for topo in a.topologies.split(","):
        url, pids, stop = start_topology(topo)
        levels = [(w, a.max_tokens) for w in sizes]
        if a.short_jobs:
            levels.append((sizes[len(sizes) // 2], a.short_jobs))
        try:
            for (w, tokens), tenants in ((lv, int(t)) for lv in levels for t in a.tenants.split(",")):
                rows.append({"topology": topo, **run_level(a, url, pids, w, tokens, tenants)})
                if a.json:  # after every level: a later failure keeps what was measured
                    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
        finally:
            stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
