"""Speculative drafts with the engine's other machinery (engine/speculative.py): the prefix cache
serving blocks written while drafting, resume (greedy, seeded n=2) and abort, priority preemption,
prompt scoring in the same batch, fault isolation, tensor parallelism, and a randomized
differential run against decoding without drafts (tokens, text, finish and stop reasons)."""
import random

import pytest

from genpool.engine import LLM, SamplingParams
from genpool.engine.resume import ResumeState
from tests.tp_helpers import write_tiny

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 16}  # correctness, not the default
PROMPTS = [[3 + (i * 7 + j * 13) % 50 for j in range(n)] for i, n in enumerate((12, 30, 5, 41))]
GREEDY = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _drive(eng, reqs, on_step=None) -> dict:
    """reqs: (id, prompt ids, params, extra add_request kwargs); {(id, index): [tokens, text,
    finish_reason, stop_reason]} from the streamed deltas; every block is back at the end."""
    for rid, p, sp, kw in reqs:
        eng.add_request(rid, {"prompt_token_ids": p}, sp, **kw)
    acc, step = {}, 0
    while eng.has_unfinished_requests():
        step += 1
        if on_step:
            on_step(eng, step)
        for o in eng.step():
            for c in o.outputs:
                a = acc.setdefault((o.request_id, c.index), [[], "", None, None])
                a[0] += c.token_ids
                a[1] += c.text
                a[2], a[3] = c.finish_reason, c.stop_reason
            if o.error is not None:
                acc[(o.request_id, "error")] = o.error.code
    assert eng.block_manager.num_used_blocks == 0
    return acc


def test_prefix_cache_serves_blocks_filled_while_drafting(tiny_llama_path):
    """Prompts that extend earlier outputs hit the blocks hashed during drafting steps: their
    K/V are the verified tokens' (the same continuations as without drafts or cache)."""
    res = {}
    for spec in (None, NGRAM):
        with LLM(str(tiny_llama_path), num_kv_blocks=64, speculative_config=spec) as llm:
            first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
            again = [{"prompt_token_ids": p + o.outputs[0].token_ids[:37]}
                     for p, o in zip(PROMPTS, first)]
            second = llm.generate(again, GREEDY.clone(max_tokens=30))
            res[spec is None] = (_ids(first), _ids(second))
            hits = llm.llm_engine.stats()["prefix_cache_hits"]
    with LLM(str(tiny_llama_path), num_kv_blocks=64, enable_prefix_caching=False) as llm:
        fresh = _ids(llm.generate(again, GREEDY.clone(max_tokens=30)))
    assert res[True] == res[False] and res[False][1] == fresh and hits > 0


@pytest.mark.parametrize("params,cut", [
    (GREEDY, [23]),
    (SamplingParams(temperature=0.3, top_p=0.9, seed=3, n=2, max_tokens=50, ignore_eos=True),
     [17, 29]),
])
def test_resume_with_drafts_continues_token_for_token(tiny_llama_path, params, cut):
    """Resumed completions draft after their recomputed prefix; one request aborted mid-run."""
    with LLM(str(tiny_llama_path), num_kv_blocks=64, speculative_config=NGRAM) as llm:
        full = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params))
        eng = llm.llm_engine
        reqs = [(f"r{i}", p, params, {"resume": ResumeState(
            [full[i][k][:c] for k, c in enumerate(cut)], seed=params.seed)})
            for i, p in enumerate(PROMPTS)]
        reqs.append(("gone", PROMPTS[1], params, {}))
        got = _drive(eng, reqs, lambda e, s: s == 5 and e.abort_request("gone"))
        assert got[("gone", 0)][2] == "abort"
        for i in range(len(PROMPTS)):
            for k, c in enumerate(cut):
                assert full[i][k][:c] + got[(f"r{i}", k)][0] == full[i][k]
        assert eng.speculator.accepted > 0


