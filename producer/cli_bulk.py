"""`genpool batch` and `genpool gateway` (their modules are imported only when a command runs, so
`genpool gateway --help` works without fastapi installed)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from genpool.schemas.config import HELP_FMT, add_connection_args, count, positive_seconds, seconds
from genpool.schemas.request import CALLER_PRIORITY_CEILING
from genpool.schemas.settings import value
from genpool.schemas.tenants import tenant_arg


def register_batch(sub) -> None:
    p = sub.add_parser("batch", help="run an OpenAI Batch API .jsonl file through the pool "
                                     "(resumable: rerun the same command after a stop)",
                       description="Run an OpenAI Batch API .jsonl file through the pool. Exits 1 "
                       "while any line of the input failed or was unusable, in this run or an "
                       "earlier one.", formatter_class=HELP_FMT)
    p.add_argument("input", type=Path, help="input .jsonl: custom_id, method, url, body per line")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="output .jsonl; custom_ids already in it are skipped")
    p.add_argument("--errors-out", type=Path, default=None, metavar="PATH",
                   help="write failed and unusable input lines here (one JSON line each, with "
                        "custom_id or line number) instead of into the output, as OpenAI's Batch "
                        "API does (default: failures in the output, unusable lines on stderr)")
    p.add_argument("--max-in-flight", type=count, default=64, help="jobs queued or running at once")
    p.add_argument("--model", default=None,
                   help="model for lines whose body names none (default: none: such lines go to "
                        "any worker)")
    p.add_argument("--priority", type=int, default=1, help="> 0: the bulk lane (default 1)")
    p.add_argument("--tenant", type=tenant_arg, default=None,
                   help="the tenant every line's job is for (default: \"default\")")
    p.add_argument("--batch-id", default=None,
                   help="namespace for job ids (default: a hash of the input file's content)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="run the file server-side, through this gateway's Batch API (e.g. "
                        "http://127.0.0.1:8000), and follow it; a rerun follows the same batch "
                        "(default: none: run it from here)")
    p.add_argument("--api-key", default=None,
                   help="the gateway's bearer key, with --remote (default: none: no key sent)")
    add_connection_args(p)
    p.set_defaults(func=cmd_batch)


def cmd_batch(a: argparse.Namespace) -> int:
    from .batch import run_batch
    from .client import Client

    if not a.input.is_file():
        print(f"genpool batch: no such file: {a.input}", file=sys.stderr)
        return 2
    if a.remote:
        from .batch_remote import run_remote

        return run_remote(a.remote, a.api_key, a.input, a.output, a.errors_out,
                          progress=not a.no_progress)
    try:
        c = run_batch(a.input, a.output, client=Client(a.redis, a.prefix, tenant=a.tenant),
                      max_in_flight=a.max_in_flight, model=a.model, priority=a.priority,
                      batch_id=a.batch_id, progress=not a.no_progress, errors_path=a.errors_out)
    except KeyboardInterrupt:
        print("\ngenpool batch: interrupted; rerun the same command to resume (jobs in flight "
              "keep running and are picked up)", file=sys.stderr)
        return 130
    where = f" (in {a.errors_out})" if a.errors_out else ""
    earlier = (f", {c.failed_before} of them failed (a rerun keeps their error; fresh output "
               f"files and a new --batch-id run every line again)") if c.failed_before else ""
    print(f"genpool batch: {c.ok} completed, {c.errors} errors, {c.skipped} unusable lines "
          f"skipped{where}, {c.resumed} already done{earlier}", file=sys.stderr)
    # scripts must see that not every line of the input succeeded, in this run or an earlier one
    return 1 if c.errors or c.skipped or c.failed_before else 0


def register_gateway(sub) -> None:
    p = sub.add_parser("gateway", help="OpenAI-compatible HTTP server in front of the pool",
                       description="OpenAI-compatible HTTP server (/v1/completions, "
                       "/v1/chat/completions, /v1/models) that submits each request as a job. "
                       "--priority is a ceiling, not only a default: a request may ask to run "
                       "later, never sooner.", formatter_class=HELP_FMT)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY",
                   help="accepted bearer keys (default $GENPOOL_API_KEYS, comma-separated; "
                        "none: no auth)")
    p.add_argument("--stored-keys", action="store_true",
                   help="also accept the keys of `genpool keys create` (hashed in Redis; each "
                        "names a tenant, its models, its priority ceiling; its tenant's limits "
                        "apply); a revoked one is refused within seconds")
    p.add_argument("--max-queue-depth", type=count, default=None,
                   help="answer 429 while more jobs than this wait for a worker (default: none: "
                        "no limit)")
    p.add_argument("--priority", type=int, default=CALLER_PRIORITY_CEILING,
                   help="priority ceiling: the most urgent priority a request may have (lower "
                        "runs sooner). "
                        "Requests that name none get it; a body asking for a lower value is "
                        "refused with 400, a higher (less urgent) one is kept (default: "
                        "%(default)s: the interactive lane, also genpool.generate's ceiling)")
    p.add_argument("--model", default=None,
                   help="model for requests that name none (default: none: such requests go to "
                        "any worker)")
    p.add_argument("--no-worker-grace", type=seconds, default=5.0, metavar="SECONDS",
                   help="answer 503 no_workers when no live worker serves the model for this long")
    p.add_argument("--no-worker-wait", type=seconds, default=60.0, metavar="SECONDS",  # gateway.NO_WORKER_WAIT_S
                   help="a request already queued answers 503 no_workers (its job cancelled) when "
                        "no live worker has served its model this long (default: %(default)s)")
    p.add_argument("--queue-without-workers", action="store_true",
                   help="queue requests even when no worker serves their model (they wait)")
    _gateway_limits(p)
    _batch_args(p)
    p.add_argument("--log-level", default="info",
                   help="uvicorn log level: critical, error, warning, info, debug, trace")
    add_connection_args(p)
    p.set_defaults(func=cmd_gateway)


def _gateway_limits(p) -> None:
    """Connection hygiene (docs/operations.md, "The gateway's limits"); defaults are the
    modules' own, written out so --help shows them without importing fastapi."""
    p.add_argument("--max-open", type=count, default=512, metavar="N",
                   help="completion requests in flight at once, streamed or not; past it: 503 "
                        "gateway_busy")
    p.add_argument("--max-open-per-client", type=count, default=32, metavar="N",
                   help="the same, per client (its API key when keys are set, else its address); "
                        "past it: 429 too_many_open_requests")
    p.add_argument("--header-timeout", type=positive_seconds, default=10.0, metavar="SECONDS",
                   help="close a connection whose request head is not complete this long after "
                        "it opened or its previous response ended")
    p.add_argument("--idle-timeout", type=positive_seconds, default=5.0, metavar="SECONDS",
                   help="close a keep-alive connection idle this long; answer 408 to a request "
                        "body that sends nothing for this long")
    p.add_argument("--send-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="drop a client that reads nothing of its response for this long, and "
                        "cancel its job")


