"""Regenerate docs/flower.png and docs/flower-tasks.png: a live pool seen through Flower.

Starts Flower, one `genpool worker --celery` and one `genpool worker --celery-events` (SmolLM2),
sends jobs through both front doors (including a failure, a cancel and a Celery revoke), then
photographs Flower's dashboard and tasks page with headless Chromium.

    python docs/make_flower_screenshots.py [--redis redis://127.0.0.1:6379/9]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from genpool.producer import Client  # noqa: E402
from genpool.workers.integrations.celery_app import make_app  # noqa: E402
from tests.pool_helpers import drop_prefix, spawn_worker, wait_for  # noqa: E402

CHROMIUM = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--window-size=1400,900", "--virtual-time-budget=5000"]
PROMPTS = ["Write one sentence about bees in winter.", "What is the capital of France?",
           "Name three colors.", "Describe a lighthouse in one line.",
           "Give a tip for writing clearly.", "Say hello in French."]


def screenshot(url: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([*CHROMIUM, f"--user-data-dir={profile}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=120)
    print("wrote", out)


def submit_all(url: str, prefix: str) -> None:
    c, caller = Client(url, prefix), make_app(url, prefix)
    chat = lambda p: [{"role": "user", "content": p}]  # noqa: E731
    jobs = [c.submit(messages=chat(p), max_tokens=24, temperature=0.0) for p in PROMPTS[:4]]
    tasks = [caller.send_task("genpool.generate", kwargs=dict(
        messages=chat(p), max_tokens=24, temperature=0.0)) for p in PROMPTS[2:]]
    tasks.append(caller.send_task("genpool.generate", kwargs=dict(prompt="x", max_tokens=0)))
    bad = c.submit("Which model?", model="gpt-99")
    long_job = c.submit("Tell a long story.", max_tokens=400, ignore_eos=True)
    long_task = caller.send_task("genpool.generate", kwargs=dict(prompt="Another long story.",
                                                                 max_tokens=400, ignore_eos=True))
    for job_id in (long_job.id, long_task.id):
        next(ev for ev in c.job(job_id).events(timeout=300) if ev.type == "token")
    c.cancel(long_job.id)
    caller.control.revoke(long_task.id)
    for j in jobs + [bad, long_job]:
        j.result(timeout=300)
    for t in tasks + [long_task]:
        t.get(timeout=300, propagate=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/9")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--port", type=int, default=5566)
    a = ap.parse_args()
    prefix = f"demo-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, GENPOOL_REDIS_URL=a.redis, PYTHONPATH=str(ROOT),
               OMP_WAIT_POLICY="PASSIVE", FLOWER_UNAUTHENTICATED_API="true")
    flower = subprocess.Popen([sys.executable, "-P", "-m", "celery", "-A", "genpool.workers.integrations.celery_app",
                               "flower", f"--port={a.port}", "--address=127.0.0.1"], cwd=ROOT,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    common = ("--num-threads", "1", "--max-num-seqs", "16")
    procs = [spawn_worker(a.redis, prefix, a.model, "worker-1", *common, "--celery",
                          "--celery-queue", prefix, env={"OMP_WAIT_POLICY": "PASSIVE"}),
             spawn_worker(a.redis, prefix, a.model, "worker-2", *common, "--celery-events",
                          env={"OMP_WAIT_POLICY": "PASSIVE"})]
    base = f"http://127.0.0.1:{a.port}"
    try:
        wait_for(lambda: b'"genpool@worker-2": true' in urllib.request.urlopen(
            base + "/api/workers?status=1").read() if _up(base) else False, 300, 1.0, "workers")
        submit_all(a.redis, prefix)
        time.sleep(3)  # a heartbeat or two, so the dashboard's counters are current
        screenshot(base + "/", ROOT / "docs" / "flower.png")
        screenshot(base + "/tasks", ROOT / "docs" / "flower-tasks.png")
    finally:
        for p in (*procs, flower):
            p.terminate()
        for p in (*procs, flower):
            p.wait(60)
        drop_prefix(a.redis, prefix)
        Client(a.redis, prefix).redis.delete(prefix, f"_kombu.binding.{prefix}")  # its queue
    return 0


def _up(base: str) -> bool:
    try:
        return urllib.request.urlopen(base + "/healthcheck", timeout=2).status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
