"""The engine step's sampling stage: each sampling sequence's logits -> the tokens the scheduler's
update applies (engine/llm_engine.py's step, between the forward pass and the update).

A sampling sequence gets one of three things here:
  - a token drawn from its row; with n > 1, once the prompt is computed, the children split off
    and draw from their parent's row (the scheduler's update gives them the parent's blocks);
  - for a sequence that verifies a draft, the tokens the speculator accepts (engine/speculative.py);
  - nothing when max_tokens=0 (prompt_logprobs alone): end_unsampled ends its request.
A row the sampler finds non-finite, or a token a grammar rejects, fails that request alone.
The stage works on the engine's own request table, scheduler and counters, and makes sequences
and fails requests through the engine's callbacks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from genpool.engine.outputs import CompletionOutput, RequestError, RequestOutput
from genpool.engine.request import Request
from genpool.engine.sampler import Sampler, SampleRow
from genpool.engine.scheduler import SampledToken, Scheduler
from genpool.engine.sequence import Sequence, SequenceStatus
from genpool.engine.speculative import Speculator
from genpool.engine.structured import StructuredOutputs


@dataclass(eq=False)
class SampleStage:
    sampler: Sampler
    speculator: Speculator
    structured: StructuredOutputs
    scheduler: Scheduler
    requests: dict[str, Request]  # the engine's: a request that failed meanwhile is gone from it
    counters: dict  # the engine's; a request ended here counts in requests_finished
    eos_token_ids: tuple[int, ...]  # any of them ends a sequence; min_tokens bans them all
    new_seq: Callable[..., Sequence]  # LLMEngine._new_seq(req, index, parent=None)
    fail: Callable[[str, RequestError], None]  # LLMEngine._fail
    fail_step: Callable[[Sequence, Exception], None]  # LLMEngine._fail_step

    def sample(self, logits: torch.Tensor, sampling: list[Sequence],
               drafts: dict[Sequence, torch.Tensor], raw: torch.Tensor | None = None) -> list[SampledToken]:
        """`raw`: the logits before structured outputs' masks, for logprobs (None: `logits`)."""
        # max_tokens=0: nothing to sample (end_unsampled); a draft: verified by the speculator
        keep = [i for i, s in enumerate(sampling) if s.params.max_tokens != 0 and s not in drafts]
        if len(keep) != len(sampling):
            logits, sampling = logits[keep], [sampling[i] for i in keep]
            raw = raw[keep] if raw is not None else None
        verified = self.speculator.verify(self.sampler, drafts, self.row, self.fail_step)
        return self._sample_rows(logits, sampling, raw) + verified

    def _sample_rows(self, logits: torch.Tensor, sampling: list[Sequence],
                     raw: torch.Tensor | None) -> list[SampledToken]:
        rows, seqs, parents = self._expand_forks(sampling)
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:  # forks sample from their parent's row
            index = torch.tensor(rows)
            logits = logits.index_select(0, index)
            raw = raw.index_select(0, index) if raw is not None else None
        tokens, lps = self.sampler(logits, [self.row(s) for s in seqs], raw)
        for i, err in self.sampler.row_errors.items():  # non-finite rows: that request alone
            self.fail(seqs[i].request_id, err)
        for rid, message in self.structured.accept(seqs, tokens):  # each matcher takes its token
            self.fail(rid, RequestError("invalid_request", message))
        return [SampledToken(s, t, lp, fork_of=p) for s, t, lp, p in zip(seqs, tokens, lps, parents)
                if s.request_id in self.requests]

    def _expand_forks(self, sampling: list[Sequence]
                      ) -> tuple[list[int], list[Sequence], list[Sequence | None]]:
        """n > 1: once the prompt is computed, split the children off (the scheduler's update gives
        them the parent's blocks); they sample from the parent's logits row. Per sample: (its
        logits row, the sequence, its parent when it is a child split off now)."""
        rows, seqs, parents = [], [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            parents.append(None)
            req = self.requests.get(seq.request_id)
            if req is None:  # it failed this step (its first mask): no samples to split off
                seq.pending_forks = 0
            while seq.pending_forks:
                child = self.new_seq(req, req.params.n - seq.pending_forks, parent=seq)
                seq.pending_forks -= 1
                rows.append(i)
                seqs.append(child)
                parents.append(seq)
        return rows, seqs, parents

    def row(self, seq: Sequence) -> SampleRow:
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return SampleRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.seed, eos,
                         seq.index)

    def end_unsampled(self, sampling: list[Sequence]) -> list[RequestOutput]:
        """max_tokens=0 (prompt_logprobs alone): the request ends once its prompt is computed,
        with n empty completions and no token sampled (sample skips it)."""
        outs = []
        for seq in sampling:
            req = self.requests.get(seq.request_id)
            if seq.params.max_tokens != 0 or req is None or seq.is_finished:
                continue
            self.scheduler.finish(seq, "length")
            for i in range(1, seq.pending_forks + 1):  # n > 1: empty siblings, never scheduled
                sibling = self.new_seq(req, i)
                sibling.status, sibling.finish_reason = SequenceStatus.FINISHED, "length"
            seq.pending_forks = 0
            if not req.finished:  # resumed: its other sequences still compute their prompts
                continue
            req.metrics.first_token_time = req.metrics.finished_time = time.monotonic()
            del self.requests[seq.request_id]
            self.counters["requests_finished"] += 1
            outs.append(req.delta_output({i: CompletionOutput(i, "", [], "length")
                                          for i in range(req.params.n)}))
        return outs