def _batch_args(p) -> None:
    """The Files and Batch API (producer/openai_batches.py)."""
    p.add_argument("--max-file-bytes", type=count, default=64 << 20, metavar="N",
                   help="the largest /v1/files upload (files are kept in Redis)")
    p.add_argument("--files-max-bytes", type=count, default=512 << 20, metavar="N",
                   help="a tenant's uploaded files hold at most this many bytes (until deleted or "
                        "expired after 30 days); an upload past it is a 429")
    p.add_argument("--batch-window", type=positive_seconds, default=None, metavar="SECONDS",
                   help="how long a batch's completion_window ('24h') lasts here (default: what it "
                        "says; tests shorten it)")
    p.add_argument("--no-batch-driver", action="store_true",
                   help="serve the Batch API but run no batch driver here (other gateways drive "
                        "the batches)")
    p.add_argument("--batch-in-flight", type=count, default=256, metavar="N",
                   help="lines of one batch submitted and not yet answered, at most (a tenant's "
                        "batches feed the bulk lane earliest deadline first)")
    p.add_argument("--batch-max-active-bytes", type=count, default=256 << 20, metavar="N",
                   help="a tenant's batches not yet ended hold at most this many bytes of input "
                        "files; a create past it is a 429")
    p.add_argument("--batch-webhook", default=None, metavar="URL",
                   help="POST a signed event (OpenAI's shape) here when a batch ends; the key is "
                        "$GENPOOL_WEBHOOK_SECRET (default: none: no webhooks)")
    p.add_argument("--batch-webhook-tries", type=count, default=8, metavar="N",
                   help="tries before an event is dead-lettered")
    p.add_argument("--batch-webhook-backoff", type=seconds, default=1.0, metavar="SECONDS",
                   help="the first retry's delay (doubling after each failure)")


def _batch_options(a: argparse.Namespace):
    from .batch_webhooks import WebhookOptions
    from .openai_batches import BatchOptions

    if min(a.max_file_bytes, a.files_max_bytes, a.batch_in_flight, a.batch_max_active_bytes) < 1 or (
            a.batch_window is not None and not a.batch_window > 0):
        raise ValueError("--max-file-bytes, --files-max-bytes, --batch-in-flight, "
                         "--batch-max-active-bytes and --batch-window must be > 0")
    hook = None if a.batch_webhook is None else WebhookOptions(
        a.batch_webhook, value("GENPOOL_WEBHOOK_SECRET") or "", a.batch_webhook_tries,
        a.batch_webhook_backoff)
    return BatchOptions(window_s=a.batch_window, max_file_bytes=a.max_file_bytes,
                        drive=not a.no_batch_driver, webhook=hook, in_flight=a.batch_in_flight,
                        max_active_bytes=a.batch_max_active_bytes,
                        max_tenant_file_bytes=a.files_max_bytes)


def cmd_gateway(a: argparse.Namespace) -> int:
    import uvicorn

    from .gateway import create_app
    from .gateway_http import server_config

    keys = list(value("GENPOOL_API_KEYS", a.api_key or None))  # --api-key > $GENPOOL_API_KEYS
    try:
        app = create_app(a.redis, a.prefix, api_keys=keys, max_queue_depth=a.max_queue_depth,
                         priority=a.priority, default_model=a.model,
                         no_worker_grace_s=a.no_worker_grace, no_worker_wait_s=a.no_worker_wait,
                         queue_without_workers=a.queue_without_workers, max_open=a.max_open,
                         max_open_per_client=a.max_open_per_client,
                         idle_timeout_s=a.idle_timeout, stored_keys=a.stored_keys,
                         batch=_batch_options(a))
        config = server_config(app, a.host, a.port, header_timeout_s=a.header_timeout,
                               idle_timeout_s=a.idle_timeout, send_timeout_s=a.send_timeout,
                               log_level=a.log_level.lower())
    except ValueError as e:
        print(f"genpool gateway: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 3  # what uvicorn.run exits with when it cannot start
