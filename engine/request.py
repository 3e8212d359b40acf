"""A request: the prompt, its sampling parameters and its n sample sequences."""
from __future__ import annotations

import time

from genpool.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from genpool.engine.sequence import Sequence


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params,
                 priority: int, arrival_time: float | None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        now = time.monotonic()
        self.metrics = RequestMetrics(arrival_time=now if arrival_time is None else arrival_time)
        self.seqs: list[Sequence] = []
        self.error = None  # engine.outputs.RequestError when the engine failed this request
        self.seed: int | None = None  # the sampling seed (RequestOutput.seed)
        # prompt_logprobs asked: filled step by step as the prefill scores the prompt
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None]
        self._prompt_logprobs_sent = False

    def _prompt_logprobs(self, once: bool) -> list | None:
        """The prompt's logprobs once every prompt token is scored (None before); `once`: only
        the first time (deltas carry them once, with the output after the prompt)."""
        done = self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)
        if not done or (once and self._prompt_logprobs_sent):
            return None
        self._prompt_logprobs_sent |= once
        return list(self.prompt_logprobs)

    @property
    def finished(self) -> bool:
        # Children are forked before the parent's first token is processed, so while forks are
        # pending the parent is still running and this is False; an abort finishes them all.
        return all(s.is_finished for s in self.seqs)

    def delta_output(self, deltas: dict[int, CompletionOutput]) -> RequestOutput:
        """RequestOutput carrying only what changed this step (for streaming)."""
        outs = [deltas[i] for i in sorted(deltas)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.metrics, self.error, self.seed,
                             self._prompt_logprobs(once=True))

    def full_output(self) -> RequestOutput:
        """The whole output of every sample so far."""
        outs = []
        for s in sorted(self.seqs, key=lambda s: s.index):
            det = s.detokenizer
            outs.append(CompletionOutput(
                s.index, det.text if det else "", s.output_token_ids, s.finish_reason,
                list(s.logprobs) if self.params.logprobs is not None else None, s.stop_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.metrics, self.error, self.seed,
                             self._prompt_logprobs(once=False))
