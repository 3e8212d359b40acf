"""Prefix-aware routing: the pure decision (no Redis, no engine), so it is tested exactly.

A worker that pulled a new entry asks: which live worker of the pool would finish this job at
the lowest cost? The cost of running a job on worker w, in prompt-token equivalents (on the CPUs
this runs on, prefill tokens are the dominant cost, and one unit the engines count exactly):

    cost(w) = miss(w) + wait(w)
    miss(w) = prompt tokens not covered by w's longest cached prefix (tokens w must compute)
    wait(w) = how long until w can start it: its hand-off backlog, plus one job when it has no
              free slot, times the cost of one such job there (`job_tokens`: the caller passes
              about what this job would cost at w, as queued jobs are there because w caches
              them), over its slots (continuous batching runs `slots` jobs at once)

The puller is one of the candidates. A job moves to a peer only when that saves at least
`min_gain_tokens` (so ties, short prompts and noise stay local: a hand-off is not free). An
interactive job (the high lane) stays with the worker that pulled it, which starts it at once
(it reads the high lane every step and preempts for it): a peer's free slots are known only as
of its last publish, and a burst handed to an affine peer on that stale view queued behind its
engine's slots (tests/test_routing_pool.py measured 6 steps to a first token instead of <= 3).
With `move_interactive` it may move, only to a peer with a free slot; a peer whose backlog is
at `max_backlog_jobs` takes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

AFFINITY, LOAD, FALLBACK = "affinity", "load", "fallback"
HOWS = (AFFINITY, LOAD, FALLBACK)


@dataclass(frozen=True)
class Candidate:
    name: str
    cached_tokens: int = 0  # this prompt's longest prefix cached there, in tokens
    free: int = 1  # jobs it can start now
    backlog_jobs: int = 0  # handed-off jobs waiting there, not started yet
    job_tokens: float = 0.0  # the cost of one job queued there, in tokens (the backlog's unit)
    slots: int = 1  # jobs it runs at once


@dataclass(frozen=True)
class RouteParams:
    min_gain_tokens: int = 64  # a hand-off must save at least this much
    max_backlog_jobs: int = 16  # a peer holding this many handed-off jobs takes no more
    default_job_tokens: float = 64.0  # a worker's per-job cost before it has run any job
    move_interactive: bool = False  # hand high-lane jobs to a peer with a free slot (see above)


@dataclass(frozen=True)
class Decision:
    target: str  # worker name (the local one: run here)
    how: str  # affinity | load | fallback (see route)
    handoff: bool
    cost: float = 0.0
    local_cost: float = 0.0


def wait_tokens(c: Candidate, p: RouteParams) -> float:
    per_job = c.job_tokens if c.job_tokens > 0 else p.default_job_tokens
    return per_job * (c.backlog_jobs + (0 if c.free > 0 else 1)) / max(1, c.slots)


def cost(c: Candidate, prompt_tokens: int, p: RouteParams) -> float:
    return max(0, prompt_tokens - c.cached_tokens) + wait_tokens(c, p)


def route(prompt_tokens: int, local: Candidate, peers: Sequence[Candidate], interactive: bool,
          p: Optional[RouteParams] = None, index_ok: bool = True) -> Decision:
    """Where one job should run. `peers` are the live, fresh, compatible workers other than the
    local one (stale or gone ones are left out by the caller); `index_ok` False means the index
    could not be read at all. How the decision is counted:
      affinity - it runs on a worker holding the longest cached prefix any candidate has (> 0);
      load     - no candidate caches any of it, or a less-cached worker won on load;
      fallback - the index was unreadable, or the best-cached worker could not take it (no free
                 slot for an interactive job, backlog full) and the job ran here.
    """
    p = p or RouteParams()
    local_cost = cost(local, prompt_tokens, p)
    if not index_ok:
        return Decision(local.name, FALLBACK, False, local_cost, local_cost)
    best_cached = max([local.cached_tokens] + [c.cached_tokens for c in peers])
    eligible = [c for c in peers if c.backlog_jobs < p.max_backlog_jobs
                and (not interactive or (p.move_interactive and c.free > 0))]
    best = min(eligible, key=lambda c: (cost(c, prompt_tokens, p), -c.cached_tokens, c.name),
               default=None)
    if best is not None and local_cost - cost(best, prompt_tokens, p) >= p.min_gain_tokens:
        how = AFFINITY if best.cached_tokens == best_cached > 0 else LOAD
        return Decision(best.name, how, True, cost(best, prompt_tokens, p), local_cost)
    if best_cached == 0 or local.cached_tokens == best_cached:
        how = AFFINITY if best_cached > 0 else LOAD
    elif any(c.cached_tokens == best_cached for c in eligible):
        how = LOAD  # an affine peer could take it, but it is busier than the gain
    else:
        how = FALLBACK  # the affine peer cannot take it now
    return Decision(local.name, how, False, local_cost, local_cost)
