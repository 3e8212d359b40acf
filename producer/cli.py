"""`genpool submit` and `genpool status` (redis + pydantic only: no torch, no engine)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from genpool.schemas.config import HELP_FMT, add_connection_args, finite, positive_seconds, seconds

EXIT_FAILED, EXIT_TIMEOUT, EXIT_NO_WORKERS, EXIT_REDIS = 1, 3, 4, 5


def register_submit(sub) -> None:
    p = sub.add_parser("submit", help="submit a job and stream its completion to the terminal",
                       description="Submit one job and stream its tokens to stdout. With no live "
                       "worker for the model, says so at once and keeps waiting (the job stays "
                       "queued); --timeout bounds the wait (exit 4 when no worker served it, 3 "
                       "when one is still running it).", formatter_class=HELP_FMT)
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.add_argument("--system", default=None,
                   help="system message (implies --chat; default: none: the model's chat "
                        "template decides)")
    p.add_argument("--model", default=None,
                   help="model name a worker must serve (default: none: any worker takes it)")
    add_sampling_args(p)
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="constrain the output to JSON valid under this JSON schema file ('-': "
                        "stdin; default: none: free text)")
    p.add_argument("--regex", default=None,
                   help="constrain the output to match this regex (default: none: free text)")
    p.add_argument("--priority", type=int, default=0, help="< 0 interactive lane, > 0 bulk lane")
    p.add_argument("--job-id", default=None, help="job id (default: a new random one)")
    p.add_argument("--deadline-s", type=positive_seconds, default=None,
                   help="the job fails (error expired) after this many seconds (default: none: "
                        "no deadline)")
    p.add_argument("--timeout", type=seconds, default=None,
                   help="seconds to wait at most (default: none: wait until the job ends)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    p.add_argument("--json", action="store_true", help="print the final result as JSON")
    add_connection_args(p)
    p.set_defaults(func=cmd_submit)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """What `submit` sends as the job's sampling parameters (unset ones are not sent: the
    worker's defaults apply)."""
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="fewest tokens before a stop (default: none: not sent, so 0)")
    p.add_argument("--temperature", type=finite, default=None,
                   help="0 = greedy (default: none: not sent, so 1.0)")
    p.add_argument("--top-p", type=finite, default=None,
                   help="nucleus sampling mass (default: none: not sent, so 1.0: off)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest tokens (default: none: not sent, so -1: "
                        "off)")
    p.add_argument("--min-p", type=finite, default=None,
                   help="drop tokens below min_p x the top (default: none: not sent, so 0.0: "
                        "off)")
    p.add_argument("--repetition-penalty", type=finite, default=None,
                   help="> 1 discourages repeats (default: none: not sent, so 1.0: off)")
    p.add_argument("--presence-penalty", type=finite, default=None,
                   help="OpenAI presence penalty, -2..2 (default: none: not sent, so 0.0: off)")
    p.add_argument("--frequency-penalty", type=finite, default=None,
                   help="OpenAI frequency penalty, -2..2 (default: none: not sent, so 0.0: off)")
    p.add_argument("--seed", type=int, default=None,
                   help="per-request sampling seed (default: none: the worker's shared "
                        "generator, not reproducible)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable; default: none: stop only at end-of-text or "
                        "--max-tokens)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text")


