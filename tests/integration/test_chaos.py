"""The chaos suite: seeded, bounded (a few minutes), run in CI.

- thousands of random and extreme parameter combinations straight through the engine (tiny model
  for volume, SmolLM2 where the numbers depend on real logits): no uncaught exception, every
  request ends with output or a clear error;
- worker processes SIGKILLed, SIGSTOPped past the claim window and resumed, a Redis restart
  (our own redis-server on a port in 7300-7399), memory pressure under noeviction and writes
  refused (NOREPLICAS), each with jobs in flight, plus hostile entries mixed in: every job ends
  with exactly one terminal event, nothing after it, no two attempts' tokens interleaved, no
  token missing from what its reader saw, nothing pending (tests/chaos_helpers.py).
Set GENPOOL_CHAOS_REPORT=<file> to get one JSON line per scenario (docs/results.md's table).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import time

import pytest

from genpool.producer import Client
from genpool.schemas import parse_event
from tests.chaos_helpers import pool_problems
from tests.pool_helpers import drop_prefix, new_prefix, spawn_worker, stop_proc, wait_for
from tests.tiny_tokenizer import VOCAB_SIZE as VOCAB  # the tiny model's vocabulary
from tests.worker.refusal_helpers import memory_pressure, reader_text, refusals, refused_writes

SEED = 16


def report(row: dict) -> None:
    path = os.environ.get("GENPOOL_CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


# -- the engine alone --------------------------------------------------------------------------
EXTREMES = {
    "temperature": [0.0, 1e-6, 1e-5, 2e-5, 0.5, 1.0, 2.0, 100.0, 101.0, -1.0, float("nan")],
    "top_p": [1e-9, 0.01, 0.5, 1.0, 0.0, 1.5],
    "top_k": [-1, 0, 1, 2, 50, VOCAB - 1, VOCAB, 10**9, -2],
    "min_p": [0.0, 1e-9, 0.5, 1.0, 1.1],
    "repetition_penalty": [0.01, 0.5, 1.0, 1.3, 100.0, 1e-45, 0.0, 1e9, float("inf")],
    "presence_penalty": [-2.0, 0.0, 2.0, 2.5],
    "frequency_penalty": [-2.0, 0.0, 2.0, -3.0],
    "seed": [None, 0, 1, 2**63 - 1, 2**63, -1],
    "logprobs": [None, 0, 1, 20, 21],
    "min_tokens": [0, 1, 3, 10],
    "max_tokens": [1, 2, 4, 0],
    "n": [1, 2, 3, 200],
    "stop": [[], ["a"], [" the", "\n"], ["x" * 1025]],
    "stop_token_ids": [[], [2], [0, VOCAB - 1], [VOCAB], [10**9]],
    "ignore_eos": [False, True],
}


def random_params(rng: random.Random) -> dict:
    """A few fields at an extreme (often out of bounds), the rest at ordinary values."""
    kw = {"max_tokens": rng.choice([1, 2, 3, 4]), "temperature": rng.choice([0.0, 0.8])}
    for name in rng.sample(sorted(EXTREMES), rng.randint(1, 5)):
        kw[name] = rng.choice(EXTREMES[name])
    return kw


def random_prompt(rng: random.Random, limit: int) -> dict:
    kind = rng.random()
    if kind < 0.02:
        return {"prompt_token_ids": []}
    if kind < 0.04:
        return {"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(limit + 5)]}
    if kind < 0.06:
        return {"prompt_token_ids": [VOCAB + rng.randrange(10)]}
    return {"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]}


def fuzz_engine(llm, n_requests: int, seed: int, limit: int) -> dict:
    from genpool.engine import SamplingParams

    eng, rng = llm.llm_engine, random.Random(seed)
    counts = {"tried": n_requests, "refused": 0, "finished": 0, "failed": 0}
    live = set()
    for i in range(n_requests):
        try:
            params = SamplingParams(**random_params(rng))
            eng.add_request(f"f{i}", random_prompt(rng, limit), params)
            live.add(f"f{i}")
        except ValueError as e:
            assert str(e), "a refusal must say why"
            counts["refused"] += 1
        if len(live) >= 48 or i == n_requests - 1:
            while eng.has_unfinished_requests():
                for out in eng.step():  # an exception here fails the test: none may escape
                    if out.finished:
                        live.discard(out.request_id)
                        if out.error is not None:
                            assert out.error.message and out.error.code in ("internal",
                                                                            "invalid_request")
                            counts["failed"] += 1
                        else:
                            assert all(c.finish_reason for c in out.outputs)
                            counts["finished"] += 1
    assert not live and counts["refused"] + counts["finished"] + counts["failed"] == n_requests
    assert eng.block_manager.num_used_blocks == 0
    return counts


def test_random_and_extreme_parameters_through_the_tiny_engine(tiny_llama_path):
    from genpool.engine import LLM

    llm = LLM(str(tiny_llama_path), max_num_seqs=64, num_threads=1, max_model_len=256)
    counts = fuzz_engine(llm, 2000, SEED, 256)
    report({"scenario": "engine: random/extreme params (tiny)", **counts})
    assert counts["finished"] > 500 and counts["refused"] > 300


def test_extreme_in_bounds_parameters_on_the_real_model(smollm2_path):
    """Every in-bounds extreme on SmolLM2's real logits: nothing may go non-finite."""
    from genpool.engine import LLM, SamplingParams

    llm = LLM(str(smollm2_path), max_num_seqs=32, num_threads=2, max_model_len=512)
    rng = random.Random(SEED)
    prompts = ["Tell me a joke", "The capital of France is", "1, 2, 3, 4,", "def f(x):"]
    params = [SamplingParams(max_tokens=6, temperature=t, repetition_penalty=rp, top_p=tp,
                             presence_penalty=pp, frequency_penalty=-pp, min_tokens=2,
                             seed=rng.randrange(2**63))
              for t in (0.0, 2e-5, 100.0) for rp in (0.01, 100.0) for tp in (1e-9, 1.0)
              for pp in (-2.0, 2.0)]
    outs = llm.generate([prompts[i % 4] for i in range(len(params))], params)
    errors = [o.error for o in outs if o.error is not None]
    report({"scenario": "engine: in-bounds extremes (SmolLM2)", "tried": len(params),
            "failed": len(errors)})
    assert errors == [] and all(len(o.outputs[0].token_ids) >= 2 for o in outs)


