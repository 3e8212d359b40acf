"""`genpool worker` options for monitoring and the Celery front door, and how the loop is run.

Kept apart from worker_cli.py so the worker loop's owner and the monitoring code do not edit one
file; imports of prometheus_client and celery happen only when their options are used.
"""
from __future__ import annotations

import argparse

from genpool.schemas.config import count
from genpool.schemas.settings import value


def add_runner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("monitoring and Celery")
    g.add_argument("--metrics-port", type=int, default=value("GENPOOL_METRICS_PORT"),
                   help="serve Prometheus /metrics on this port (0: any free port; default: "
                        "$GENPOOL_METRICS_PORT, else none: no /metrics server)")
    g.add_argument("--metrics-addr", default=value("GENPOOL_METRICS_ADDR"),
                   help="address /metrics listens on; 0.0.0.0 exposes it, as compose does inside "
                        "its network (default: %(default)s; $GENPOOL_METRICS_ADDR sets it, else "
                        "loopback)")
    g.add_argument("--celery-events", action="store_true",
                   default=value("GENPOOL_CELERY_EVENTS"),
                   help="send Celery events so Flower shows this worker and its jobs (default: off, "
                        "on when $GENPOOL_CELERY_EVENTS is 1, true, yes or on)")
    g.add_argument("--celery", action="store_true",
                   help="run inside a Celery worker (threads pool): also serve genpool.generate "
                        "tasks, answer remote control (ping, shutdown); implies --celery-events")
    g.add_argument("--celery-queue", default=None,
                   help="Celery queue to consume (default $GENPOOL_CELERY_QUEUE or genpool)")
    g.add_argument("--celery-concurrency", type=count, default=None,
                   help="task threads (default: the worker's job capacity)")


def run_worker(worker, a: argparse.Namespace, url: str) -> int:
    """Attach the observers the options ask for, then run the loop (here, or inside Celery)."""
    if a.metrics_port is not None:
        from genpool.workers.integrations.metrics import attach_metrics

        attach_metrics(worker, a.metrics_port, url, a.metrics_addr)
    if a.celery:
        from genpool.workers.integrations.celery_worker import run_in_celery

        return run_in_celery(worker, url, a.celery_queue, a.celery_concurrency, a.log_level)
    if a.celery_events:
        from genpool.workers.integrations.celery_app import app, configure
        from genpool.workers.integrations.flower_events import attach_flower_events

        configure(url, worker.keys.prefix, a.celery_queue)
        attach_flower_events(worker, app)
    return worker.run()
