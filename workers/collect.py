"""One engine step's outputs, turned into what the job's reader sees.

For every `RequestOutput` of a step (`Worker.step_and_publish`, workers/worker.py) the collector
finds the job, turns each completion's delta into a token event in the outbox (with the prompt's
scores, token texts and, once per job, the identity a taking-over worker must know), and ends
the job in the job table when the engine finished or failed it. It writes nothing to Redis: the
outbox's writes go out in the step's one MULTI.
"""
from __future__ import annotations

import logging
from collections import deque

from genpool.engine.outputs import RequestOutput
from genpool.workers.job import DONE, Outcome
from genpool.workers.jobs import JobTable
from genpool.workers.observe import Observers
from genpool.workers.outbox import Outbox

log = logging.getLogger("genpool.worker")


class OutputCollector:
    """The loop thread's hand from engine outputs to job events and job ends."""

    def __init__(self, jobs: JobTable, outbox: Outbox, observers: Observers,
                 step_ends: deque[float]):
        self.jobs, self.outbox, self.observers = jobs, outbox, observers
        self.step_ends = step_ends  # the worker's: wall-clock end of recent steps (ttft_steps)

    def collect(self, out: RequestOutput) -> None:
        job = self.jobs.of_output(out.request_id)
        if job is None:
            return
        if out.prompt_token_ids:
            job.prompt_tokens = len(out.prompt_token_ids)
        if out.error is not None:  # the engine failed this request alone (e.g. its grammar did
            # not compile, or its parameters made its logits non-finite); the batch ran on
            log.warning("job %s failed in the engine: %s", job.id, out.error.message)
            self.jobs.finish(job, Outcome.failed(out.error.code, out.error.message),
                             engine_ended=True)
            return
        if out.prompt_logprobs is not None:
            job.prompt_scores = self.jobs.prompt_scores(out.prompt_token_ids, out.prompt_logprobs,
                                                     out.prompt)
        for c in out.outputs:
            ev = job.add_delta(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs)
            if ev is not None:
                if c.index == 0 and out.prompt_logprobs is not None:  # streamed echo reads it
                    ev.prompt = job.prompt_scores
                if ev.logprobs:  # their tokens' texts, for readers without the tokenizer
                    ev.token_texts = self.jobs.token_texts(ev.logprobs)
                    job.token_texts.update(ev.token_texts)
                if not job.recorded:  # what a worker that takes the job over must know
                    ev.model_identity, ev.seed, job.recorded = self.jobs.identity_doc, out.seed, True
                if job.ttft_steps is None and not job.resumed:  # engine steps since arrival
                    job.ttft_steps = sum(t > job.entry.enqueued_at for t in self.step_ends)
                self.outbox.token(job, ev)
                self.observers.emit("job_token", job, ev)
        if out.finished:
            self.jobs.finish(job, DONE, engine_ended=True)