def test_priority_preemption_of_drafting_sequences(tiny_llama_path):
    with LLM(str(tiny_llama_path), num_kv_blocks=64) as llm:
        want = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))

    def arrive(eng, step):  # higher-priority requests take the slots of drafting ones
        if step in (6, 9):
            k = 2 if step == 6 else 3
            eng.add_request(f"r{k}", {"prompt_token_ids": PROMPTS[k]}, GREEDY, priority=-k)

    with LLM(str(tiny_llama_path), num_kv_blocks=64, max_num_seqs=2,
             speculative_config=NGRAM) as llm:
        got = _drive(llm.llm_engine, [(f"r{i}", PROMPTS[i], GREEDY, {"priority": 5})
                                      for i in range(2)], arrive)
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert [[got[(f"r{i}", 0)][0]] for i in range(4)] == want


def test_prompt_scoring_beside_drafts_chunked_and_preempted(tiny_llama_path):
    params = [GREEDY.clone(prompt_logprobs=3), GREEDY] * 2
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = dict(num_kv_blocks=10, max_num_batched_tokens=16)
    with LLM(str(tiny_llama_path), **kw) as llm:
        a = llm.generate(prompts, params)
    with LLM(str(tiny_llama_path), speculative_config=NGRAM, **kw) as llm:
        b = llm.generate(prompts, params)
        stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
    assert _ids(a) == _ids(b)
    for x, y in zip(a, b):
        assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)
        for d, e in zip((x.prompt_logprobs or [None])[1:], (y.prompt_logprobs or [None])[1:]):
            assert d.keys() == e.keys() and all(d[k] == pytest.approx(e[k], abs=1e-5) for k in d)


def test_a_failing_step_with_drafts_and_prompt_rows_is_isolated(tiny_llama_path):
    sp = GREEDY.clone(max_tokens=40)
    reqs = [(f"r{i}", p, sp.clone(prompt_logprobs=2) if i % 2 else sp, {})
            for i, p in enumerate(PROMPTS)]
    kw = dict(num_kv_blocks=24, max_num_batched_tokens=24, speculative_config=NGRAM)
    with LLM(str(tiny_llama_path), **kw) as llm:
        want = _drive(llm.llm_engine, reqs)
    with LLM(str(tiny_llama_path), **kw) as llm:
        eng, steps = llm.llm_engine, [0]
        real = eng.runner.execute

        def execute(scheduled, copies):  # "bad" faults the step once it is decoding
            if steps[0] >= 8 and any(seq.request_id == "bad" for seq, _ in scheduled):
                raise RuntimeError("kernel fault")
            return real(scheduled, copies)

        eng.runner.execute = execute
        got = _drive(eng, reqs[:2] + [("bad", PROMPTS[1][:20], sp, {})] + reqs[2:],
                     lambda e, s: steps.__setitem__(0, s))
        assert eng.speculator.accepted > 0
    assert got.pop(("bad", "error")) == "internal"
    assert {k: v for k, v in got.items() if k[0] != "bad"} == want


def test_tensor_parallel_ranks_keep_draft_and_prompt_rows(tmp_path):
    tiny4 = write_tiny(tmp_path, heads=4, kv_heads=2)
    prompts = ["a b c a b c a b c a b c", "The river stone lamp harbor river stone lamp harbor"]
    params = [GREEDY.clone(max_tokens=24, prompt_logprobs=2), GREEDY.clone(max_tokens=24)]
    kw = dict(num_kv_blocks=32, max_num_batched_tokens=64)
    want = LLM(str(tiny4), **kw).generate(prompts, params)
    llm = LLM(str(tiny4), tensor_parallel_size=2, speculative_config=NGRAM, **kw)
    try:
        got = llm.generate(prompts, params)
        assert llm.llm_engine.speculator.accepted > 0
    finally:
        llm.llm_engine.runner.close()
    assert _ids(got) == _ids(want)
    for d, e in zip(want[0].prompt_logprobs[1:], got[0].prompt_logprobs[1:]):
        assert d.keys() == e.keys() and all(d[k] == pytest.approx(e[k], abs=1e-4) for k in d)


