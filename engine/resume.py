"""Resume, not restart: continue a request from the tokens an earlier run already produced.

A worker that takes a job over passes what the job's event log holds:

    engine.add_request(rid, prompt, params, resume=ResumeState(token_ids=[[...], [...]], seed=s))

Each completion i becomes its own sequence holding prompt + token_ids[i] (no n > 1 fork: the
completions already differ). The scheduler prefills them as it recomputes a preempted sequence (the
prefix cache serves the prompt blocks it holds), and decoding goes on at the next position. Before
that, everything that depends on the tokens so far is replayed here, token by token, in the order
the live step applies it (Scheduler.update, then OutputProcessor._delta):
  - stop checks: eos / stop token ids after min_tokens, max_tokens counted over the whole job,
    the model's length, and stop strings, through a detokenizer primed with the resumed tokens (so a
    stop string spanning old and new tokens fires, and the text emitted after the resume is exactly
    the rest of the text);
  - penalties and min_tokens need nothing more: the sampler reads the sequence's output tokens;
  - the sampler's counter (engine/randomness.py) is keyed by the output length, so it continues at
    the resumed length;
  - logprobs: the sequence's list is aligned with its tokens (the resumed ones' entries are the
    ones given, or None);
  - a structured-output matcher is advanced over the resumed tokens once its grammar is compiled
    (engine/structured.py's poll): a grammar that rejects them fails the request ("resume refused").
A completion whose resumed tokens already end it (its eos, a stop string, max_tokens) is finished at
once; tokens that go on past such an end, ids out of the vocabulary, or more tokens than max_tokens
are refused with a ValueError at add_request: such a log is not one this engine could have written.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from genpool.engine.output_processor import new_detokenizer
from genpool.engine.outputs import CompletionOutput, RequestOutput
from genpool.engine.request import Request
from genpool.engine.sampling_params import SamplingParams
from genpool.engine.scheduler import Scheduler
from genpool.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ResumeState:
    """What an earlier run of a request produced, per completion index 0..n-1.

    token_ids: the token ids already published for each completion (n lists, maybe empty).
    seed: the seed the earlier run sampled with (RequestOutput.seed, recorded with the first
        token). Needed for an exact continuation of an unseeded sampled request; for a seeded one
        it must equal params.seed. Without it an unseeded request continues with a fresh seed:
        a valid sample given the prefix, not the text the earlier run would have written.
    logprobs: optionally, the logprob maps already published (one per resumed token), so that
        full_output() carries them; otherwise those positions hold None.
    """
    token_ids: list[list[int]]
    seed: int | None = None
    logprobs: list[list[dict[int, float] | None]] | None = field(default=None)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def check(resume: ResumeState, params: SamplingParams, vocab_size: int) -> None:
    """Refuse, with a ValueError naming the problem, a resume this engine could not have written.
    params must already have max_tokens capped to the model's length (limits.cap_max_tokens)."""
    if len(resume.token_ids) != params.n:
        raise ValueError(f"resume refused: {len(resume.token_ids)} completions' tokens given for "
                         f"n={params.n}")
    if resume.logprobs is not None and len(resume.logprobs) != params.n:
        raise ValueError(f"resume refused: logprobs given for {len(resume.logprobs)} completions, "
                         f"n={params.n}")
    for i, ids in enumerate(resume.token_ids):
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"resume refused: completion {i} has token {bad!r}, not an id in "
                             f"[0, {vocab_size})")
        if len(ids) > params.max_tokens:
            raise ValueError(f"resume refused: completion {i} has {len(ids)} tokens, more than "
                             f"max_tokens={params.max_tokens}")
        if resume.logprobs is not None and len(resume.logprobs[i]) != len(ids):
            raise ValueError(f"resume refused: completion {i} has {len(ids)} tokens but "
                             f"{len(resume.logprobs[i])} logprob entries")
    if params.seed is not None and resume.seed is not None and resume.seed != params.seed:
        raise ValueError(f"resume refused: recorded seed {resume.seed} differs from the "
                         f"request's seed {params.seed}")


def sampling_seed(params: SamplingParams, resume: ResumeState | None,
                  draw: Callable[[], int]) -> int | None:
    """The seed a request samples with: its own, the recorded one, or a fresh draw (None: greedy)."""
    if params.is_greedy:
        return None
    if params.seed is not None:
        return params.seed
    if resume is not None and resume.seed is not None:
        return resume.seed
    return draw()


def replay(seq: Sequence, tokens: list[int], scheduler: Scheduler, detokenizer) -> str | None:
    """Append the resumed tokens to seq as the live step would have, and return the finish reason
    they reach (None: the completion goes on). `detokenizer` is seq's fresh IncrementalDetokenizer."""
    seq.detokenizer = detokenizer
    reason = None
    for pos, tok in enumerate(tokens):
        if reason is not None:
            raise ValueError(f"resume refused: completion {seq.index} goes on after it ended "
                             f"({reason}) at token {pos - 1}")
        seq.append_token(tok)
        reason = scheduler.check_stop(seq, tok)
        if reason != "stop":  # eos and stop token ids add no text (OutputProcessor._delta)
            _, stop_str = detokenizer.add([tok])
            if stop_str is not None:
                seq.stop_reason, reason = stop_str, "stop"
    if reason is not None:
        detokenizer.flush()  # its text was published with the earlier run's last token
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
    return reason


def build_sequences(req: Request, resume: ResumeState, scheduler: Scheduler,
                    tokenizer) -> list[Sequence]:
    """One sequence per completion, holding its resumed tokens, every check replayed."""
    seqs = []
    for i, tokens in enumerate(resume.token_ids):
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.priority,
                       req.metrics.arrival_time, i)
        seq.seed = req.seed
        if req.params.logprobs is not None:  # aligned with the tokens
            seq.logprobs = list(resume.logprobs[i]) if resume.logprobs else [None] * len(tokens)
        replay(seq, tokens, scheduler, new_detokenizer(tokenizer, seq))
        seqs.append(seq)
    live = next((s for s in seqs if not s.is_finished), None)
    if req.params.prompt_logprobs is not None and seqs[0].is_finished and live is not None:
        seqs[0].scores_prompt, live.scores_prompt = False, True  # completion 0 runs no more
    return seqs


def finished_deltas(seqs: list[Sequence]) -> dict[int, CompletionOutput]:
    """The completions the resume found already finished, as deltas with no new tokens."""
    return {s.index: CompletionOutput(s.index, "", [], s.finish_reason, None, s.stop_reason)
            for s in seqs if s.is_finished}


def report_finished(pending: list[Request], requests: dict[str, Request],
                    counters: dict) -> list[RequestOutput]:
    """Completions a resume found finished are reported by the next step (no new tokens); a
    request with all of them finished ends there (it counts as unfinished until then).
    `pending`: the requests add_request resumed with finished completions since the last step;
    `requests`, `counters`: the engine's own (a finished request leaves the one, counts in the other)."""
    outs = []
    for req in pending:
        if requests.get(req.request_id) is not req:  # aborted or failed meanwhile
            continue
        outs.append(req.delta_output(finished_deltas(req.seqs)))
        if req.finished and requests.pop(req.request_id, None) is req:
            req.metrics.finished_time = time.monotonic()
            counters["requests_finished"] += 1
    return outs
