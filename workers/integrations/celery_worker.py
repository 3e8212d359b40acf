"""`genpool worker --celery`: the resident genpool worker inside a real Celery worker process.

The genpool loop runs in a thread started by a worker bootstep; Celery's threads pool runs the
`genpool.generate` task bodies (which only wait on Redis). One process, one engine, and the
Celery worker's own machinery for everything Celery users expect: it appears in Flower through its
own heartbeats, answers `celery inspect ping`, and `celery control shutdown` (or SIGTERM) drains
the engine before the process exits. Stream jobs are reported to Flower under the same hostname
by workers/integrations/flower_events.py.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

from celery import bootsteps

from genpool.workers.integrations.celery_app import HOSTS_ENGINE, SHUTDOWN, app, configure
from genpool.workers.integrations.flower_events import attach_flower_events, celery_hostname

log = logging.getLogger("genpool.celery")


def genpool_step(gp_worker):
    """A worker bootstep class bound to one prebuilt genpool Worker (engine already loaded)."""

    class GenpoolWorker(bootsteps.StartStopStep):
        # started after the pool, so stopped before it: the engine drains while task bodies
        # can still return the results of jobs that finish during the drain
        requires = {"celery.worker.components:Pool"}

        def __init__(self, parent, **kwargs):
            super().__init__(parent, **kwargs)
            self.thread = None

        def start(self, parent):
            attach_flower_events(gp_worker, app, hostname=parent.hostname, heartbeats=False)
            HOSTS_ENGINE.set()  # SHUTDOWN waits for the engine's drain (stop below)
            SHUTDOWN.clear()
            self.thread = threading.Thread(target=self._run, name="genpool-worker", daemon=True)
            self.thread.start()

        def _run(self):
            try:
                gp_worker.run()
            except BaseException:  # an engine that died must not leave a deaf Celery worker
                log.exception("genpool worker loop crashed; shutting the Celery worker down")
                os.kill(os.getpid(), signal.SIGTERM)

        def stop(self, parent, drain_timeout_s=None):
            if self.thread is not None:
                gp_worker.stop(drain_timeout_s)
                self.thread.join(gp_worker.cfg.drain_timeout_s + 15)
            SHUTDOWN.set()  # task bodies still waiting give their message back

        def terminate(self, parent):  # cold shutdown (SIGQUIT): no drain
            self.stop(parent, drain_timeout_s=0.0)

    return GenpoolWorker


def run_in_celery(gp_worker, url: str, queue: str | None = None,
                  concurrency: int | None = None, loglevel: str = "INFO") -> int:
    """Start a Celery worker (threads pool) hosting `gp_worker`; returns its exit code."""
    configure(url, gp_worker.keys.prefix, queue)
    app.steps["worker"].add(genpool_step(gp_worker))
    # enough task threads to keep the engine's batch full of Celery jobs; they only wait on Redis
    threads = concurrency or max(4, gp_worker.max_seqs)
    w = app.Worker(hostname=celery_hostname(gp_worker.name), pool="threads",
                   concurrency=threads, queues=[app.conf.task_default_queue], loglevel=loglevel,
                   prefetch_multiplier=1, task_events=True, without_mingle=True,
                   without_gossip=True)
    w.start()
    return int(w.exitcode or 0)
