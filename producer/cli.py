"""`genpool submit` and `genpool status` (redis + pydantic only: no torch, no engine)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .config import ENV_PREFIX, ENV_URL


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", metavar="URL", default=None,
                   help=f"Redis URL (default: ${ENV_URL}, else redis://127.0.0.1:6379/0, else the "
                        "embedded server a worker started)")
    p.add_argument("--prefix", default=None, help=f"key prefix (default: ${ENV_PREFIX} or genpool)")


def register_submit(sub) -> None:
    p = sub.add_parser("submit", help="submit a job and stream its completion to the terminal")
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    p.add_argument("--system", default=None, help="system message (implies --chat)")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--priority", type=int, default=0, help="< 0 interactive lane, > 0 bulk lane")
    p.add_argument("--job-id", default=None)
    p.add_argument("--deadline-s", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--timeout", type=float, default=None, help="stop waiting after this long")
    p.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    p.add_argument("--json", action="store_true", help="print the final result as JSON")
    add_connection_args(p)
    p.set_defaults(func=cmd_submit)


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
    return kw


def cmd_submit(a: argparse.Namespace) -> int:
    from .client import Client

    client = Client(a.redis, a.prefix)
    try:
        job = client.submit(**_job_kwargs(a))
    except ValueError as e:
        print(f"genpool submit: {e}", file=sys.stderr)
        return 2
    if job.duplicate:
        print(f"job {job.id} already exists; showing its output", file=sys.stderr)
    if a.no_wait:
        print(job.id)
        return 0
    try:
        for ev in job.stream(timeout=a.timeout):
            if ev.type == "restart":
                print("\n[restarted]", file=sys.stderr)
            elif not a.json:
                print(ev.text, end="", flush=True)
        res = job.result(timeout=a.timeout)
    except KeyboardInterrupt:
        job.cancel()
        print(f"\ncancelled job {job.id}", file=sys.stderr)
        return 130
    except TimeoutError as e:
        print(f"\ngenpool submit: {e} (job {job.id} keeps running)", file=sys.stderr)
        return 3
    if a.json:
        print(res.model_dump_json(indent=2))
    elif res.error is None:
        t = res.timings
        print(f"\n[{res.finish_reason}; {res.usage.prompt_tokens} prompt + "
              f"{res.usage.completion_tokens} completion tokens; ttft {t.ttft_s or 0:.3f} s, "
              f"total {t.total_s:.3f} s; job {job.id}]", file=sys.stderr)
    if res.error is not None:
        print(f"\nerror ({res.error.code}): {res.error.message}", file=sys.stderr)
        return 1
    return 0


def register_status(sub) -> None:
    p = sub.add_parser("status", help="queue depth per lane, pending, workers, dead letters")
    p.add_argument("--json", action="store_true")
    add_connection_args(p)
    p.set_defaults(func=cmd_status)


def cmd_status(a: argparse.Namespace) -> int:
    from .client import Client
    from .status import format_status

    st = Client(a.redis, a.prefix).status()
    print(json.dumps(st, indent=2) if a.json else format_status(st))
    return 0