# -- processes: kill, stop, restart --------------------------------------------------------------
def own_port() -> int:
    for port in range(7300, 7400):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 7300-7399 for a private redis-server")


@pytest.fixture
def own_redis(tmp_path):
    from genpool.workers.integrations import embedded

    server = embedded.start_server(port=own_port(), data_dir=tmp_path / "redis", fsync="always")
    holder = {"server": server}
    yield holder
    holder["server"].stop()


class Pool:
    """Fake-engine worker processes on one prefix (the queue's behaviour, at volume), restarted
    when they die, as compose would."""

    def __init__(self, url: str, prefix: str, logs, claim_ms: int = 1000):
        self.url, self.prefix, self.logs, self.claim_ms = url, prefix, logs, claim_ms
        self.procs: dict[str, object] = {}
        self.started = 0

    def start(self, name: str):
        self.started += 1
        self.procs[name] = spawn_worker(
            self.url, self.prefix, "fake", name, "--engine-factory", "tests.fake_engine:make",
            "--max-num-seqs", "16", "--claim-idle-ms", str(self.claim_ms), "--heartbeat-s", "0.2",
            env={"GENPOOL_FAKE_STEP_DELAY": "0.01"}, log_path=self.logs / f"{name}-{self.started}.log")
        return self.procs[name]

    def deaths(self) -> int:
        return sum(p.poll() not in (None, 0) for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            stop_proc(p, 20)


def specs(rng: random.Random, n: int, tag: str) -> list[dict]:
    return [dict(job_id=f"{tag}-{i}", prompt=f"{tag} job {i} " + "w" * rng.randint(1, 30),
                 max_tokens=rng.randint(40, 200), priority=rng.choice([-1, 0, 0, 1]))
            for i in range(n)]


def hostile_entries(c: Client, rng: random.Random, n: int) -> list[str]:
    """Raw XADDs a hostile producer could send; returns the ids whose readers get an error."""
    ids = []
    for i in range(n):
        jid = f"bad-{i}"
        kind = rng.randrange(6)
        if kind == 0:
            raw = json.dumps({"id": jid, "prompt": "x", "repetition_penalty": 1e-45})
        elif kind == 1:
            raw = '{"id": "%s", "prompt": "x", "temperature": NaN}' % jid
        elif kind == 2:
            raw = json.dumps({"id": jid, "prompt": "x", "stop_token_ids": [-5]})
        elif kind == 3:
            raw = json.dumps({"id": jid, "prompt": "x", "n": 10**6})
        elif kind == 4:
            raw = json.dumps({"id": f"{jid}:events", "prompt": "x"})  # refused id: dead letter
            jid = None
        else:
            raw = "[" * 50_000 + "]" * 50_000  # nested too deeply, no id: dead letter
            jid = None
        c.redis.xadd(c.keys.jobs(rng.choice(["high", "normal", "low"])), {"job": raw})
        if jid:
            ids.append(jid)
    return ids


def run_scenario(name: str, url: str, tmp_path, fault, n_jobs: int = 120, n_bad: int = 12,
                 restarts: bool = True):
    """`restarts`: the fault must make some job start over (a refused write is resent as it
    was, so those faults show in Redis' error counts instead)."""
    rng = random.Random(f"{SEED}-{name}")
    prefix = new_prefix("chaos")
    c = Client(url, prefix)
    pool = Pool(url, prefix, tmp_path)
    try:
        for w in ("a", "b", "c"):
            pool.start(w)
        wait_for(lambda: len(c.status()["workers"]) == 3, timeout=60, what="3 workers")
        jobs = c.submit_many(specs(rng, n_jobs, name))
        bad = hostile_entries(c, rng, n_bad)
        wait_for(lambda: sum(c.redis.exists(c.keys.events(j.id)) for j in jobs) >= 30,
                 timeout=60, what="jobs in flight")
        seen = fault(pool, c) or {}  # what the fault measured, for the report
        results = [j.result(timeout=180) for j in jobs]
        errors = [c.job(jid).result(timeout=60, raise_on_error=False).error for jid in bad]
        wait_for(lambda: not pool_problems(c, jobs), timeout=30, what="a settled queue")
        problems = pool_problems(c, [*jobs, *[c.job(b) for b in bad]])
        terminals = {j.id: [f["event"] for _, f in c.redis.xrange(c.keys.events(j.id))
                            if '"type":"result"' in f["event"] or '"type":"error"' in f["event"]]
                     for j in jobs}
        types = {j.id: [parse_event(f["event"]).type for _, f in
                        c.redis.xrange(c.keys.events(j.id))] for j in jobs}
        # taken over: run by more than one attempt; resumed after what the earlier one
        # published, or restarted (and why: the events say) when it could not be
        taken_over = sum(int(c.job(j.id).info().get("attempts", 1)) > 1 for j in jobs)
        missing = sum(reader_text(c, j.id) != r.text for j, r in zip(jobs, results))
        row = {"scenario": name, "tried": n_jobs + n_bad, "taken_over": taken_over,
               "resumed": sum("resume" in t for t in types.values()),
               "restarted": sum("restart" in t for t in types.values()),
               "lost": sum(len(t) == 0 for t in terminals.values()),
               "duplicated": sum(len(t) > 1 for t in terminals.values()),
               "stuck": sum(v["queued"] + v["pending"] for v in c.status()["lanes"].values()),
               "worker_deaths": pool.deaths(), "missing_tokens": missing,
               "dead_letters": c.redis.xlen(c.keys.dead), "problems": len(problems), **seen}
        report(row)
        assert problems == {}, problems
        assert missing == 0, f"{missing} readers missed tokens"
        assert row["dead_letters"] == n_bad - len(bad), "a hostile entry's dead letter"
        # hit: a job taken over, or resent from its start after a lost connection (a restart
        # event of the same attempt)
        assert taken_over + row["restarted"] > 0 or not restarts, "the fault hit no job in flight"
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        assert all(e is not None and e.code == "invalid_request" for e in errors), errors
        return pool, row
    finally:
        pool.stop()
        c.close()
        drop_prefix(url, prefix)


def test_chaos_sigkill(own_redis, tmp_path):
    def fault(pool, c):
        os.kill(pool.procs["a"].pid, signal.SIGKILL)
        pool.procs["a"].wait()
        pool.start("a2")

    pool, _ = run_scenario("sigkill", own_redis["server"].url, tmp_path, fault)
    assert pool.deaths() == 1  # the one we killed


def held_by(c: Client, worker: str) -> int:
    """Entries `worker` has read and not acknowledged, over every lane."""
    return sum(int(p["pending"]) for lane in c.keys.all_jobs()
               for p in c.redis.xpending(lane, c.keys.group)["consumers"]
               if p["name"] == worker)


def test_chaos_sigstop_past_the_claim_window(own_redis, tmp_path):
    """b is stopped until its two full peers hold every entry it held, then continued. They take
    them from one claim window on, at their next free slots, before their backlog: so the
    takeover ends past the window with jobs still queued. (A fixed 2.5 s stop left b a few of
    them on a slower machine, where the peers' free slots come at ~20 a second: a flaky count.)"""
    held = {}

    def fault(pool, c):
        os.kill(pool.procs["b"].pid, signal.SIGSTOP)
        held["b"] = held_by(c, "b")
        t0 = time.monotonic()
        wait_for(lambda: held_by(c, "b") == 0, timeout=30, interval=0.05, what="b's entries taken over")
        held["after_s"] = time.monotonic() - t0
        held["queued"] = sum(v["queued"] for v in c.status()["lanes"].values())
        os.kill(pool.procs["b"].pid, signal.SIGCONT)

    # 200 jobs: a backlog that outlasts the takeover (the fake engine's pace bounds the peers')
    pool, row = run_scenario("sigstop", own_redis["server"].url, tmp_path, fault, n_jobs=200)
    assert pool.deaths() == 0
    assert held["after_s"] >= 1.0 and held["queued"] > 0, held  # past the window, before the backlog
    # a job whose result landed just before the stop, unacknowledged, is no restart
    assert held["b"] >= 8 and row["taken_over"] >= held["b"] - 2, (held, row)


def test_chaos_redis_restart(own_redis, tmp_path):
    from genpool.workers.integrations import embedded

    def fault(pool, c):
        server = own_redis["server"]
        server.stop()
        time.sleep(1.0)
        own_redis["server"] = embedded.start_server(port=server.port, data_dir=server.dir,
                                                    fsync="always")

    pool, _ = run_scenario("redis-restart", own_redis["server"].url, tmp_path, fault)
    assert pool.deaths() == 0


def test_chaos_memory_pressure(own_redis, tmp_path):
    """Issue 28 item 1: maxmemory below used_memory under noeviction for 3 claim windows
    (new writes refused with OOM, deletes and reads allowed), then lifted."""
    def fault(pool, c):
        with memory_pressure(c.redis):
            time.sleep(3.0)
        return {"refusals": refusals(c.redis, "OOM")}

    pool, row = run_scenario("memory-pressure", own_redis["server"].url, tmp_path, fault,
                             restarts=False)
    assert pool.deaths() == 0 and row["refusals"] > 0


def test_chaos_refused_writes(own_redis, tmp_path):
    """Issue 28 item 6: every write refused (min-replicas-to-write 1, no replica) for 2 s."""
    def fault(pool, c):
        with refused_writes(c.redis):
            time.sleep(2.0)
        return {"refusals": refusals(c.redis, "NOREPLICAS")}

    pool, row = run_scenario("refused-writes", own_redis["server"].url, tmp_path, fault,
                             restarts=False)
    assert pool.deaths() == 0 and row["refusals"] > 0


def test_chaos_huge_inputs_do_not_stall_a_real_worker(redis_url, tiny_llama_long_path, tmp_path):
    """Issue 16's second report, scaled to CI: two tiny-Llama workers share 20 long jobs; then
    8 chat jobs of 1 MB (tokenized, then refused as too long) and 2 of 3 MB (refused unread)
    arrive. Whoever prepares them must keep stepping and renewing its leases: no job may be
    taken over (no restart, one result each). The longest step-loop stall goes to the report."""
    prefix = new_prefix("stall")
    c = Client(redis_url, prefix)
    common = ("--max-num-seqs", "24", "--claim-idle-ms", "3000", "--heartbeat-s", "0.5",
              "--num-threads", "1")
    procs = [spawn_worker(redis_url, prefix, tiny_llama_long_path, name, *common,
                          log_path=tmp_path / f"{name}.log") for name in ("w1", "w2")]
    try:
        wait_for(lambda: len(c.status()["workers"]) == 2, timeout=240, what="workers up")
        jobs = c.submit_many([dict(prompt=f"running {i}", max_tokens=160, ignore_eos=True,
                                   temperature=0.0) for i in range(20)])
        wait_for(lambda: all(c.redis.exists(c.keys.events(j.id)) for j in jobs), timeout=120,
                 what="20 jobs running")
        words = "harbor lamp winter signal copper garden market "
        text = words * (1_000_000 // len(words))  # 1 MB: seconds of chat template + tokenizer
        big = [c.submit(messages=[{"role": "user", "content": text}], max_tokens=4)
               for _ in range(8)]
        big += [c.submit(messages=[{"role": "user", "content": text}] * 3, max_tokens=4)
                for _ in range(2)]  # 3 MB: more than the context can hold, refused unread
        results = [j.result(timeout=600) for j in jobs]
        errors = [j.result(timeout=300, raise_on_error=False).error for j in big]
        time.sleep(1.0)  # one more heartbeat carries the stalls of the last ticks
        stalls = [json.loads(v).get("stall_max_s", -1.0) for v in c.redis.hvals(c.keys.workers)]
    finally:
        for p in procs:
            stop_proc(p, 30)
    try:
        assert all(r.ok for r in results)
        assert all(e is not None and e.code == "invalid_request" for e in errors), errors
        assert pool_problems(c, [*jobs, *big]) == {}
        restarts = sum(any('"type":"restart"' in f["event"]
                           for _, f in c.redis.xrange(c.keys.events(j.id))) for j in jobs)
        report({"scenario": "huge inputs, two workers (tiny Llama)", "tried": 30,
                "restarted": restarts, "lost": 0, "duplicated": 0, "stuck": 0,
                "worker_deaths": sum(p.returncode not in (0, None) for p in procs),
                "stall_max_s": max(stalls)})
        assert restarts == 0 and all(c.job(j.id).info()["attempts"] == "1" for j in jobs)
    finally:
        c.close()
        drop_prefix(redis_url, prefix)
