"""What "exactly one result" means, checked on a job's raw event stream (shared by the chaos tests).

For every job: exactly one terminal event (`result` or `error`), and it is the last event; every
`token` event carries the attempt that wrote it, and after a `restart` or `resume` of attempt k
only attempt k writes (so two workers' tokens never interleave); a `resume` goes on after exactly
the tokens the log holds for each completion (nothing repeated, nothing skipped); the terminal
event is written by the last attempt. Lanes: nothing queued, nothing pending.
"""
from __future__ import annotations

from genpool.schemas import parse_event


def raw_events(client, job_id: str) -> list:
    return [parse_event(f["event"]) for _, f in client.redis.xrange(client.keys.events(job_id))]


def stream_problems(client, job_id: str) -> list[str]:
    events = raw_events(client, job_id)
    problems = []
    terminal = [i for i, e in enumerate(events) if e.type in ("result", "error")]
    if len(terminal) != 1:
        problems.append(f"{len(terminal)} terminal events")
    elif terminal[0] != len(events) - 1:
        problems.append(f"{len(events) - 1 - terminal[0]} events after the terminal one")
    current, counts = None, {}
    for e in events:
        if e.type == "token":
            counts[e.index] = counts.get(e.index, 0) + len(e.token_ids)
        if e.type == "restart":
            current, counts = e.attempt, {}
        elif e.type == "resume":
            current = e.attempt
            held = [counts.get(i, 0) for i in range(max(len(e.tokens), len(counts)))]
            if list(e.tokens) + [0] * (len(held) - len(e.tokens)) != held:
                problems.append(f"resume of attempt {e.attempt} after {e.tokens} tokens; the "
                                f"log holds {held}")
        elif current is None:
            current = e.attempt
        elif e.attempt != current:
            problems.append(f"{e.type} of attempt {e.attempt} after attempt {current} began")
            break
    return problems


def pool_problems(client, jobs) -> dict[str, list[str]]:
    """{job id: problems} for every job with one, plus lanes left with work ('lanes')."""
    out = {j.id: p for j in jobs if (p := stream_problems(client, j.id))}
    lanes = client.status()["lanes"]
    if any(v != {"queued": 0, "pending": 0} for v in lanes.values()):
        out["lanes"] = [str(lanes)]
    return out