def _random_case(rng: random.Random):
    prompts, params = [], []
    for _ in range(rng.randint(1, 5)):
        base = [rng.randint(3, 60) for _ in range(rng.randint(2, 6))]
        prompts.append((base * 8)[:rng.randint(3, 45)])
        kw = dict(max_tokens=rng.randint(3, 50), ignore_eos=rng.random() < 0.5,
                  min_tokens=rng.choice([0, 0, 3]), temperature=0)
        if rng.random() < 0.4:
            kw.update(temperature=0.7, seed=rng.randint(0, 99), n=rng.choice([1, 2]))
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randint(3, 60)]
        if rng.random() < 0.3:
            kw["repetition_penalty"] = 1.1
        params.append(SamplingParams(**kw))
    engine = dict(num_kv_blocks=rng.choice([12, 20, 64]), block_size=rng.choice([4, 16]),
                  max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=rng.choice([2, 8]))
    return prompts, params, engine, [rng.randint(0, 2) for _ in prompts]


def test_random_batches_equal_decoding_without_drafts(tiny_llama_path):
    rng = random.Random(11)

    def run(spec, prompts, params, engine, prios):
        with LLM(str(tiny_llama_path), speculative_config=spec, **engine) as llm:
            reqs = [(f"r{i}", p, sp, {"priority": prios[i]})
                    for i, (p, sp) in enumerate(zip(prompts, params))]
            return _drive(llm.llm_engine, reqs), llm.llm_engine.speculator.accepted

    accepted = 0
    for _ in range(8):
        prompts, params, engine, prios = _random_case(rng)
        plain, _ = run(None, prompts, params, engine, prios)
        for i, sp in enumerate(params):  # stop strings taken from the plain text
            t = plain[(f"r{i}", 0)][1]
            if len(t) > 10 and rng.random() < 0.5:
                j = rng.randint(2, len(t) - 3)
                params[i] = sp.clone(stop=[t[j:j + 2]], include_stop_str_in_output=rng.random() < 0.5)
        plain, _ = run(None, prompts, params, engine, prios)
        spec, acc = run({**NGRAM, "num_speculative_tokens": 5}, prompts, params, engine, prios)
        accepted += acc
        assert spec == plain, (engine, [(k, plain[k], spec.get(k)) for k in plain if plain[k] != spec.get(k)])
    assert accepted > 0


def test_jobs_asking_for_logprobs_never_draft(tiny_llama_path):
    with LLM(str(tiny_llama_path), num_kv_blocks=64, speculative_config=NGRAM) as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY.clone(logprobs=1))[0]
        assert llm.llm_engine.speculator.drafted == 0
    assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids) == 50


@pytest.mark.checkpoint
def test_smollm2_multibyte_text_and_stop_strings_equal_without_drafts(smollm2_path):
    """Characters split over byte-level tokens, cut by max_tokens or not, and stop strings:
    the same text, tokens, finish and stop reasons."""
    doc = "Menu: 東京ラーメン 😀 ¥980, 大阪たこ焼き 🐙 ¥650, 京都抹茶 🍵 ¥420."
    msgs = [{"role": "user", "content": f"Repeat this menu exactly, three times:\n{doc}"}]
    base = SamplingParams(temperature=0, max_tokens=60)
    variants = [base, base.clone(stop=["ン, ラ"], skip_special_tokens=False),
                base.clone(stop=["メン, ラー"], include_stop_str_in_output=True)]
    res = []
    for spec in (None, NGRAM):
        with LLM(str(smollm2_path), num_kv_blocks=64, speculative_config=spec) as llm:
            outs = [llm.chat(msgs, p)[0].outputs[0] for p in variants]
            res.append([(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in outs])
            accepted = llm.llm_engine.speculator.accepted
    assert res[0] == res[1] and accepted > 0
    assert [r[2] for r in res[0]] == ["length", "stop", "stop"]
