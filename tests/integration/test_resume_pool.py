"""Resume, not restart, with real worker processes on a real Redis (issue 30).

A worker SIGKILLed mid-generation: the worker that takes its jobs over continues each where the
log stops, and every job ends token for token as an uninterrupted run (the offline engine) ends:
greedy, seeded sampling, n = 2, a stop string straddling the cut, a JSON schema, a repetition
penalty. The readers' streams have no `restart` and no repeated or skipped token. A taker that
runs another quantization restarts instead, and says why. A rolling restart with a 2 s drain
hands long jobs over in seconds."""
from __future__ import annotations

import os
import signal
import threading
import time

from genpool.producer import Client
from tests.chaos_helpers import pool_problems, raw_events, stream_problems
from tests.pool_helpers import (
    drop_prefix,
    new_prefix,
    offline,
    spawn_worker,
    stop_proc,
    wait_for,
    workers_alive,
)

STEPS = {"type": "object", "properties": {"steps": {
    "type": "array", "minItems": 10, "maxItems": 10,
    "items": {"type": "string", "minLength": 30, "maxLength": 60}}},
    "required": ["steps"], "additionalProperties": False}
RECIPE = [{"role": "user", "content": "List the steps to bake bread as JSON."}]


def up(url: str, prefix: str, model, name: str, log, *extra: str):
    """A real model worker process, once it is live (claim window 1.5 s, 0.2 s heartbeats)."""
    p = spawn_worker(url, prefix, model, name, "--num-threads", "2", "--claim-idle-ms", "1500",
                     "--heartbeat-s", "0.2", *extra, log_path=log)
    try:
        wait_for(lambda: workers_alive(url, prefix) >= 1 or p.poll() is not None, timeout=300,
                 what=f"{name} up")
    except BaseException:
        stop_proc(p)
        raise
    assert p.poll() is None, log.read_text()[-3000:]
    return p


def published(c: Client, job_id: str) -> dict[int, int]:
    """Tokens of each completion in the job's log now."""
    out: dict[int, int] = {}
    for e in raw_events(c, job_id):
        if e.type == "token":
            out[e.index] = out.get(e.index, 0) + len(e.token_ids)
    return out


def stop_string_at(tok, ids: list[int], start: int) -> tuple[str, int]:
    """A stop string made of greedy output tokens start..start+3 that first occurs there in the
    text (so the job stops exactly there), and the token it starts at."""
    for s in range(start, len(ids) - 8):
        head, stop = tok.decode(ids[:s]), tok.decode(ids[:s + 4])[len(tok.decode(ids[:s])):]
        if len(stop.strip()) >= 4 and tok.decode(ids).find(stop) == len(head):
            return stop, s
    raise AssertionError("no usable stop string in the greedy output")


def specs_for(llm) -> tuple[list[dict], dict]:
    base = [
        {"job_id": "greedy", "prompt": "The history of the lighthouse", "max_tokens": 300,
         "temperature": 0.0, "ignore_eos": True},
        {"job_id": "seeded", "prompt": "Once upon a time in a small harbor town",
         "max_tokens": 260, "temperature": 0.8, "top_p": 0.9, "seed": 11, "ignore_eos": True},
        {"job_id": "pair", "prompt": "A letter to my future self:", "max_tokens": 200,
         "temperature": 0.8, "top_p": 0.9, "seed": 5, "n": 2, "ignore_eos": True},
        {"job_id": "penalty", "prompt": "Rain on the window, and", "max_tokens": 240,
         "temperature": 0.0, "repetition_penalty": 1.3, "ignore_eos": True},
        {"job_id": "json", "messages": RECIPE, "max_tokens": 300, "temperature": 0.0,
         "structured_outputs": {"json": STEPS}},
    ]
    probe = {"job_id": "stop", "prompt": "Ten facts about the moon:", "max_tokens": 300,
             "temperature": 0.0, "ignore_eos": True}
    ids = offline(llm, [probe])["stop"][1]
    stop, at = stop_string_at(llm.llm_engine.tokenizer, ids, 70)
    return base + [dict(probe, stop=[stop])], {"stop_token": at}


