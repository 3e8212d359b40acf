"""A KV cache smaller than the model's context (issue 28, item 5): no sequence may grow past what
the cache holds, or once preempted it could never be placed again and, heading the waiting queue,
it would block every request behind it forever (the engine stepping empty, a worker renewing the
job's lease for ever)."""
from __future__ import annotations

import pytest

from genpool.engine import LLM, SamplingParams
from genpool.engine.block_manager import BlockManager
from genpool.engine.scheduler import SampledToken, Scheduler
from genpool.engine.sequence import Sequence

PROMPT = {"prompt_token_ids": list(range(10, 80))}  # 70 tokens
LONG = SamplingParams(max_tokens=600, ignore_eos=True, temperature=0)


def drain(eng, max_steps: int, add_later=None) -> dict:
    """Step until idle (at most max_steps); add_later(eng) runs once the first preemption happened.
    Returns {request id: final output (text and tokens accumulated)}."""
    finals, tokens = {}, {}
    for _ in range(max_steps):
        if add_later is not None and eng.stats().num_preemptions:
            add_later(eng)
            add_later = None
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
            if out.finished:
                finals[out.request_id] = (out.outputs[0].finish_reason, tokens[out.request_id])
        if not eng.has_unfinished_requests() and add_later is None:
            return finals
    raise AssertionError(f"the engine did not drain in {max_steps} steps: finished {finals}, "
                         f"{eng.stats().num_waiting} waiting, {eng.stats().num_running} running")


def test_a_sequence_the_kv_cache_cannot_hold_is_capped_not_stuck(tiny_llama_path):
    # the model's context is 2048 tokens, the cache 16 x 16 = 256: without a cap the 70-token
    # prompt grows to 256 tokens, is preempted, and can never be placed again
    llm = LLM(str(tiny_llama_path), num_kv_blocks=16, max_num_seqs=4)
    eng = llm.llm_engine
    eng.add_request("long", PROMPT, LONG)
    # a second long request makes them preempt each other; "late" comes after a preemption
    eng.add_request("long2", {"prompt_token_ids": list(range(300, 340))}, LONG)
    later = lambda e: e.add_request("late", {"prompt_token_ids": [5, 6, 7]},  # noqa: E731
                                    SamplingParams(max_tokens=5, temperature=0))
    finals = drain(eng, 2000, later)
    assert finals["long"][0] == "length" and len(finals["long"][1]) == 256 - 70
    assert finals["long2"][0] == "length" and len(finals["long2"][1]) == 256 - 40
    assert finals["late"][0] == "length" and len(finals["late"][1]) == 5
    assert eng.block_manager.num_used_blocks == 0
    assert eng.max_model_len == 256 and "max_model_len=256" in eng.describe()
    with pytest.raises(ValueError, match="KV cache"):  # the limit names the cache, not the model
        eng.add_request("too-long", {"prompt_token_ids": list(range(10, 266))}, LONG)


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_at_start(tiny_llama_path):
    # vLLM's rule: an explicit max_model_len the cache cannot hold once is a configuration error
    with pytest.raises(ValueError, match=r"max_model_len 1024 .*KV cache.* hold 256 tokens"):
        LLM(str(tiny_llama_path), num_kv_blocks=16, max_model_len=1024)
    assert LLM(str(tiny_llama_path), num_kv_blocks=16, max_model_len=256).llm_engine.max_model_len == 256


def test_the_scheduler_never_grows_a_sequence_past_its_cache():
    """The scheduler's own guarantee (also without an engine's max_model_len): a sequence stops
    ("length") when it holds the whole cache, so a preempted one can always be placed again."""
    bm = BlockManager(4, 4)  # 16 tokens
    sched = Scheduler(bm, 4, 64)
    seqs = [Sequence(r, [1, 2, 3], SamplingParams(max_tokens=100)) for r in ("a", "b")]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty, f"an empty step with {sched.waiting} waiting"
        sched.update(out, [SampledToken(s, 9) for s in out.sampling])
    assert [(s.finish_reason, s.num_tokens) for s in seqs] == [("length", 16)] * 2
