"""Sampled tokens -> RequestOutput deltas: logprobs, first-token metrics, incremental
detokenization with stop strings, and the end of finished requests (the engine step's last stage,
after the scheduler's update)."""
from __future__ import annotations

import logging
import time
from typing import Callable

from genpool.engine.detokenizer import IncrementalDetokenizer
from genpool.engine.outputs import CompletionOutput, RequestError, RequestOutput
from genpool.engine.request import Request
from genpool.engine.scheduler import SampledToken, Scheduler
from genpool.engine.sequence import Sequence

log = logging.getLogger("genpool.engine")


def new_detokenizer(tokenizer, seq: Sequence) -> IncrementalDetokenizer:
    """A sample's detokenizer (made at its first token, or primed by a resume: engine/resume.py)."""
    p = seq.params
    return IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, p.skip_special_tokens, p.stop,
                                  p.include_stop_str_in_output, min_tokens=p.min_tokens)


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler, requests: dict[str, Request],
                 counters: dict, fail: Callable[[str, RequestError], None]):
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.requests, self.counters, self.fail = requests, counters, fail  # the engine's own

    def outputs(self, applied: list[SampledToken]) -> list[RequestOutput]:
        now = time.monotonic()
        per_req: dict[str, dict[int, CompletionOutput]] = {}
        # a sequence that verified a draft has several tokens here: its text is flushed after
        # its last one, and a stop string drops the tokens after the one that completes it
        last = {id(s.seq): k for k, s in enumerate(applied)}
        cut: dict[int, list] = {}  # id(seq) -> [seq, tokens dropped after its stop string]
        for k, s in enumerate(applied):
            seq, req = s.seq, self.requests.get(s.seq.request_id)
            if req is None:  # failed after another of its samples was applied
                continue
            if id(seq) in cut:
                cut[id(seq)][1] += 1
                continue
            self.counters["generation_tokens_total"] += 1
            if s.logprob is not None:
                seq.logprobs.append(s.logprob)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
            try:
                delta, stopped = self._delta(s, final=k == last[id(seq)])
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer bug on one token
                log.exception("request %s failed after its token %d", seq.request_id, s.token)
                self.fail(seq.request_id, RequestError(
                    "internal", f"processing token {s.token} failed: {type(exc).__name__}: {exc}"))
                continue
            if stopped and k != last[id(seq)]:
                cut[id(seq)] = [seq, 0]
            deltas = per_req.setdefault(seq.request_id, {})
            deltas[seq.index] = _join(deltas.get(seq.index), delta)
        for seq, dropped in cut.values():
            del seq.token_ids[len(seq.token_ids) - dropped:]
        outs = []
        for rid, deltas in per_req.items():
            req = self.requests.get(rid)
            if req is None:  # failed after another of its samples had a delta
                continue
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[rid]
                self.counters["requests_finished"] += 1
            outs.append(req.delta_output(deltas))
        return outs

    def _delta(self, s: SampledToken, final: bool = True) -> tuple[CompletionOutput, bool]:
        """The new token's text; a stop string ends the sample ("stop" beats the scheduler's
        "length"): then True. `final`: the sample's last token this step."""
        seq, tok, lp = s.seq, s.token, s.logprob
        if seq.detokenizer is None:
            seq.detokenizer = new_detokenizer(self.tokenizer, seq)
        text, stopped = "", False
        if s.finish_reason != "stop":  # eos and stop token ids add no text
            text, stop_str = seq.detokenizer.add([tok])
            if stop_str is not None:
                seq.stop_reason, stopped = stop_str, True
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
        if seq.is_finished and (final or stopped):
            text += seq.detokenizer.flush()  # "" when a stop string already ended the text
        return CompletionOutput(seq.index, text, [tok], seq.finish_reason if final or stopped else None,
                                [lp] if lp is not None else None, seq.stop_reason), stopped


def _join(a: CompletionOutput | None, b: CompletionOutput) -> CompletionOutput:
    """Two deltas of one sample in one step (a verified draft) as one."""
    if a is None:
        return b
    lps = (a.logprobs or []) + (b.logprobs or [])
    return CompletionOutput(b.index, a.text + b.text, a.token_ids + b.token_ids, b.finish_reason,
                            lps or None, b.stop_reason)