def test_sigkill_mid_generation_resumes_every_job_token_for_token(redis_url, smollm2_path,
                                                                   tmp_path):
    from genpool.engine import LLM

    llm = LLM(str(smollm2_path), max_num_seqs=8, num_threads=2)
    specs, where = specs_for(llm)
    want = offline(llm, specs)
    pair = llm.generate(["A letter to my future self:"], [_params(specs[2])])[0]
    del llm
    prefix = new_prefix("resume")
    c = Client(redis_url, prefix)
    a = up(redis_url, prefix, smollm2_path, "victim", tmp_path / "a.log", "--max-num-seqs", "8")
    b = None
    try:
        jobs = [c.submit(**s) for s in specs]
        seen: dict[str, list] = {j.id: [] for j in jobs}
        readers = [threading.Thread(target=lambda j=j: seen[j.id].extend(j.stream(timeout=600)),
                                    daemon=True) for j in jobs]
        for t in readers:
            t.start()
        # SIGKILL while the stop job is inside its stop string (tokens at+1 .. at+3 out)
        at = where["stop_token"]
        wait_for(lambda: published(c, "stop").get(0, 0) > at, timeout=300, interval=0.005,
                 what="the stop job inside its stop string")
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        cut = {j.id: published(c, j.id) for j in jobs}
        b = spawn_worker(redis_url, prefix, smollm2_path, "rescuer", "--max-num-seqs", "8",
                         "--num-threads", "2", "--claim-idle-ms", "1500",
                         log_path=tmp_path / "b.log")
        results = {j.id: j.result(timeout=600) for j in jobs}
        for t in readers:
            t.join(60)
    finally:
        stop_proc(a)
        if b is not None:
            stop_proc(b)
    try:
        assert at < cut["stop"][0] <= at + 3, (at, cut["stop"])  # the cut is inside the stop
        for j in jobs:  # every job was cut mid-generation (none had ended, none had not begun)
            assert 0 < min(cut[j.id].values()) and c.job(j.id).info()["attempts"] == "2", cut
            res, types = results[j.id], [e.type for e in raw_events(c, j.id)]
            assert types.count("resume") == 1 and "restart" not in types, (j.id, types)
            assert res.worker == "rescuer" and res.error is None, (j.id, res.error)
            streamed = "".join(e.text for e in seen[j.id])
            assert {e.type for e in seen[j.id]} == {"token"}, j.id  # no restart, no rewind
            if j.id == "pair":
                got = [(ch.text, ch.token_ids) for ch in res.choices]
                assert got == [(o.text, list(o.token_ids)) for o in pair.outputs]
                continue
            assert (res.text, res.token_ids) == want[j.id], j.id
            assert streamed == res.text, j.id
            assert res.usage.completion_tokens == len(res.token_ids), j.id
        assert results["stop"].finish_reason == "stop"
        assert pool_problems(c, jobs) == {}
    finally:
        c.close()
        drop_prefix(redis_url, prefix)


def _params(spec: dict):
    from genpool.engine import SamplingParams
    from genpool.schemas import JobRequest

    req = JobRequest.model_validate({k if k != "job_id" else "id": v for k, v in spec.items()})
    return SamplingParams(**req.sampling_kwargs())


