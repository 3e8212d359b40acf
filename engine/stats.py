"""The engine's cumulative counters, and the EngineStats snapshot (engine/protocol.py) that
LLMEngine.stats() builds from them and from its parts' own state (KV blocks, queues, drafts,
grammars).

The counters stay a plain dict shared by reference: the stages that count (OutputProcessor's
generated tokens and finished requests, SampleStage's max_tokens=0 endings, resume.report_finished's
requests, the engine's prompt tokens and steps) add to the engine's one dict, and benchmarks read
differences of it between runs (dict(eng._counters)).
"""
from __future__ import annotations

from genpool.engine.block_manager import BlockManager
from genpool.engine.protocol import EngineStats
from genpool.engine.scheduler import Scheduler, SchedulerOutput
from genpool.engine.speculative import Speculator
from genpool.engine.structured import StructuredOutputs


def new_counters() -> dict:
    return dict(prompt_tokens_total=0, generation_tokens_total=0, step_count=0,
                decode_steps=0, decode_time_total=0.0, requests_finished=0)


def note_step_time(counters: dict, sched: SchedulerOutput, dt: float) -> None:
    """Every step counts; only pure-decode steps (one token per sequence) go into
    decode_step_time_mean, so a prompt chunk's longer step does not blur the per-token figure."""
    counters["step_count"] += 1
    if all(n == 1 for _, n in sched.scheduled):
        counters["decode_steps"] += 1
        counters["decode_time_total"] += dt


def snapshot(counters: dict, bm: BlockManager, sch: Scheduler, speculator: Speculator,
             structured: StructuredOutputs, num_requests: int) -> EngineStats:
    c = counters
    return EngineStats(
        num_running=len(sch.running), num_waiting=len(sch.waiting),
        kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks,
        kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
        free_seq_slots=max(0, sch.max_num_seqs - len(sch.running) - len(sch.waiting)),
        prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
        num_preemptions=sch.num_preemptions, num_requests=num_requests,
        spec_draft_tokens=speculator.drafted, spec_accepted_tokens=speculator.accepted,
        **structured.stats(),
        decode_step_time_mean=c["decode_time_total"] / c["decode_steps"] if c["decode_steps"] else None,
        **{k: v for k, v in c.items() if k not in ("decode_time_total",)},
    )
