"""The worker's stages without a Redis server: the job table, every way a job ends, and what each
claim answer means. (The end-to-end tests in this folder run the same code on a real Redis.)"""
from __future__ import annotations

import json
import math
import time

import pytest

from genpool.engine.resume import ResumeState
from genpool.schemas import Keys
from genpool.workers.admission import Admitter, prepare
from genpool.workers.intake import parse_entry
from genpool.workers.job import (
    ACK,
    DONE,
    LOST,
    RELEASED,
    Claim,
    End,
    Entry,
    Fence,
    Job,
    JobState,
    Outcome,
)
from genpool.workers.jobs import JobTable
from genpool.workers.lease import LeaseKeeper
from genpool.workers.observe import Observers
from genpool.workers.outbox import Outbox
from genpool.workers.takeover import Takeover
from tests.fake_engine import FakeEngine, expected_text

KEYS = Keys("unit")
_ids = iter(range(1, 10**6))


class Table:
    def __init__(self, engine=None):
        self.engine = engine or FakeEngine()
        self.outbox = Outbox(KEYS, "w1")
        self.keeper = LeaseKeeper(None, KEYS, "w1", 30_000, 1.0, lambda: None)  # never started
        self.counts = {"done": 0, "failed": 0, "lost": 0}
        self.jobs = JobTable(self.engine, self.outbox, self.keeper, None, KEYS, "w1",
                             Observers(), self.counts)

    def claimed(self, claim=Claim.RUN, **body) -> Job:
        """A job read, parsed, prepared and claimed, as admission leaves it."""
        n = next(_ids)
        doc = {"id": f"j{n}", "prompt": "hello", "max_tokens": 3, **body}
        entry = Entry(KEYS.jobs("normal"), "normal", f"{n}-0", {b"job": json.dumps(doc).encode()})
        self.keeper.hold(entry)
        job = prepare(self.engine, parse_entry(entry, frozenset({"fake"})))
        job.claim, job.fence = claim, Fence(f"w1/t{n}", 1) if claim.writes else None
        if job.fence is not None:
            self.keeper.grant(job)
        return job

    def ops(self, job: Job) -> list[tuple]:
        return [(op.kind, op.final[:1]) for op in self.outbox.ops if op.job is job]


def test_a_started_job_ends_once_with_its_result():
    t = Table()
    job = t.claimed()
    assert t.jobs.start(job) and job.state is JobState.RUNNING and len(t.jobs) == 1
    assert job.engine_id in t.engine.requests and job.max_len == job.prompt_tokens + 3
    t.jobs.finish(job, DONE, engine_ended=True)
    t.jobs.finish(job, DONE, engine_ended=True)  # a second end writes nothing
    assert t.ops(job) == [("final", ("done",))] and t.counts["done"] == 1
    assert not t.jobs and job.state is JobState.ENDED and not t.keeper.holds(job.entry)


def test_a_running_job_that_fails_is_aborted_and_counted():
    t = Table()
    job = t.claimed()
    t.jobs.start(job)
    t.jobs.finish(job, Outcome.failed("expired", "deadline passed"))
    assert job.engine_id not in t.engine.requests  # aborted: its KV blocks are free
    assert t.ops(job) == [("final", ("expired",))] and t.counts["failed"] == 1


def test_a_job_refused_before_it_ran_is_answered_but_not_counted():
    t = Table()
    job = t.claimed(Claim.CHECK, model="not-served")
    t.jobs.finish(job, Admitter.settle(job))
    assert t.ops(job) == [("final", ("error",))]
    assert t.counts == {"done": 0, "failed": 0, "lost": 0} and not t.keeper.holds(job.entry)


def test_a_lost_lease_writes_nothing_and_drops_queued_tokens():
    t = Table()
    job = t.claimed()
    t.jobs.start(job)
    t.outbox.token(job, job.add_delta(0, "a", [97], None, None))
    t.jobs.drop_lost([job.job_id])
    assert t.ops(job) == [] and t.counts["lost"] == 1 and job.engine_id not in t.engine.requests


def test_cancel_reaches_running_and_solo_queued_jobs():
    t = Table()
    running, solo = t.claimed(), t.claimed()
    t.jobs.start(running)
    t.jobs.queue_solo(solo)
    assert t.jobs.solo_busy and t.jobs.free(8, 4096, 16) == 0  # nothing else starts meanwhile
    t.jobs.cancel([running.job_id, solo.job_id, "unknown"])
    assert t.ops(running) == [("final", ("cancelled",))] == t.ops(solo)
    assert not t.jobs.solo and not t.jobs and t.counts["failed"] == 1  # only the running one


def test_release_all_hands_back_every_unfinished_job():
    t = Table()
    a, b = t.claimed(), t.claimed()
    t.jobs.start(a)
    t.jobs.queue_solo(b)
    t.jobs.release_all()
    assert t.ops(a) == [("release", ())] == t.ops(b) and not t.jobs and not t.jobs.solo


def test_an_engine_refusal_at_start_becomes_the_jobs_error():
    t = Table(FakeEngine(max_model_len=4))
    job = t.claimed(prompt="far too long a prompt")
    t.engine.add_request = lambda *a, **k: (_ for _ in ()).throw(ValueError("too long"))
    assert not t.jobs.start(job)
    assert t.ops(job) == [("final", ("error",))] and not t.jobs
    assert json.loads(t.outbox.ops[0].events[0])["code"] == "invalid_request"