def _job_kwargs(a: argparse.Namespace) -> dict:
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    kw: dict = {"model": a.model, "priority": a.priority, "job_id": a.job_id,
                "max_tokens": a.max_tokens}
    if a.chat or a.system:
        msgs = [{"role": "system", "content": a.system}] if a.system else []
        kw["messages"] = msgs + [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    for name in ("min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if a.ignore_eos:
        kw["ignore_eos"] = True
    if a.deadline_s is not None:
        kw["deadline"] = time.time() + a.deadline_s
    if a.json_schema is not None:
        kw["json_schema"] = _read_schema(a.json_schema)
    if a.regex is not None:
        kw["structured_outputs"] = {"regex": a.regex}
    return kw


def _read_schema(path: str) -> dict:
    """The schema file as a dict; ValueError (shown as usage error) when unreadable."""
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        schema = json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema must be a JSON object")
    return schema


def cmd_submit(a: argparse.Namespace) -> int:
    from .client import Client

    client = Client(a.redis, a.prefix)
    try:
        job = client.submit(**_job_kwargs(a))
    except ValueError as e:  # bad arguments, schema file or request
        print(f"genpool submit: {e}", file=sys.stderr)
        return 2
    if job.duplicate:
        print(f"job {job.id} already exists; showing its output", file=sys.stderr)
    if a.no_wait:
        print(job.id)
        return 0
    say_if_unserved(job)
    return follow(job, a.timeout, a.json, "submit")


def say_if_unserved(job, waiting: bool = True) -> None:
    """Tell at once when no live worker would take the job (it stays queued meanwhile)."""
    from .errors import no_worker_target, worker_command

    prefix = job.client.keys.prefix
    if not job.serving_workers():
        print(f"genpool: job {job.id} is queued, but no live worker serves "
              f"{no_worker_target(job.model, prefix)}; " + ("waiting (start one with "
              f"`{worker_command(job.model, prefix)}`, or Ctrl-C to cancel)" if waiting else
              f"it waits until one starts (`{worker_command(job.model, prefix)}`)"),
              file=sys.stderr)


def follow(job, timeout, as_json: bool, cmd: str) -> int:
    """Stream a job's tokens to stdout and its summary to stderr; the exit code says how it ended."""
    from .errors import NoWorkers, QueueUnavailable

    trimmed = 0
    try:
        for ev in job.stream(timeout=timeout, raise_on_error=False):
            if ev.type == "restart":
                print("\n[restarted]", file=sys.stderr)
            elif ev.type == "rewind":  # Redis lost the tail of the stream the reader had seen
                print(f"\n[rewound to token {ev.token_index} of completion {ev.index}: drop "
                      f"{ev.dropped_text!r}]", file=sys.stderr)
            elif ev.type == "trimmed":
                trimmed += ev.events
                print(f"\n[{ev.events} events were trimmed from the job's stream before they "
                      f"were read: text is missing here]", file=sys.stderr)
            elif not as_json:
                print(ev.text, end="", flush=True)
        res = job.result(timeout=timeout, raise_on_error=False)
    except KeyboardInterrupt:
        job.cancel()
        print(f"\ncancelled job {job.id}", file=sys.stderr)
        return 130
    except NoWorkers as e:
        print(f"\ngenpool {cmd}: {e}", file=sys.stderr)
        return EXIT_NO_WORKERS
    except QueueUnavailable as e:
        print(f"\ngenpool {cmd}: {e}", file=sys.stderr)
        return EXIT_REDIS
    except TimeoutError as e:
        print(f"\ngenpool {cmd}: {e} (job {job.id} is still {_state(job)}; "
              f"`genpool job show {job.id}` tells more)", file=sys.stderr)
        return EXIT_TIMEOUT
    if as_json:
        print(res.model_dump_json(indent=2))
    if res.error is not None and res.finish_reason != "cancelled":
        print(f"\nerror ({res.error.code}): {res.error.message}", file=sys.stderr)
        return EXIT_FAILED
    if not as_json:
        from .cli_jobs import end_summary

        print(f"\n[{end_summary(job, res)}; job {job.id}]", file=sys.stderr)
    if trimmed and not as_json:  # the result has it all: say where to get it
        print(f"[the text above misses {trimmed} trimmed events; `genpool job result {job.id}` "
              f"prints all of it]", file=sys.stderr)
    return 0


def _state(job) -> str:
    info = job.info()
    state = info.get("state", "unknown")
    return f"{state} on {info['worker']}" if info.get("worker") and state == "running" else state


def register_status(sub) -> None:
    p = sub.add_parser("status", help="queue depth per lane, pending, workers, dead letters",
                       description="Queue depth per lane, jobs in flight, live workers and the "
                       "models they serve, the latest dead letters.", formatter_class=HELP_FMT)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_connection_args(p)
    p.set_defaults(func=cmd_status)


def cmd_status(a: argparse.Namespace) -> int:
    from .client import Client
    from .status import format_status

    st = Client(a.redis, a.prefix).status()
    print(json.dumps(st, indent=2) if a.json else format_status(st))
    return 0
