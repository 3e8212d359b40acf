"""The Celery front door: task `genpool.generate`, served by the same resident engines.

The task body does not generate anything itself. It submits the job onto genpool's Redis lane
stream with `genpool.producer.Client` (the job id is the Celery task id, so tokens stream on
`<p>:job:{<task id>}:events` too) and waits for the job's result, which it returns through the Celery
result backend. Whichever genpool worker reads the job runs it in its engine's batch together with
every stream job: one engine per worker process, never one per task. docs/decisions/0008-celery-task-forwards.md has the why.

    celery -A genpool.workers.celery worker -P threads -c 64 -Q genpool   # forwarders only, or
    genpool worker --model ... --celery                                # engine + Celery in one

Everything is JSON: tasks, results, events. Nothing is ever pickled.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

from celery import Celery
from celery.exceptions import Ignore, Reject
from celery.signals import worker_shutting_down

from genpool.producer import Client
from genpool.producer.retry import RETRY
from genpool.schemas.config import key_prefix, redis_url
from genpool.schemas.request import CALLER_PRIORITY_CEILING, check_priority
from genpool.schemas.settings import bound_openmp_spinning, value
from genpool.workers.integrations.celery_guard import GuardedTask
from genpool.workers.integrations.flower_events import CELERY_MARK, REVOKED_CODES

bound_openmp_spinning()  # a Celery worker runs the engine in this process: before torch loads

# `celery -A genpool.workers.integrations.celery_app flower` imports this module before Flower reads FLOWER_* options:
# listen on loopback unless told otherwise (compose passes --address=0.0.0.0 in its network).
os.environ.setdefault("FLOWER_ADDRESS", "127.0.0.1")

TASK_NAME = "genpool.generate"
ENV_QUEUE = "GENPOOL_CELERY_QUEUE"
DEFAULT_QUEUE = "genpool"
log = logging.getLogger("genpool.celery")
POLL_S = 0.25  # how often a waiting task body looks for revocation and shutdown

# Set when the Celery worker shuts down: task bodies still waiting then hand their message back to
# the broker instead of blocking shutdown. A plain forwarder sets it as its shutdown begins
# (_forwarder_shutting_down); `genpool worker --celery` (workers/integrations/celery_worker.py) once
# its engine has drained, so bodies of jobs that finish during the drain return their results.
SHUTDOWN = threading.Event()
HOSTS_ENGINE = threading.Event()  # set by `genpool worker --celery`'s bootstep


ENV_BROKER = "GENPOOL_CELERY_BROKER_URL"
ENV_VISIBILITY = "GENPOOL_CELERY_VISIBILITY_S"


def _verified_tls(url: str) -> str:
    """A rediss:// URL as Celery's result backend takes it: that backend refuses one without
    ssl_cert_reqs, which redis-py's own URLs leave out (their default: verify). So verify."""
    if not url.startswith("rediss://") or "ssl_cert_reqs=" in url:
        return url
    return url + ("&" if "?" in url else "?") + "ssl_cert_reqs=required"


def celery_redis(url: str) -> dict:
    """Celery's broker and result-backend settings for a genpool Redis URL
    (schemas/connection.py's forms). Sentinel becomes kombu's `sentinel://` list with the master
    name; kombu has no Redis Cluster transport, so with a cluster Celery's own queue needs a
    single Redis or Sentinel URL in GENPOOL_CELERY_BROKER_URL (the jobs still use the cluster)."""
    from genpool.schemas.connection import parse

    t = parse(value(ENV_BROKER) or url)
    if t.kind == "cluster":
        raise ValueError(f"Celery's Redis transport (kombu) cannot use Redis Cluster: set "
                         f"{ENV_BROKER} to a single-server or redis+sentinel:// URL for Celery's "
                         f"own queue; genpool jobs still go through the cluster")
    if t.kind == "single":
        url = _verified_tls(t.url)
        return dict(broker_url=url, result_backend=url)
    auth = f":{t.password}@" if t.password else ""
    hosts = ";".join(f"sentinel://{auth}{h}:{p}/{t.db}" for h, p in t.nodes)
    opts = {"master_name": t.service}
    if t.sentinel_password:
        opts["sentinel_kwargs"] = {"password": t.sentinel_password}
    return dict(broker_url=hosts, result_backend=hosts, result_backend_transport_options=opts,
                broker_transport_options=opts)


def _config(url: str, queue: str) -> dict:
    conn = celery_redis(url)
    transport = conn.pop("broker_transport_options", {})
    return dict(
        **conn,
        # JSON only: a pickle-accepting worker runs whatever anyone who can reach Redis sends
        task_serializer="json", result_serializer="json", event_serializer="json",
        accept_content=["json"], result_accept_content=["json"],
        # a task body only waits on Redis: threads, not forked processes (CUDA does not survive
        # fork); one message per free thread, acknowledged after the result (a lost worker's
        # tasks are redelivered; resubmitting the same job id is a no-op, so nothing runs twice)
        worker_pool="threads", worker_prefetch_multiplier=1, task_acks_late=True,
        broker_transport_options={"visibility_timeout": value(ENV_VISIBILITY), **transport},
        task_track_started=True, worker_send_task_events=True, task_send_sent_event=True,
        task_default_queue=queue, task_routes={TASK_NAME: {"queue": queue}},
        result_extended=True, result_expires=86400, broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # reject a task message Celery cannot read instead of dying of it (celery_guard.py)
        worker_consumer="genpool.workers.integrations.celery_guard:GuardedConsumer",
    )


