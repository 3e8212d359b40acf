"""LLMEngine: requests in, one scheduler -> model runner -> sampler step at a time, deltas out."""
from __future__ import annotations

import dataclasses
import logging
import random
import time
import weakref

import torch

from genpool.engine import isolation, limits, request_checks, step_logits
from genpool.engine import resume as resume_mod
from genpool.engine import stats as stats_mod
from genpool.engine.block_manager import BlockManager
from genpool.engine.config import EngineConfig, usable_cores
from genpool.engine.cpu_alloc import trim_heap
from genpool.engine.identity import ModelIdentity, model_identity
from genpool.engine.output_processor import OutputProcessor
from genpool.engine.outputs import CompletionOutput, RequestError, RequestOutput
from genpool.engine.protocol import EngineStats
from genpool.engine.request import Request
from genpool.engine.resume import ResumeState
from genpool.engine.sample_stage import SampleStage
from genpool.engine.sampler import Sampler, make_generator
from genpool.engine.sampling_params import SamplingParams
from genpool.engine.scheduler import Scheduler, SchedulerOutput
from genpool.engine.sequence import Sequence, SequenceStatus
from genpool.engine.speculative import Speculator
from genpool.engine.startup import StartLog, mib
from genpool.engine.step_logits import StepLogits
from genpool.engine.structured import StructuredOutputs
from genpool.engine.tokenizer import load_tokenizer, read_eos_ids

log = logging.getLogger("genpool.engine")
TRIM_AFTER_TOKENS = 512


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config = dataclasses.replace(config, device=config.resolved_device())  # "auto" decided once
        self.config = config
        if config.device == "cpu":  # more threads than usable cores only take turns on them
            threads = config.num_threads or min(torch.get_num_threads(), usable_cores())
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.startup = StartLog()
        self._load_model(config)
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
        self._counters = stats_mod.new_counters()
        self._big_steps = False  # a step of >= TRIM_AFTER_TOKENS tokens ran since the last trim
        self.output = OutputProcessor(self.tokenizer, self.scheduler, self.requests, self._counters,
                                      self._fail)
        self.sampling = SampleStage(self.sampler, self.speculator, self.structured, self.scheduler,
                                    self.requests, self._counters, tuple(self.eos_token_ids),
                                    self._new_seq, self._fail, self._fail_step)
        self.closed = False
        if config.tensor_parallel_size > 1:  # a later engine may close this one once it is gone
            self.runner.owner = weakref.ref(self)
        self.startup.done()

    def _load_model(self, config: EngineConfig) -> None:
        """Model files, tokenizer and runner (weights and KV cache), and max_model_len fitted to
        both the model and the cache."""
        from genpool.engine.model_runner import ModelRunner
        from genpool.engine.models.loader import load_config
        from genpool.engine.models.registry import resolve_model

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
        return request_checks.encode_prompt(self.tokenizer, prompt)

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
        bm = self.block_manager
        params = request_checks.check_request(  # ValueError: refused
            ids, params, resume, vocab_size=self.runner.args.vocab_size,
            max_model_len=self.max_model_len, kv_capacity=bm.num_blocks * bm.block_size)
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
        resumed, self._resumed = self._resumed, []
        outputs += resume_mod.report_finished(resumed, self.requests, self._counters)
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
        # logprobs are the model's raw distribution: a constrained row that reports them keeps
        # its logits from before the mask (which would make every other token -inf)
        raw = logits.clone() if masks is not None and any(s.params.logprobs is not None for s in masks.seqs) else None
        for rid, message in self.structured.apply_masks(masks, logits):
            self._fail(rid, RequestError("invalid_request", message))
        sampled = self.sampling.sample(logits, sched.sampling, drafts, raw)
        applied = self.scheduler.update(sched, sampled)
        outputs.extend(self.output.outputs(applied))
        outputs.extend(self.sampling.end_unsampled(sched.sampling))
        if not self.requests:  # the last request just finished: the engine is idle from here on
            self._release_heap()
        return self._take_failed(outputs)

    def _take_failed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        outputs.extend(self._failed)
        self._failed = []
        return outputs

    def _run(self, sched: SchedulerOutput) -> tuple[torch.Tensor, dict[Sequence, torch.Tensor]]:
        """The forward pass -> one logits row per sampling sequence, and {seq: its rows} for
        those that verify a draft (prompt rows scored on the way)."""
        t0 = time.perf_counter()
        try:
            out = self.runner.execute(sched.scheduled, sched.block_copies)
            rows = self._split(sched.scheduled, out)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it must not fail the whole batch
            rows = self._isolate(sched, exc)
        step_logits.score_prompts(sched.scheduled, rows.scores, self.requests)
        self._big_steps |= sched.num_batched_tokens >= TRIM_AFTER_TOKENS
        stats_mod.note_step_time(self._counters, sched, time.perf_counter() - t0)
        return rows.for_sampler(sched.scheduled, self.runner.args.vocab_size)

    # the runner's rows -> StepLogits (engine/step_logits.py); a static method here too because
    # benchmarks/prompt_logprobs_cost.py times the fast path as LLMEngine._split
    _split = staticmethod(step_logits.split)

    def _release_heap(self) -> None:
        """Idle after large steps: return their freed activation buffers to the system (the
        allocator is told never to on its own, so busy steps reuse them; engine/cpu_alloc.py)."""
        if self._big_steps and self.runner.device.type == "cpu":
            trim_heap()
        self._big_steps = False

    # -- fault isolation -------------------------------------------------------------------
    def _isolate(self, sched: SchedulerOutput, exc: Exception) -> StepLogits:
        """The forward pass raised: engine/isolation.py fails the request(s) that make it fail on
        their own and narrows sched to everyone else, whose logits come back."""
        return isolation.isolate(self.runner.execute, sched, exc, self._fail_step, self.requests)

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
            seq.pending_forks = 0  # n > 1: no sample is split off a failed request
            if seq.is_finished:
                continue
            if seq in sch.running or seq in sch.waiting:
                seq.num_computed_tokens = 0
                sch.finish(seq, "abort")
            else:  # an n > 1 child not joined yet: it holds no block references to free
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        req.error = error
        self._failed.append(req.delta_output({}))

    def stats(self) -> EngineStats:
        return stats_mod.snapshot(self._counters, self.block_manager, self.scheduler, self.speculator,
                                  self.structured, len(self.requests))