def test_a_taker_with_another_quantization_restarts_and_says_why(redis_url, smollm2_path,
                                                                 tmp_path):
    prefix = new_prefix("resume-q")
    c = Client(redis_url, prefix)
    a = up(redis_url, prefix, smollm2_path, "fp32", tmp_path / "a.log", "--max-num-seqs", "4")
    b = None
    try:
        jobs = [c.submit(f"Write about the sea, part {i}", max_tokens=200, temperature=0.0,
                         ignore_eos=True) for i in range(2)]
        wait_for(lambda: all(published(c, j.id).get(0, 0) >= 10 for j in jobs), timeout=300,
                 what="10 tokens each")
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        b = spawn_worker(redis_url, prefix, smollm2_path, "int8", "--max-num-seqs", "4",
                         "--num-threads", "2", "--claim-idle-ms", "1500", "--quantization",
                         "int8", log_path=tmp_path / "b.log")
        results = [j.result(timeout=600) for j in jobs]
    finally:
        stop_proc(a)
        if b is not None:
            stop_proc(b)
    try:
        for j, res in zip(jobs, results):
            assert res.error is None and res.worker == "int8"
            assert res.usage.completion_tokens == len(res.token_ids) == 200
            events = raw_events(c, j.id)
            (restart,) = [e for e in events if e.type == "restart"]
            assert "model identity differs" in restart.reason
            assert "quantization None != 'int8'" in restart.reason, restart.reason
            assert "resume" not in [e.type for e in events]
            assert stream_problems(c, j.id) == []
    finally:
        c.close()
        drop_prefix(redis_url, prefix)


def test_a_rolling_restart_with_a_2s_drain_hands_long_jobs_over_in_seconds(redis_url, tmp_path):
    """100 long jobs on 2 fake-engine workers; each worker in turn gets SIGTERM with
    --drain-timeout 2 and is replaced. The claim window is 10 minutes: only the hand-over can
    move the drained jobs in time. 0 lost, 0 duplicated, every stream continuous."""
    prefix = new_prefix("rolling")
    c = Client(redis_url, prefix)
    common = ("--engine-factory", "tests.fake_engine:make", "--max-num-seqs", "32",
              "--drain-timeout", "2", "--claim-idle-ms", "600000", "--heartbeat-s", "0.2")
    env = {"GENPOOL_FAKE_STEP_DELAY": "0.02"}
    procs: dict[str, object] = {}

    def start(name):
        procs[name] = spawn_worker(redis_url, prefix, "fake", name, *common, env=env,
                                   log_path=tmp_path / f"{name}.log")

    drains = []
    try:
        start("a")
        start("b")
        wait_for(lambda: workers_alive(redis_url, prefix) == 2, timeout=60, what="2 workers")
        jobs = c.submit_many([dict(prompt=f"long job {i}", max_tokens=400) for i in range(100)])
        t_start = time.monotonic()
        for old, new in (("a", "a2"), ("b", "b2")):
            wait_for(lambda: sum(bool(published(c, j.id)) for j in jobs) >= 40, timeout=60,
                     what="jobs streaming")
            t0 = time.monotonic()
            procs[old].send_signal(signal.SIGTERM)
            assert procs[old].wait(30) == 0
            drains.append(time.monotonic() - t0)
            start(new)
        results = {j.id: j.result(timeout=120) for j in jobs}
        took = time.monotonic() - t_start
    finally:
        for p in procs.values():
            stop_proc(p, 20)
    try:
        assert all(d < 2 + 5 for d in drains), drains  # 2 s of draining, then a prompt exit
        assert all(r.error is None and r.usage.completion_tokens == 400
                   for r in results.values())
        assert pool_problems(c, jobs) == {}  # one terminal event each: 0 lost, 0 duplicated
        resumed = 0
        for j in jobs:
            types = [e.type for e in raw_events(c, j.id)]
            assert "restart" not in types, types
            resumed += "resume" in types
        assert resumed >= 20, resumed  # the drained workers' jobs went on elsewhere
        # 100 x 400 tokens at 50 steps/s need ~16 s on 64 slots; the claim window alone is
        # 600 s, so finishing in well under a minute means the hand-over moved them
        assert took < 60, took
    finally:
        c.close()
        drop_prefix(redis_url, prefix)
