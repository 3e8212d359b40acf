"""The Redis commands one job costs, submit to result (issue 29's "hops of one job's path").

One job (FakeEngine, 8 tokens, one token per step) through a real worker in this process; Redis
MONITOR (a second connection) records every command from the submit to the result read. Counted:
the commands clients sent that name the job (its hash, its event stream, its id) or its lane
stream, per command name, and the commands its scripts ran inside Redis. Heartbeats and the
worker's lane reads (XREADGROUP, XPENDING: one of them delivered the job, the rest are its idle
polling) are not counted.

  python benchmarks/job_hops.py [--redis URL]
Run it against another tree with that tree first on PYTHONPATH as `genpool` (see
benchmarks/gpu_check.sh: a directory of genpool/<folder> links).
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import redis  # noqa: E402

from genpool.producer import Client  # noqa: E402
from genpool.schemas import Keys  # noqa: E402
from genpool.schemas.connection import connect, delete_prefix  # noqa: E402
from genpool.workers.worker import Worker, WorkerConfig  # noqa: E402
from tests.fake_engine import FakeEngine  # noqa: E402


def monitor(url: str, out: list, stop: threading.Event, ready: threading.Event) -> None:
    r = redis.Redis.from_url(url)
    with r.monitor() as m:
        ready.set()
        for cmd in m.listen():
            out.append(cmd)
            if stop.is_set():
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis", default=os.environ.get("GENPOOL_REDIS_URL", "redis://127.0.0.1:6379/9"))
    a = ap.parse_args()
    prefix = f"hops-{uuid.uuid4().hex[:6]}"
    w = Worker(FakeEngine(step_delay=0.02), connect(a.redis), Keys(prefix),
               WorkerConfig(name="hops", served_models=frozenset({"fake"}), heartbeat_s=30.0))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    c = Client(a.redis, prefix)
    time.sleep(1.0)  # the worker is up and idle
    seen, stop, ready = [], threading.Event(), threading.Event()
    mon = threading.Thread(target=monitor, args=(a.redis, seen, stop, ready), daemon=True)
    mon.start()
    ready.wait(5)
    job = c.submit("count my hops", max_tokens=8)
    res = job.result(timeout=30)
    stop.set()
    c.redis.ping()  # wakes the monitor so it sees stop
    mon.join(5)
    w.stop(drain_timeout_s=1.0)
    t.join(10)
    mine = [m for m in seen if job.id in m["command"] or "jobs:" in m["command"]
            and f"{prefix}" in m["command"] and not m["command"].startswith(("XREADGROUP",
                                                                             "XPENDING"))]
    sent = [m for m in mine if m.get("client_type") != "lua"]  # what clients sent
    names = collections.Counter(m["command"].split(" ", 1)[0].upper().strip('"') for m in sent)
    out = {"job_tokens": len(res.token_ids), "client_commands": sum(names.values()),
           "by_command": dict(sorted(names.items())),
           "inside_scripts": len(mine) - len(sent)}
    print(json.dumps(out, indent=1))
    c.close()
    delete_prefix(connect(a.redis), prefix)


if __name__ == "__main__":
    main()