def make_app(url: Optional[str] = None, queue: Optional[str] = None) -> Celery:
    """A Celery app configured like ours: what calling code may use for `send_task`."""
    a = Celery("genpool", set_as_current=False)
    a.conf.update(_config(redis_url(url), queue or value(ENV_QUEUE)))
    return a


# Broker and backend from GENPOOL_REDIS_URL (genpool.schemas.config.redis_url's rules), queue from
# GENPOOL_CELERY_QUEUE, the producer's key prefix from GENPOOL_PREFIX; `genpool worker --celery`
# calls configure() with its own --redis/--prefix before the app connects anywhere.
app = Celery("genpool")
app.conf.update(_config(redis_url(), value(ENV_QUEUE)))

_settings: dict = {"url": None, "prefix": None, "client": None}
_client_lock = threading.Lock()


def configure(url: Optional[str] = None, prefix: Optional[str] = None,
              queue: Optional[str] = None) -> None:
    """Point the app (broker, backend, queue) and the task's producer at one deployment.
    Call it before the app is used: Celery caches its connection pool and backend."""
    url = redis_url(url)
    app.conf.update(_config(url, queue or app.conf.task_default_queue))
    with _client_lock:
        _settings.update(url=url, prefix=prefix, client=None)


def client() -> Client:
    """One producer per process; redis-py's connection pool is shared safely by the threads."""
    with _client_lock:
        if _settings["client"] is None:
            _settings["client"] = Client(_settings["url"] or redis_url(),
                                         key_prefix(_settings["prefix"]))
        return _settings["client"]


class GenerationError(Exception):
    """The job ended with an error event (docs/protocol.md error codes)."""

    def __init__(self, code: str, message: str):
        super().__init__(code, message)  # args stay JSON-serializable for the result backend
        self.code, self.message = code, message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@app.task(name=TASK_NAME, bind=True, acks_late=True, track_started=True, base=GuardedTask)
def generate(self, prompt: Optional[str] = None, *, raise_on_error: bool = True,
             **fields: Any) -> dict:
    """Same fields as `producer.Client.submit`: prompt or messages, SamplingParams names, model,
    priority, deadline, job_id (default: this task's id), metadata, tenant; OpenAI's tools, tool_choice
    and parallel_tool_calls with messages. Returns a JSON dict: job_id, text, token_ids,
    finish_reason, usage, timings, choices, worker, error (null); with tools also tool_calls
    (OpenAI's shape, or null) and content, per choice too. A job that ends
    in an error raises GenerationError (state FAILURE), or with raise_on_error=False returns the
    dict with `error` set; a cancelled or expired job is REVOKED. A priority below the
    gateway's ceiling (schemas.request.CALLER_PRIORITY_CEILING) fails the task."""
    # a Celery caller is no more trusted than an HTTP one: the gateway's priority ceiling
    check_priority(fields.get("priority"), CALLER_PRIORITY_CEILING, "a genpool.generate task")
    fields["job_id"] = fields.get("job_id") or self.request.id
    meta = dict(fields.pop("metadata", None) or {})
    meta[CELERY_MARK] = self.request.id  # the genpool worker leaves its Flower events to us
    job = client().submit(prompt, metadata=meta, **fields)  # ValueError: invalid -> FAILURE
    res = _wait(self, job)
    out = result_dict(res)
    if res.error is None:
        return out
    if res.error.code in REVOKED_CODES:
        _revoked(self, res.error)
    if raise_on_error:
        raise GenerationError(res.error.code, res.error.message)
    return out


def _wait(task, job):
    """Wait for the job's terminal event in POLL_S slices; forward a Celery revoke as a genpool
    cancel; on worker shutdown give the message back (acks_late) for another worker."""
    from celery.worker import state as worker_state

    cancelled = False
    while True:
        try:
            if not cancelled and task.request.id in worker_state.revoked:
                client().cancel(job.id)  # the job ends with `cancelled` within one engine step
                cancelled = True
            return job.result(timeout=POLL_S, raise_on_error=False)
        except TimeoutError:
            pass
        except RETRY as e:  # a failover, restart or stall longer than the client's retries:
            # the job lives on in Redis, so wait on (failing the task lost its result)
            log.warning("job %s: Redis is unreachable (%s); still waiting", job.id, e)
            time.sleep(POLL_S)
        if SHUTDOWN.is_set():
            raise Reject("worker shutting down; the job stays queued", requeue=True)


@worker_shutting_down.connect
def _forwarder_shutting_down(**_) -> None:
    if not HOSTS_ENGINE.is_set():  # no drain to wait for: nothing here runs the jobs
        SHUTDOWN.set()


def _revoked(task, err) -> None:
    """Record REVOKED the way Celery does for a task it terminates, then end without a result."""
    task.backend.mark_as_revoked(task.request.id, err.code, request=task.request)
    task.send_event("task-revoked", terminated=err.code == "cancelled", signum=None,
                    expired=err.code == "expired")
    raise Ignore()


def result_dict(res) -> dict:
    d = res.model_dump(mode="json", exclude={"id", "error"})
    err = None if res.error is None else {"code": res.error.code, "message": res.error.message}
    return {"job_id": res.id, **d, "error": err}
