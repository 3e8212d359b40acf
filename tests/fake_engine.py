"""A deterministic stand-in for engine.LLMEngine, for tests of the Redis side of the worker.

It satisfies engine.protocol.Engine, the surface the worker uses (add_request, abort_request, step,
has_unfinished_requests, stats, describe, tokenizer, apply_chat_template) and produces `expected_text(prompt_ids, max_tokens)`, one
character per token, so tests can check exact outputs without torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from genpool.engine.identity import ModelIdentity
from genpool.engine.outputs import CompletionOutput, RequestOutput
from genpool.engine.protocol import EngineStats


class FakeTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [ord(c) % 1000 for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    base = sum(prompt_ids)
    return "".join(chr(ord("a") + (base + 7 * i) % 26) for i in range(max_tokens))


def expected_for_prompt(prompt: str, max_tokens: int) -> str:
    return expected_text(FakeTokenizer()(prompt)["input_ids"], max_tokens)


@dataclass
class _Req:
    rid: str
    ids: list[int]
    max_tokens: int
    priority: int
    order: int
    done: int = 0
    out: list[int] = field(default_factory=list)


class FakeEngine:
    block_manager = None  # no prefix cache: prefix-aware routing stays off

    def __init__(self, max_num_seqs: int = 8, num_blocks: int = 4096, block_size: int = 16,
                 step_delay: float = 0.0, max_model_len: int = 4096, revision: str = "fake-1"):
        self.tokenizer = FakeTokenizer()
        self.revision = revision  # its model identity's: workers with different ones restart
        self.max_num_seqs, self.num_blocks, self.block_size = max_num_seqs, num_blocks, block_size
        self.step_delay, self.max_model_len = step_delay, max_model_len
        self.requests: dict[str, _Req] = {}
        self._aborted: list[RequestOutput] = []
        self.step_count = 0
        self.added = 0
        self.resumed: list[tuple[str, int]] = []  # (request id, tokens it resumed after)
        self.log: list[tuple[int, str]] = []  # (step, request id) of every emitted token

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def model_identity(self) -> ModelIdentity:
        return ModelIdentity("fake", self.revision, "float32", None, "fake-tokenizer")

    def add_request(self, request_id, prompt, params, priority: int = 0, arrival_time=None,
                    resume=None):
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else \
            self.tokenizer(prompt)["input_ids"]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; the model's limit is "
                             f"{self.max_model_len} including at least one generated token")
        done = 0
        if resume is not None:  # goes on after the tokens given, which must be its own
            (done_ids,) = resume.token_ids  # n = 1 only
            want = [ord(ch) for ch in expected_text(list(ids), params.max_tokens)[:len(done_ids)]]
            if done_ids != want or len(done_ids) > params.max_tokens:
                raise ValueError("resume refused: these tokens are not this engine's")
            done = len(done_ids)
            self.resumed.append((request_id, done))
        self.added += 1
        self.requests[request_id] = _Req(request_id, list(ids), params.max_tokens, priority,
                                         self.added, done)

    def abort_request(self, request_id):
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if self.requests.pop(rid, None) is not None:
                self._aborted.append(RequestOutput(rid, None, [], [CompletionOutput(0, "", [],
                                                                                    "abort")],
                                                   True))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _running(self) -> list[_Req]:
        order = sorted(self.requests.values(), key=lambda q: (q.priority, q.order))
        return order[: self.max_num_seqs]

    def step(self) -> list[RequestOutput]:
        outs, self._aborted = self._aborted, []
        if self.step_delay:
            time.sleep(self.step_delay)
        self.step_count += 1
        for q in self._running():
            if q.done >= q.max_tokens:  # resumed with every token already out: it just ends
                del self.requests[q.rid]
                outs.append(RequestOutput(q.rid, None, q.ids, [CompletionOutput(0, "", [], "length")],
                                          True))
                continue
            text = expected_text(q.ids, q.max_tokens)[q.done]
            q.done += 1
            self.log.append((self.step_count, q.rid))
            fin = "length" if q.done >= q.max_tokens else None
            if fin:
                del self.requests[q.rid]
            outs.append(RequestOutput(q.rid, None, q.ids, [CompletionOutput(0, text, [ord(text)],
                                                                           fin)], fin is not None))
        return outs

    def describe(self) -> str:
        return f"fake engine: {self.num_blocks}x{self.block_size} blocks, {self.max_num_seqs} seqs"

    def stats(self) -> EngineStats:
        running = min(len(self.requests), self.max_num_seqs)
        used = sum(-(-(len(q.ids) + q.done) // self.block_size) for q in self.requests.values())
        return EngineStats(num_running=running, num_waiting=len(self.requests) - running,
                           free_seq_slots=max(0, self.max_num_seqs - len(self.requests)),
                           kv_blocks_total=self.num_blocks, kv_blocks_free=self.num_blocks - used,
                           kv_blocks_used=used, block_size=self.block_size, step_count=self.step_count,
                           num_requests=len(self.requests))


def make(**kwargs) -> FakeEngine:
    """Engine factory for `genpool worker --engine-factory tests.fake_engine:make`
    (GENPOOL_FAKE_STEP_DELAY sets seconds per step)."""
    import os

    kw = {k: v for k, v in kwargs.items() if k in ("max_num_seqs", "block_size")}
    return FakeEngine(step_delay=float(os.environ.get("GENPOOL_FAKE_STEP_DELAY", "0")), **kw)


class CrashingEngine(FakeEngine):
    """Kills its own process (SIGSEGV, as a kernel fault would) in any step that runs a request
    whose prompt contains CRASH_WORD: the stand-in for a job that crashes whatever runs it."""

    CRASH_WORD = "POISON"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.poison: set[str] = set()

    def add_request(self, request_id, prompt, params, priority: int = 0, arrival_time=None,
                    resume=None):
        super().add_request(request_id, prompt, params, priority, arrival_time, resume)
        if isinstance(prompt, dict) and self.CRASH_WORD in (prompt.get("prompt") or ""):
            self.poison.add(request_id)

    def step(self):
        if any(q.rid in self.poison for q in self._running()):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGSEGV)
        return super().step()


def make_crashing(**kwargs) -> CrashingEngine:
    """`--engine-factory tests.fake_engine:make_crashing` (GENPOOL_FAKE_STEP_DELAY as in make)."""
    import os

    kw = {k: v for k, v in kwargs.items() if k in ("max_num_seqs", "block_size")}
    return CrashingEngine(step_delay=float(os.environ.get("GENPOOL_FAKE_STEP_DELAY", "0")), **kw)
