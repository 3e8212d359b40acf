"""LLMEngine: requests in, one scheduler -> model runner -> sampler step at a time, deltas out."""
from __future__ import annotations

import dataclasses
import logging
import random
import time
import weakref

import torch

from genpool.engine import isolation, limits, prompt_logprobs, step_rows
from genpool.engine import resume as resume_mod
from genpool.engine.block_manager import BlockManager
from genpool.engine.config import EngineConfig
from genpool.engine.cpu_alloc import trim_heap
from genpool.engine.identity import ModelIdentity, model_identity
from genpool.engine.output_processor import OutputProcessor
from genpool.engine.outputs import CompletionOutput, RequestError, RequestOutput
from genpool.engine.protocol import EngineStats
from genpool.engine.request import Request
from genpool.engine.resume import ResumeState
from genpool.engine.sampler import Sampler, SampleRow, make_generator
from genpool.engine.sampling_params import SamplingParams
from genpool.engine.scheduler import SampledToken, Scheduler
from genpool.engine.sequence import Sequence, SequenceStatus
from genpool.engine.speculative import Speculator
from genpool.engine.startup import StartLog, mib
from genpool.engine.structured import StructuredOutputs
from genpool.engine.tokenizer import load_tokenizer, read_eos_ids

log = logging.getLogger("genpool.engine")
TRIM_AFTER_TOKENS = 512


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from genpool.engine.model_runner import ModelRunner
        from genpool.engine.models.loader import load_config
        from genpool.engine.models.registry import resolve_model

        config = dataclasses.replace(config, device=config.resolved_device())  # "auto" decided once
        self.config = config
        if config.num_threads and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        self.startup = StartLog()
        self.model_path = resolve_model(config.model)
        self.startup.phase("model resolved", str(self.model_path))
        args, _ = load_config(self.model_path)
        self.max_model_len = min(config.max_model_len or args.max_position_embeddings,
                                 args.max_position_embeddings)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = read_eos_ids(self.model_path, args, self.tokenizer)
        self.startup.phase("tokenizer loaded", f"vocab {args.vocab_size}")
        runner_cls = ModelRunner
        if config.tensor_parallel_size > 1:  # rank 0 here; ranks 1.. in their own processes
            from genpool.engine.tp_runner import LeaderRunner as runner_cls
        self.runner = runner_cls(config, self.model_path, self.max_model_len, startup=self.startup)
        try:  # no sequence longer than the cache (engine/limits.py)
            self.max_model_len = limits.fit_to_cache(self.max_model_len, config.max_model_len,
                                                     self.runner.num_blocks, config.block_size)
        except ValueError:
            self.runner.close()  # tensor-parallel ranks too
            raise
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.eos_token_ids, self.max_model_len)
        self.sampler = Sampler(make_generator(config.seed))
        self.speculator = Speculator(config.spec_config(), self.max_model_len)
        # unseeded sampled requests get a seed from here at admission (reported as
        # RequestOutput.seed, so a resume can reuse it); config.seed keeps a run reproducible
        self._seed_source = random.Random(config.seed)
        self._identity: ModelIdentity | None = None
        self._resumed: list[Request] = []  # resumed with finished completions: reported next step
        self.structured = StructuredOutputs(self.tokenizer, self.runner.args.vocab_size,
                                            self.eos_token_ids[0], config.grammar_compile_timeout_s)
        self.scheduler.is_ready = self.structured.is_ready  # constrained jobs wait for their grammar
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._failed: list[RequestOutput] = []  # requests the engine failed this step
        self._counters = dict(prompt_tokens_total=0, generation_tokens_total=0, step_count=0,
                              decode_steps=0, decode_time_total=0.0, requests_finished=0)
        self._big_steps = False  # a step of >= TRIM_AFTER_TOKENS tokens ran since the last trim
        self.output = OutputProcessor(self.tokenizer, self.scheduler, self.requests, self._counters,
                                      self._fail)
        self.closed = False
        if config.tensor_parallel_size > 1:  # a later engine may close this one once it is gone
            self.runner.owner = weakref.ref(self)
        self.startup.done()

    def describe(self) -> str:
        """Device, dtype, kernel backend and KV capacity, and where each environment-backed
        setting came from (explicit, env or default), for the one line a worker logs at start."""
        r, bm = self.runner, self.block_manager
        return (f"device={r.device} dtype={self.config.dtype} kernels={r.kern.name} "
                f"kv_blocks={bm.num_blocks}x{bm.block_size} ({bm.num_blocks * bm.block_size} tokens, "
                f"{mib(bm.num_blocks * r.bytes_per_block)}) max_model_len={self.max_model_len}; "
                f"settings: {self.config.settings_report()}")

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

    def model_identity(self) -> ModelIdentity:
        """What the output depends on besides the request (engine/identity.py); computed once."""
        if self._identity is None:
            self._identity = model_identity(self.config, self.model_path, self.tokenizer)
        return self._identity

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    resume: ResumeState | None = None) -> None:
        """Queue a request. `resume`: the tokens an earlier run of it already produced, per
        completion; decoding continues after them (engine/resume.py). ValueError: refused."""
        params = params or SamplingParams()
        if self.closed:
            raise RuntimeError("the engine is closed")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        text, ids = self.encode_prompt(prompt)
        vocab, bm = self.runner.args.vocab_size, self.block_manager
        limits.check_prompt(ids, vocab, self.max_model_len, bm.num_blocks * bm.block_size)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got "
                             f"{max(params.logit_bias)}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got "
                             f"{max(params.stop_token_ids)}")
        params = limits.cap_max_tokens(params, len(ids), self.max_model_len)
        if resume is not None:
            resume_mod.check(resume, params, vocab)
        req = Request(request_id, text, ids, params, priority, arrival_time)
        req.seed = resume_mod.sampling_seed(params, resume,
                                            lambda: self._seed_source.getrandbits(63))
        if resume is None:
            seq = self._new_seq(req, 0)
            seq.pending_forks = params.n - 1
        else:
            # may refuse (ValueError) before anything is queued
            req.seqs = resume_mod.build_sequences(req, resume, self.scheduler, self.tokenizer)
        self.requests[request_id] = req
        for seq in req.seqs:
            if seq.is_finished:  # the resumed tokens already ended it
                continue
            self.scheduler.add(seq)
            if params.structured_outputs is not None:
                self.structured.track(seq)  # compiles in the background; seq waits until ready
        self._counters["prompt_tokens_total"] += len(ids)  # once, resumed or not
        if any(s.is_finished for s in req.seqs):
            self._resumed.append(req)

    def _take_resumed(self) -> list[RequestOutput]:
        """Completions a resume found finished are reported by the next step (no new tokens); a
        request with all of them finished ends there (it counts as unfinished until then)."""
        outs, pending, self._resumed = [], self._resumed, []
        for req in pending:
            if self.requests.get(req.request_id) is not req:  # aborted or failed meanwhile
                continue
            outs.append(req.delta_output(resume_mod.finished_deltas(req.seqs)))
            if req.finished and self.requests.pop(req.request_id, None) is req:
                req.metrics.finished_time = time.monotonic()
                self._counters["requests_finished"] += 1
        return outs

    def _new_seq(self, req: Request, index: int, parent: Sequence | None = None) -> Sequence:
        if parent is None:
            seq = Sequence(req.request_id, req.prompt_token_ids, req.params, req.priority,
                           req.metrics.arrival_time, index)
        else:
            seq = parent.fork(index)
            self.structured.fork(parent, seq)  # each sample its own matcher
        seq.seed = req.seed  # the index is part of each draw's key: n samples differ
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

    def close(self) -> None:
        """Stop the engine for good: tensor-parallel ranks stopped, grammar threads ended, weights
        and KV cache freed. Unfinished requests are dropped. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.requests.clear()
        self.structured.close()
        self.runner.close()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> sample -> update (the scheduler's bookkeeping) -> outputs."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        for rid, message in self.structured.poll():  # grammars compiled (or refused) since the last step
            self._fail(rid, RequestError("invalid_request", message))
        outputs, self._aborted = self._aborted, []
        outputs += self._take_resumed()
        self.speculator.draft(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._release_heap()
            self.structured.wait_pending(0.01)  # only jobs waiting for a grammar: do not spin
            return self._take_failed(outputs)
        masks = self.structured.start_masks(sched.sampling)  # filled while the model computes
        n = len(sched.scheduled)
        logits, drafts = self._run(sched)
        if len(sched.scheduled) != n:  # fault isolation narrowed the batch: renumber mask rows
            masks = self.structured.start_masks(sched.sampling)
        for rid, message in self.structured.apply_masks(masks, logits):
            self._fail(rid, RequestError("invalid_request", message))
        sampled = self._sample(logits, sched.sampling, drafts)
        applied = self.scheduler.update(sched, sampled)
        outputs.extend(self.output.outputs(applied))
        outputs.extend(self._end_unsampled(sched.sampling))
        if not self.requests:  # the last request just finished: the engine is idle from here on
            self._release_heap()
        return self._take_failed(outputs)

    def _take_failed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        outputs.extend(self._failed)
        self._failed = []
        return outputs

    def _run(self, sched) -> tuple[torch.Tensor, dict]:
        """The forward pass -> one logits row per sampling sequence, and {seq: its rows} for
        those that verify a draft (prompt rows scored on the way)."""
        t0 = time.perf_counter()
        try:
            out = self.runner.execute(sched.scheduled, sched.block_copies)
            scores, samples = self._split(sched.scheduled, out)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it must not fail the whole batch
            scores, samples = self._isolate(sched, exc)
        self._score_prompts(sched.scheduled, scores)
        self._big_steps |= sched.num_batched_tokens >= TRIM_AFTER_TOKENS
        self._note_step_time(sched, time.perf_counter() - t0)
        if isinstance(samples, torch.Tensor):  # the usual step: every row is a sampled one
            return samples, {}
        drafts = {seq: r for (seq, _), r in zip(sched.scheduled, samples)
                  if r is not None and r.shape[0] > 1}
        rows = [r[0] for r in samples if r is not None]
        return (torch.stack(rows) if rows else torch.empty(0, self.runner.args.vocab_size)), drafts

    @staticmethod
    def _split(scheduled, logits: torch.Tensor) -> tuple[list, torch.Tensor | list]:
        """The runner's rows -> (per entry its prompt-scoring rows or None, and either the
        sampled rows as they are or, when some entry keeps more, per entry its rows or None)."""
        if not any(seq.draft or seq.prompt_score_rows(n) for seq, n in scheduled):
            return [None] * len(scheduled), logits
        return step_rows.split(scheduled, logits)

    def _score_prompts(self, scheduled, scores: list) -> None:
        for (seq, n), rows in zip(scheduled, scores):
            req = self.requests.get(seq.request_id)
            if rows is not None and req is not None:
                req.prompt_logprobs += prompt_logprobs.score(seq, n, rows, req.params.prompt_logprobs)

    def _end_unsampled(self, sampling: list[Sequence]) -> list[RequestOutput]:
        """max_tokens=0 (prompt_logprobs alone): the request ends once its prompt is computed,
        with n empty completions and no token sampled (_sample skips it)."""
        outs = []
        for seq in sampling:
            req = self.requests.get(seq.request_id)
            if seq.params.max_tokens != 0 or req is None or seq.is_finished:
                continue
            self.scheduler.finish(seq, "length")
            for i in range(1, seq.pending_forks + 1):  # n > 1: empty siblings, never scheduled
                sibling = self._new_seq(req, i)
                sibling.status, sibling.finish_reason = SequenceStatus.FINISHED, "length"
            seq.pending_forks = 0
            if not req.finished:  # resumed: its other sequences still compute their prompts
                continue
            req.metrics.first_token_time = req.metrics.finished_time = time.monotonic()
            del self.requests[seq.request_id]
            self._counters["requests_finished"] += 1
            outs.append(req.delta_output({i: CompletionOutput(i, "", [], "length")
                                          for i in range(req.params.n)}))
        return outs

    def _release_heap(self) -> None:
        """Idle after large steps: return their freed activation buffers to the system (the
        allocator is told never to on its own, so busy steps reuse them; engine/cpu_alloc.py)."""
        if self._big_steps and self.runner.device.type == "cpu":
            trim_heap()
        self._big_steps = False

    # -- fault isolation -------------------------------------------------------------------
    def _isolate(self, sched, exc: Exception) -> tuple[list, list]:
        """The forward pass raised: engine/isolation.py runs the step again in halves and fails the
        request(s) that make it fail on their own; sched.scheduled and sched.sampling are narrowed
        to everyone else, whose logits come back."""
        log.warning("engine step failed for a batch of %d (%s: %s); isolating the cause",
                    len(sched.scheduled), type(exc).__name__, exc)
        parts = isolation.bisect(self.runner.execute, sched.scheduled, exc, self._fail_step)
        live = [(seq, n, score, rows) for part, per in parts
                for (seq, n), (score, rows) in zip(part, per) if seq.request_id in self.requests]
        sched.scheduled = [(seq, n) for seq, n, _, _ in live]
        sched.sampling = [seq for seq, _, _, rows in live if rows is not None]
        return [score for _, _, score, _ in live], [rows for _, _, _, rows in live]

    def _fail_step(self, seq: Sequence, exc: Exception) -> None:
        self._fail(seq.request_id, RequestError(
            "internal", f"the model step failed for this request: {type(exc).__name__}: {exc}"))

    def _fail(self, request_id: str, error: RequestError) -> None:
        """End one request with an error; the rest of the batch is untouched. Its blocks leave
        the prefix cache too (seq.num_computed_tokens = 0): their K/V may be what failed."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        log.info("request %s failed: %s", request_id, (error.message or "").split("\n", 1)[0])
        sch = self.scheduler
        for seq in req.seqs:
            if seq.is_finished:
                continue
            if seq in sch.running or seq in sch.waiting:
                seq.num_computed_tokens = 0
                sch.finish(seq, "abort")
            else:  # an n > 1 child not joined yet: it holds no block references to free
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        req.error = error
        self._failed.append(req.delta_output({}))

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence],
                drafts: dict) -> list[SampledToken]:
        # max_tokens=0: nothing to sample (_end_unsampled); a draft: verified by the speculator
        keep = [i for i, s in enumerate(sampling) if s.params.max_tokens != 0 and s not in drafts]
        if len(keep) != len(sampling):
            logits, sampling = logits[keep], [sampling[i] for i in keep]
        verified = self.speculator.verify(self.sampler, drafts, self._row, self._fail_step)
        return self._sample_rows(logits, sampling) + verified

    def _sample_rows(self, logits: torch.Tensor, sampling: list[Sequence]) -> list[SampledToken]:
        rows, seqs, parents = self._expand_forks(sampling)
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:  # forks sample from their parent's row
            logits = logits.index_select(0, torch.tensor(rows))
        tokens, lps = self.sampler(logits, [self._row(s) for s in seqs])
        for i, err in self.sampler.row_errors.items():  # non-finite rows: that request alone
            self._fail(seqs[i].request_id, err)
        for rid, message in self.structured.accept(seqs, tokens):  # each matcher takes its token
            self._fail(rid, RequestError("invalid_request", message))
        return [SampledToken(s, t, lp, fork_of=p) for s, t, lp, p in zip(seqs, tokens, lps, parents)
                if s.request_id in self.requests]

    def _expand_forks(self, sampling: list[Sequence]):
        """n > 1: once the prompt is computed, split the children off (the scheduler's update gives
        them the parent's blocks); they sample from the parent's logits row."""
        rows, seqs, parents = [], [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            parents.append(None)
            while seq.pending_forks:
                req = self.requests[seq.request_id]
                child = self._new_seq(req, req.params.n - seq.pending_forks, parent=seq)
                seq.pending_forks -= 1
                rows.append(i)
                seqs.append(child)
                parents.append(seq)
        return rows, seqs, parents

    def _row(self, seq: Sequence) -> SampleRow:
        eos = None if seq.params.ignore_eos else self.eos_token_ids[0]
        return SampleRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.seed, eos,
                         seq.index)

    def _note_step_time(self, sched, dt: float) -> None:
        self._counters["step_count"] += 1
        if all(n == 1 for _, n in sched.scheduled):
            self._counters["decode_steps"] += 1
            self._counters["decode_time_total"] += dt

    def stats(self) -> EngineStats:
        bm, sch, c = self.block_manager, self.scheduler, self._counters
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            free_seq_slots=max(0, sch.max_num_seqs - len(sch.running) - len(sch.waiting)),
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=sch.num_preemptions, num_requests=len(self.requests),
            spec_draft_tokens=self.speculator.drafted, spec_accepted_tokens=self.speculator.accepted,
            **self.structured.stats(),
            decode_step_time_mean=c["decode_time_total"] / c["decode_steps"] if c["decode_steps"] else None,
            **{k: v for k, v in c.items() if k not in ("decode_time_total",)},
        )
