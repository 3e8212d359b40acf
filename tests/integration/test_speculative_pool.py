"""Speculative decoding in real worker processes: a worker with n-gram drafts SIGKILLed
mid-generation, its jobs resumed by a second one (drafts on too), each ending token for token as
the offline engine without drafts ends it (greedy copy, a stop string, a job scoring its prompt)."""
from __future__ import annotations

import os
import signal

import pytest

from genpool.producer import Client
from tests.chaos_helpers import raw_events
from tests.integration.test_resume_pool import published, stop_string_at, up
from tests.pool_helpers import drop_prefix, new_prefix, offline, stop_proc, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.checkpoint, pytest.mark.redis]
SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "4", "--speculative-max-batch", "16")
DOC = ("Invoice 4471 was issued on 3 March to Harbor Supplies Ltd for 12 steel brackets at 4.50 "
       "each, 3 oak panels at 27.00 each and one delivery fee of 15.00.")


def _specs(llm) -> list[dict]:
    copy = {"job_id": "copy", "max_tokens": 90, "temperature": 0.0, "messages": [
        {"role": "user", "content": f"Copy this invoice word for word, twice:\n{DOC}"}]}
    echo = {"job_id": "echo", "prompt": f"{DOC}\nAgain: {DOC[:60]}", "max_tokens": 70,
            "temperature": 0.0, "ignore_eos": True, "prompt_logprobs": 1}
    ids = offline(llm, [dict(echo, job_id="probe", prompt_logprobs=None)])["probe"][1]
    stop, _ = stop_string_at(llm.llm_engine.tokenizer, ids, 40)
    return [copy, echo, dict(echo, job_id="stop", stop=[stop], prompt_logprobs=None)]


def test_sigkill_with_drafts_resumes_token_for_token(redis_url, smollm2_path, tmp_path):
    from genpool.engine import LLM, SamplingParams

    llm = LLM(str(smollm2_path), max_num_seqs=4, num_threads=2)
    specs = _specs(llm)
    want = offline(llm, specs)
    echo = specs[1]
    scored = llm.generate(echo["prompt"], SamplingParams(temperature=0, max_tokens=1,
                                                         prompt_logprobs=1))[0].prompt_logprobs
    del llm
    prefix = new_prefix("spec-resume")
    c = Client(redis_url, prefix)
    a = up(redis_url, prefix, smollm2_path, "victim", tmp_path / "a.log", *SPEC)
    b = None
    try:
        jobs = [c.submit(**s) for s in specs]
        wait_for(lambda: min(published(c, j.id).get(0, 0) for j in jobs) >= 12, timeout=300,
                 interval=0.005, what="every job part way")
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        cut = {j.id: published(c, j.id).get(0, 0) for j in jobs}
        b = up(redis_url, prefix, smollm2_path, "rescuer", tmp_path / "b.log", *SPEC)
        results = {j.id: j.result(timeout=600) for j in jobs}
    finally:
        stop_proc(a)
        if b is not None:
            stop_proc(b)
    try:
        for j in jobs:
            res, types = results[j.id], [e.type for e in raw_events(c, j.id)]
            assert res.error is None and res.worker == "rescuer", (j.id, res.error)
            assert "restart" not in types and types.count("resume") == 1, (j.id, types, cut)
            assert (res.text, res.token_ids) == want[j.id], (j.id, cut)
        assert results["stop"].finish_reason == "stop"
        # a step that accepted drafts publishes several tokens in one event
        sizes = [len(e.token_ids) for e in raw_events(c, "copy") if e.type == "token"]
        assert max(sizes) > 1, sizes
        got = results["echo"].prompt
        assert got.token_ids and got.logprobs[0] is None
        for d, e, t in zip(got.logprobs[1:], scored[1:], got.token_ids[1:]):
            assert d[str(t)] == pytest.approx(e[t], abs=1e-3)
    finally:
        c.close()
        drop_prefix(redis_url, prefix)
