"""Burst routing of a server-side batch: 3 workers with the tiny model (Worker threads, prefix
routing on), 9 documents x 4 questions in one batch through a gateway process, every line in the
file at once. The driver submits each document's first question first and the others once it is
computed, so prefix routing sends them to its worker: the pool computes each document about once
(prompt tokens computed within 1.3x of that floor)."""
from __future__ import annotations

import io
import random
import threading
import time

import pytest

from genpool.schemas import Keys
from genpool.schemas.connection import connect
from tests.batch_api_helpers import Gateway, jsonl, read_file, wait_done
from tests.pool_helpers import drop_prefix, new_prefix

WORDS = "river stone lamp harbor winter signal copper garden market cloud engine paper".split()


def doc(k: int) -> str:
    rng = random.Random(f"batch-doc-{k}")
    return f"Document {k}: " + " ".join(rng.choice(WORDS) for _ in range(120))


@pytest.fixture
def pool(redis_url, tmp_path, tiny_llama_path):
    from genpool.engine import LLM
    from genpool.workers.worker import Worker, WorkerConfig

    prefix = new_prefix("broute")
    llms = [LLM(str(tiny_llama_path), max_num_seqs=8, num_threads=1) for _ in range(3)]
    workers, threads = [], []
    for i, llm in enumerate(llms):
        # indexes published every 0.1 s: a document's other lines go out as soon as its first
        # is answered (4 tokens), and an index that did not show it yet sends them elsewhere
        cfg = WorkerConfig(name=f"w{i}", served_models=frozenset({"tiny"}), prefix_routing=True,
                           heartbeat_s=0.5, prefix_index_s=0.1)
        w = Worker(llm.llm_engine, connect(redis_url, socket_timeout=30), Keys(prefix), cfg)
        threads.append(threading.Thread(target=w.run, daemon=True))
        threads[-1].start()
        workers.append(w)
    gw = Gateway(redis_url, prefix, tmp_path, "gw", "--batch-window", "600")
    try:
        while not all(w.started for w in workers):
            time.sleep(0.05)
        time.sleep(1.0)  # every index published once
        gw.start()
        yield gw, [llm.llm_engine for llm in llms]
    finally:
        gw.stop()
        for w in workers:
            w.stop(drain_timeout_s=5.0)
        for t in threads:  # stopped before the keys go: a running worker makes its lanes again
            t.join(30)
        for llm in llms:
            llm.close()
        drop_prefix(redis_url, prefix)


def computed(engines) -> int:
    return sum(e.stats().prefix_cache_queries - e.stats().prefix_cache_hits for e in engines)


def test_each_document_is_computed_about_once(pool):
    gw, engines = pool
    tok = engines[0].tokenizer
    docs = [doc(k) for k in range(9)]
    lines = [{"custom_id": f"d{k}q{q}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": f"{docs[k]}\nQuestion {q}: what comes next?",
                       "max_tokens": 4, "temperature": 0}}
             for q in range(4) for k in range(9)]  # interleaved, as a pipeline writes them
    floor = 0
    for k in range(9):
        whole = [len(tok(ln["body"]["prompt"])["input_ids"]) for ln in lines
                 if ln["custom_id"].startswith(f"d{k}q")]
        cached = len(tok(docs[k])["input_ids"]) // 16 * 16
        floor += whole[0] + sum(n - cached for n in whole[1:])
    before = computed(engines)
    c = gw.client()
    f = c.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    done = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                         completion_window="24h").id, 300)
    assert done.status == "completed" and len(read_file(c, done.output_file_id)) == 36
    spent = computed(engines) - before
    print(f"computed {spent} prompt tokens, floor {floor}: {spent / floor:.2f}x")
    assert spent <= 1.3 * floor, (spent, floor)
