"""LLMEngine: requests in, one scheduler -> model runner -> sampler step at a time, deltas out."""
from __future__ import annotations

import logging
import time

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.sampler import SampleRow, Sampler, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import load_tokenizer, read_eos_ids

log = logging.getLogger("genpool.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from engine.model_runner import ModelRunner
        from engine.models.loader import load_config
        from engine.models.registry import resolve_model

        self.config = config
        if config.num_threads and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model_path = resolve_model(config.model)
        args, _ = load_config(self.model_path)
        self.max_model_len = min(config.max_model_len or args.max_position_embeddings,
                                 args.max_position_embeddings)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = read_eos_ids(self.model_path, args, self.tokenizer)
        self.runner = ModelRunner(config, self.model_path, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.sampler = Sampler(make_generator(config.seed))
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._counters = dict(prompt_tokens_total=0, generation_tokens_total=0, step_count=0,
                              decode_steps=0, decode_time_total=0.0, requests_finished=0)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=model, **kwargs))

    # -- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.encode_prompt(prompt["prompt"])
        raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.runner.args.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; the model's limit is "
                             f"{self.max_model_len} including at least one generated token")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) + 1 > capacity:
            raise ValueError(f"prompt is {len(ids)} tokens but the KV cache holds only {capacity}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids = self.encode_prompt(prompt)
        self._check_prompt(ids)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone(max_tokens=room, min_tokens=min(params.min_tokens, room))
        req = Request(request_id, text, ids, params, priority, arrival_time)
        seq = self._new_seq(req, 0)
        seq.pending_forks = params.n - 1
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self._counters["prompt_tokens_total"] += len(ids)

    def _new_seq(self, req: Request, index: int, parent: Sequence | None = None) -> Sequence:
        if parent is None:
            seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.priority,
                           req.metrics.arrival_time, index)
        else:
            seq = parent.fork(index)
        if req.params.seed is not None:
            seq.generator = make_generator(req.params.seed + 7919 * index)
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop a request now: its blocks go back to the free list (prefix blocks stay cached)."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            deltas = {}
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    deltas[seq.index] = CompletionOutput(seq.index, "", [], "abort")
            self._aborted.append(req.delta_output(deltas))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        t0 = time.perf_counter()
        logits = self.runner.execute(sched.scheduled, sched.block_copies)
        self._note_step_time(sched, time.perf_counter() - t0)
        sampling = []
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
        rows_logits, seqs = self._expand_forks(logits, sampling)
        if seqs:
            tokens, lps = self.sampler(rows_logits, [self._row(s) for s in seqs])
            outputs.extend(self._process(seqs, tokens, lps))
        return outputs

    def _expand_forks(self, logits: torch.Tensor, sampling: list[Sequence]):
        """n > 1: once the prompt is computed, fork the children; they share every prompt block
        (copy-on-write later) and sample from the same logits row."""
        rows, seqs = [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            while seq.pending_forks:
                req = self.requests[seq.request_id]
                child = self._new_seq(req, req.params.n - seq.pending_forks, parent=seq)
                seq.pending_forks -= 1
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
                rows.append(i)
                seqs.append(child)
        if len(rows) == logits.shape[0]:  # no fork this step: rows are 0..N-1 already
            return logits, seqs
        return logits.index_select(0, torch.tensor(rows)), seqs

    def _row(self, seq: Sequence) -> SampleRow:
        eos = None if seq.params.ignore_eos else self.eos_token_ids[0]
        return SampleRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, eos)

    def _process(self, seqs, tokens, lps) -> list[RequestOutput]:
        now = time.monotonic()
        per_req: dict[str, dict[int, CompletionOutput]] = {}
        for seq, tok, lp in zip(seqs, tokens, lps):
            req = self.requests.get(seq.request_id)
            if req is None or seq.is_finished:
                continue
            seq.append_token(tok)
            self._counters["generation_tokens_total"] += 1
            if lp is not None:
                seq.logprobs.append(lp)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
            per_req.setdefault(seq.request_id, {})[seq.index] = self._advance(seq, tok, lp)
        outs = []
        for rid, deltas in per_req.items():
            req = self.requests[rid]
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[rid]
                self._counters["requests_finished"] += 1
            outs.append(req.delta_output(deltas))
        return outs

    def _advance(self, seq: Sequence, tok: int, lp) -> CompletionOutput:
        """Detokenize the new token and decide whether the sample is done."""
        p = seq.params
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens, p.stop,
                p.include_stop_str_in_output, min_tokens=p.min_tokens)
        reason = None
        if not p.ignore_eos and tok in self.eos_token_ids and seq.num_output_tokens > p.min_tokens - 1:
            reason = "stop"
            text = ""
        elif tok in p.stop_token_ids and seq.num_output_tokens >= p.min_tokens:
            reason, seq.stop_reason = "stop", tok
            text = ""
        else:
            text, stop_str = seq.detokenizer.add([tok])
            if stop_str is not None:
                reason, seq.stop_reason = "stop", stop_str
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            text += seq.detokenizer.flush()  # "" when a stop string already ended the text
            self.scheduler.finish(seq, reason)
        return CompletionOutput(seq.index, text, [tok], reason, [lp] if lp is not None else None,
                                seq.stop_reason)

    def _note_step_time(self, sched, dt: float) -> None:
        self._counters["step_count"] += 1
        if all(n == 1 for _, n in sched.scheduled):
            self._counters["decode_steps"] += 1
            self._counters["decode_time_total"] += dt

    def stats(self) -> dict:
        bm, sch, c = self.block_manager, self.scheduler, self._counters
        return dict(
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            free_seq_slots=max(0, sch.max_num_seqs - len(sch.running) - len(sch.waiting)),
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=sch.num_preemptions, num_requests=len(self.requests),
            decode_step_time_mean=c["decode_time_total"] / c["decode_steps"] if c["decode_steps"] else None,
            **{k: v for k, v in c.items() if k not in ("decode_time_total",)},
        )