def test_an_earlier_attempts_output_is_not_taken_for_the_rerun():
    t = Table()
    first = t.claimed()
    t.jobs.start(first)
    t.jobs.drop_lost([first.job_id])
    again = prepare(t.engine, parse_entry(first.entry, frozenset({"fake"})))
    again.claim, again.fence, again.attempt = Claim.RUN, Fence("w1/t2", 2), 2
    again.takeover = Takeover(restart="its log already ends")
    t.jobs.start(again)
    assert t.jobs.of_output(first.engine_id) is None
    assert t.jobs.of_output(again.engine_id) is again
    assert t.ops(again) == [("events", ())]  # the rerun's restart event
    assert json.loads(t.outbox.ops[-1].events[0])["type"] == "restart"


def _taken_over(t: Table, done_ids: list[int]) -> Job:
    job = t.claimed(max_tokens=8)
    job.fence, job.attempt = Fence("w1/t9", 2), 2
    text = "".join(chr(i) for i in done_ids)
    job.takeover = Takeover(resume=ResumeState(token_ids=[done_ids], seed=5),
                            texts={0: text}, ids={0: list(done_ids)}, first_token_at=12.5)
    return job


def test_a_taken_over_job_resumes_after_its_logs_tokens():
    t = Table()
    probe = t.claimed(max_tokens=8)
    own = [ord(ch) for ch in expected_text(probe.prompt["prompt_token_ids"], 8)[:3]]
    job = _taken_over(t, own)
    assert t.jobs.start(job) and t.engine.resumed == [(job.engine_id, 3)]
    (ev,) = [json.loads(op.events[0]) for op in t.outbox.ops if op.job is job]
    assert ev["type"] == "resume" and ev["tokens"] == [3] and ev["attempt"] == 2
    # the job holds what the log held: its result and usage count those tokens once
    assert job.ids == {0: own} and job.generated == 3 and job.first_token_at == 12.5
    assert job.recorded  # the log's first token already carries the model identity


def test_a_resume_the_engine_refuses_restarts_and_says_why():
    t = Table()
    job = _taken_over(t, [ord("z")] * 3)  # not what this engine would have written
    assert t.jobs.start(job) and t.engine.resumed == [] and job.generated == 0
    (ev,) = [json.loads(op.events[0]) for op in t.outbox.ops if op.job is job]
    assert ev["type"] == "restart" and "resume refused" in ev["reason"]


@pytest.mark.parametrize("claim,end", [
    (Claim.DUPLICATE, End.ACK), (Claim.FINISHED, End.ACK), (Claim.LEASED, End.HANDED_BACK),
    (Claim.CANCELLED, End.FAILED), (Claim.CHECK, End.FAILED), (Claim.DEAD, End.DEAD)])
def test_each_claim_answer_has_one_end(claim, end):
    t = Table()
    job = t.claimed(claim, **({"model": "not-served"} if claim is Claim.CHECK else {}))
    job.detail = "peer-1" if claim is Claim.LEASED else "charged too often"
    outcome = Admitter.settle(job)
    assert outcome.end is end
    if claim is Claim.CANCELLED:
        assert outcome.error.code == "cancelled"
    if claim is Claim.DEAD:
        assert outcome.reason == "charged too often"


def test_a_run_claim_starts_unless_its_deadline_passed():
    t = Table()
    assert Admitter.settle(t.claimed()) is None
    late = t.claimed(deadline=time.time() - 5)
    assert Admitter.settle(late).error.code == "expired"


def test_a_dead_letter_tells_the_reader_only_when_there_is_one():
    t = Table()
    junk = Job(Entry(KEYS.jobs("normal"), "normal", "9-0", {b"x": b"y"}), dead_reason="no job")
    t.jobs.finish(junk, Outcome(End.DEAD, reason="no job"))
    charged = t.claimed(Claim.DEAD)
    t.jobs.finish(charged, Outcome(End.DEAD, reason="charged too often"))
    assert t.ops(junk) == [("dead", ())]  # no id: only the dead-letter stream hears of it
    assert t.ops(charged) == [("final", ("dead",))]  # its reader gets dead_lettered
    assert [o.end for o in (ACK, LOST, RELEASED)] == [End.ACK, End.LOST, End.RELEASED]


def test_a_token_id_prompt_longer_than_the_model_is_refused_at_admission():
    """A prompt of token ids the model cannot hold is refused before routing hashes its blocks
    and the engine walks it (a 1M-id prompt held the loop thread), as a text prompt over its
    character bound already was."""
    t = Table()
    job = t.claimed(prompt=None, prompt_token_ids=[5] * (t.engine.max_model_len + 1))
    assert job.error is not None and job.error.code == "invalid_request"
    assert f"prompt is {t.engine.max_model_len + 1} tokens" in job.error.message
    assert t.claimed(prompt=None, prompt_token_ids=[5] * 8).error is None


def test_one_job_with_many_samples_does_not_shut_the_worker():
    """A job's KV bound counts its prompt once (its n samples share it) and at most half the
    cache: n=16 with the longest max_tokens counted n whole sequences, more than the cache, and
    the worker pulled nothing else until it ended (the engine shares, preempts and recomputes)."""
    from genpool.workers.jobs import blocks_needed, free_capacity

    t = Table()
    stats = t.engine.stats()
    kv_total, bs = stats.kv_blocks_total, stats.block_size
    long = t.claimed(n=16, max_tokens=10**6)
    assert t.jobs.start(long)
    assert free_capacity(stats, [long], 64, kv_total, bs) >= 1
    assert blocks_needed(long, bs, kv_total) == kv_total // 2
    small = t.claimed(max_tokens=3)
    assert t.jobs.start(small)
    assert blocks_needed(small, bs, kv_total) == math.ceil(small.max_len / bs)
    shared = t.claimed(prompt="hello " * 100, n=4, max_tokens=3)
    assert t.jobs.start(shared)
    whole = shared.prompt_tokens // bs
    assert whole >= 2 and blocks_needed(shared, bs, kv_total) == whole + 4 * (
        math.ceil(shared.max_len / bs) - whole)
