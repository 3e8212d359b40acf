"""Structured outputs on the real model (SmolLM2): JSON schemas, regex, choice, grammars, errors.

Every JSON output is parsed and validated with the `jsonschema` package; the schemas come from
benchmarks/records.py (nested objects, bounded arrays, enums, bounded numbers, optional fields,
patterned strings). One engine serves the module; the preemption test builds a tiny-KV one.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from benchmarks.records import make_cases, messages
from genpool.engine import LLM, SamplingParams

MAX_TOKENS = 200  # a complete record takes < 80 tokens


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), num_kv_blocks=1024, max_num_seqs=64, num_threads=2)


def chat_ids(llm, msgs) -> dict:
    eng = llm.llm_engine
    return {"prompt_token_ids": eng.tokenizer(eng.apply_chat_template(msgs),
                                              add_special_tokens=False)["input_ids"]}


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def accepted_by(llm, so: dict, token_ids: list[int]) -> int:
    """How many of token_ids a fresh matcher of the same constraint accepts, in order."""
    from genpool.engine.structured_params import StructuredOutputsParams

    fut = llm.llm_engine.structured.cache.get(StructuredOutputsParams.coerce(so))
    return fut.result(timeout=30).matcher.deep_copy().validate_tokens(token_ids)


def test_42_records_validate_and_unconstrained_rows_are_untouched(llm):
    cases = make_cases(42, seed=3)
    prompts = [chat_ids(llm, messages(c)) for c in cases]
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs={"json": c.schema}) for i, c in enumerate(cases)]
    plain_prompts = [chat_ids(llm, [{"role": "user", "content": f"Tell me about {w}."}])
                     for w in ("rivers", "bread", "owls", "glass")]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts + plain_prompts, params + [plain] * len(plain_prompts))
    for case, out in zip(cases, outs):
        comp = out.outputs[0]
        assert out.error is None and comp.finish_reason == "stop", comp
        assert_valid(comp.text, case.schema)
    mixed = [o.outputs[0].token_ids for o in outs[len(cases):]]
    alone = [llm.generate(p, plain)[0].outputs[0].token_ids for p in plain_prompts]
    assert mixed == alone  # the constrained rows' masks never touched the other rows


def test_regex_choice_and_grammars(llm):
    q = chat_ids(llm, [{"role": "user", "content": "Give me a ticket code and say if it is valid."}])
    regex = r"[A-Z]{2}-[0-9]{3}( ok| bad)"
    lark = 'start: "ticket " code\ncode: /[0-9]{2}/ ("a" | "b")'
    gbnf = 'root ::= "x" [0-9] [0-9]? "!"'
    cases = [({"regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"choice": ["valid", "invalid", "unknown"]},
              lambda t: t in ("valid", "invalid", "unknown")),
             ({"grammar": lark}, lambda t: re.fullmatch(r"ticket [0-9]{2}[ab]", t)),
             ({"grammar": gbnf}, lambda t: re.fullmatch(r"x[0-9][0-9]?!", t))]
    for temp in (0.0, 1.0):
        outs = llm.generate([q] * len(cases), [SamplingParams(temperature=temp, seed=5,
                                                              max_tokens=30, structured_outputs=so)
                                               for so, _ in cases])
        for (so, ok), out in zip(cases, outs):
            assert out.error is None and out.outputs[0].finish_reason == "stop", (so, out)
            assert ok(out.outputs[0].text), (so, out.outputs[0].text)


def test_logprobs_of_a_constrained_job_are_the_models_raw_distribution(llm):
    """logprobs are the model's raw distribution (docs/protocol.md) for constrained jobs too: the
    first token's top 20 equal an unconstrained job's on the same prompt, all finite (the
    grammar's mask made them -inf, which JSON cannot carry: readers and takeovers choked on null)."""
    q = chat_ids(llm, [{"role": "user", "content": "Is the sky green? Answer yes or no."}])
    free, bound = llm.generate([q, q], [
        SamplingParams(temperature=0, max_tokens=1, logprobs=20),
        SamplingParams(temperature=0, max_tokens=4, logprobs=20, structured_outputs={"choice": ["maybe", "perhaps"]})])
    assert bound.error is None and bound.outputs[0].text in ("maybe", "perhaps")
    first_free, first_bound = free.outputs[0].logprobs[0], bound.outputs[0].logprobs[0]
    def top20(d: dict) -> dict:
        return dict(sorted(d.items(), key=lambda kv: -kv[1])[:20])
    assert top20(first_bound) == pytest.approx(top20(first_free))
    assert all(v > float("-inf") for lp in bound.outputs[0].logprobs for v in lp.values())


def test_n_samples_stop_strings_and_max_tokens(llm):
    case = make_cases(1, seed=11)[0]
    so = {"json": case.schema}
    q = chat_ids(llm, messages(case))
    n3, cut, stopped = llm.generate([q, q, q], [
        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=MAX_TOKENS, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=6, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[","], structured_outputs=so)])
    assert len(n3.outputs) == 3
    for comp in n3.outputs:  # each sample its own matcher: all three complete and valid
        assert comp.finish_reason == "stop"
        assert_valid(comp.text, case.schema)
    comp = cut.outputs[0]  # max_tokens ends it early: `length`, and a valid prefix
    assert comp.finish_reason == "length" and len(comp.token_ids) == 6
    assert accepted_by(llm, so, comp.token_ids) == 6
    with pytest.raises(ValueError):
        json.loads(comp.text)
    comp = stopped.outputs[0]  # a stop string ends it: the text before it
    assert comp.finish_reason == "stop" and comp.stop_reason == ","
    assert comp.text.startswith("{") and "," not in comp.text


def test_preemption_and_prefix_cache_keep_matchers_in_step(llm):
    """A sequence preempted mid-output (blocks freed, tokens recomputed later, its prompt blocks
    back from the prefix cache) ends with the same valid record as without preemption."""
    from genpool.engine.scheduler import SchedulerOutput

    eng = llm.llm_engine
    cases = make_cases(2, seed=21)
    prompts = [chat_ids(llm, messages(c)) for c in cases]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": c.schema})
              for c in cases]
    plain = llm.generate(prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"pre{i}", p, sp)
    seqs = [eng.requests[f"pre{i}"].seqs[0] for i in range(2)]
    while seqs[0].num_output_tokens < 8:
        eng.step()
    preempted, hits = eng.stats()["num_preemptions"], eng.stats()["prefix_cache_hits"]
    eng.scheduler._preempt(seqs[0], SchedulerOutput())  # what a full KV cache does to it
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    assert st["num_preemptions"] == preempted + 1 and st["prefix_cache_hits"] > hits
    for case, seq, want in zip(cases, seqs, plain):
        assert seq.finish_reason == "stop" and seq.output_token_ids == want.outputs[0].token_ids
        assert_valid(seq.detokenizer.text, case.schema)


def wide_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}x"}
                                             for i in range(n)}, "required": [f"f{i}" for i in range(n)]}


def deep_schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


BAD = [  # (constraint, words its error must contain)
    ({"json": {"type": "strng"}}, "Invalid type"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, "Unsatisfiable"),
    ({"json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "Unsatisfiable"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"regex": "(?=a)b"}, "look-around"),
    ({"grammar": "start: missing_rule"}, "unknown name"),
    ({"json": deep_schema(150)}, "recursion limit"),
]


def test_bad_constraints_fail_their_request_alone(llm):
    q = chat_ids(llm, [{"role": "user", "content": "Hello"}])
    outs = llm.generate([q] * (len(BAD) + 1), [SamplingParams(temperature=0, max_tokens=5,
                                                              structured_outputs=so)
                                               for so, _ in BAD] + [SamplingParams(max_tokens=5)])
    for (so, words), bad in zip(BAD, outs):
        kind = next(iter(so))
        assert bad.error is not None and bad.error.code == "invalid_request", bad
        assert bad.error.message.startswith(f"structured_outputs.{kind}: "), bad
        assert words in bad.error.message and bad.outputs[0].finish_reason == "abort"
    good = outs[-1]
    assert good.error is None and len(good.outputs[0].token_ids) == 5


def test_a_constraint_that_matches_nothing_with_n_samples_fails_that_request_alone(llm):
    """A regex that compiles but matches no string fails at its first mask. With n >= 2 the
    failed request's samples were still split off after it was gone (KeyError in the sample
    stage): the engine step raised, and the worker with every job beside it went down."""
    q = chat_ids(llm, [{"role": "user", "content": "Hello"}])
    nothing = [{"regex": "[^\\s\\S]"}, {"grammar": "start: /[^\\s\\S]/"}]
    params = [SamplingParams(n=n, temperature=0, max_tokens=5, structured_outputs=so)
              for so in nothing for n in (2, 16)] + [SamplingParams(n=3, max_tokens=5, seed=1)]
    outs = llm.generate([q] * len(params), params)
    for bad in outs[:-1]:
        assert bad.error is not None and bad.error.code == "invalid_request", bad
    good = outs[-1]
    assert good.error is None and [len(o.token_ids) for o in good.outputs] == [5, 5, 5]


def test_min_tokens_past_the_constraints_end_is_the_requests_error(llm):
    """After "ab" the regex allows only end-of-text, which min_tokens bans: nothing is left to
    sample. It ended as the model's fault (internal, non-finite logits: a 500 at the gateway)."""
    q = chat_ids(llm, [{"role": "user", "content": "Say ab:"}])
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        (out,) = llm.generate([q], SamplingParams(max_tokens=8, min_tokens=6, **extra,
                                                  structured_outputs={"regex": "ab"}))
        assert out.error is not None and out.error.code == "invalid_request", out
        assert "no token is left" in out.error.message and "min_tokens=6" in out.error.message


def test_a_choice_list_past_llguidances_limit_is_refused_at_add_request(llm):
    """llguidance's parser rows hold 2,000 items and n choices make n + 1: up to 10,000 were
    taken, compiled, then failed at the first token (after a slow mask)."""
    with pytest.raises(ValueError, match="2000 options; the limit is 1999"):
        SamplingParams(structured_outputs={"choice": [f"c{i}" for i in range(2000)]})
    (out,) = llm.generate([chat_ids(llm, [{"role": "user", "content": "Pick"}])],
                          SamplingParams(temperature=0, max_tokens=8, structured_outputs={
                              "choice": [f"option {i}" for i in range(1999)]}))
    assert out.error is None and out.outputs[0].text.startswith("option "), out


def test_bad_json_text_is_refused_at_add_request(llm):
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.llm_engine.add_request("bad-json", "hi", SamplingParams(structured_outputs={"json": "{x"}))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


def test_slow_compile_times_out_without_stalling_others(llm):
    eng = llm.llm_engine
    eng.structured.compile_timeout_s = 0.001  # a 2000-field schema takes ~100 ms to compile
    try:
        q = chat_ids(llm, [{"role": "user", "content": "Hello"}])
        eng.add_request("hostile", q, SamplingParams(max_tokens=5, structured_outputs={"json": wide_schema(2000)}))
        eng.add_request("normal", q, SamplingParams(temperature=0, max_tokens=5))
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        eng.structured.compile_timeout_s = 30.0
    assert "timed out" in done["hostile"].error.message
    assert done["normal"].error is None and done["normal"].outputs[0].finish_reason == "length"


# Regexes whose DFA is exponential in the repeat count (a backtracking engine or an eagerly built
# DFA would hang on them); llguidance builds its lexer lazily, so each compiles in milliseconds and
# each step explores only the states the text reaches.
PATHOLOGICAL = ["(.*a){30}", "(a|b)*a(a|b){20}", "(a|b)*a(a|b){40}", "((a|b)*a(a|b){15}){4}"]


def _valid_prefix(llm, so: dict, out) -> None:
    """A constrained output that ended for any reason is accepted token by token by its constraint."""
    ids = list(out.outputs[0].token_ids)
    if ids and ids[-1] in llm.llm_engine.eos_token_ids:
        ids = ids[:-1]
    assert accepted_by(llm, so, ids) == len(ids), (so, out.outputs[0].text)


def test_pathological_regexes_compile_at_once_and_do_not_stall_other_jobs(llm):
    """Each hostile regex either runs (compiled well inside the real 30 s limit, every output a valid
    prefix, a full match when it stops) or fails its own request with a clear invalid_request error;
    an unconstrained request in the same batch gets exactly the tokens it gets alone."""
    eng = llm.llm_engine
    assert eng.structured.compile_timeout_s == 30.0  # the real limit, not a forced one
    q = chat_ids(llm, [{"role": "user", "content": "Write a long string of the letters a and b."}])
    plain_q = chat_ids(llm, [{"role": "user", "content": "Tell me about owls."}])
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs={"regex": rx})
              for i, rx in enumerate(PATHOLOGICAL) for t in (0.0, 1.0)]
    outs = llm.generate([q] * len(params) + [plain_q], params + [plain])
    for p, out in zip(params, outs):
        so = {"regex": p.structured_outputs.regex}
        if out.error is not None:
            assert out.error.code == "invalid_request", out.error
            assert out.error.message.startswith("structured_outputs.regex: "), out.error
            continue
        comp = out.outputs[0]
        assert comp.finish_reason in ("stop", "length"), comp
        if comp.finish_reason == "stop":
            assert re.fullmatch(so["regex"], comp.text), (so, comp.text)
        _valid_prefix(llm, so, out)
    from genpool.engine.structured_params import StructuredOutputsParams
    for rx in PATHOLOGICAL:
        res = eng.structured.cache.get(StructuredOutputsParams.coerce({"regex": rx})).result(timeout=30)
        assert res.error is None and res.compile_s < 5.0, (rx, res.compile_s, res.error)
    assert outs[-1].error is None
    assert outs[-1].outputs[0].token_ids == llm.generate(plain_q, plain)[0].outputs[0].token_ids


def test_huge_schemas_under_the_real_limits_get_a_clear_outcome(llm):
    """With the engine's real limits (no forced timeout): a 5,000-field schema (~300 KB) compiles and
    its output is a valid prefix; a 100,000-value enum (~1 MB) exceeds llguidance's lexer size
    limit and fails its own request with an error that says so; a 20,000-field one (1.26 MB) is
    over the engine's 1,000,000-character limit and refused before it is queued; a plain request
    submitted after them still runs to its end."""
    eng = llm.llm_engine
    assert eng.structured.compile_timeout_s == 30.0
    q = chat_ids(llm, [{"role": "user", "content": "Fill in the record."}])
    big = {"json": wide_schema(5000)}
    too_many = {"json": {"enum": [f"v{i}" for i in range(100000)]}}
    with pytest.raises(ValueError, match="characters; the limit is 1000000"):
        SamplingParams(structured_outputs={"json": wide_schema(20000)})
    for rid, so in (("big", big), ("too-many", too_many)):
        eng.add_request(rid, q, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    eng.add_request("normal", q, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done, ids = {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():  # each output carries the step's new tokens
            ids.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
            if out.finished:
                done[out.request_id] = out
    assert done["big"].error is None and done["big"].outputs[0].finish_reason == "length", done["big"]
    assert len(ids["big"]) == 8 and accepted_by(llm, big, ids["big"]) == 8
    assert llm.llm_engine.tokenizer.decode(ids["big"]).startswith('{"f0":')
    err = done["too-many"].error
    assert err is not None and err.code == "invalid_request", done["too-many"]
    assert err.message.startswith("structured_outputs.json: ") and "too big (limit" in err.message, err
    assert done["normal"].error is None and len(ids["normal"]) == 5
    stats = eng.structured.cache.stats()
    assert stats["grammar_compile_s_max"] < 30.0


def test_a_token_its_matcher_rejects_fails_that_request_alone(llm, monkeypatch):
    """A token the matcher rejects (here: the mask left off, so greedy picks a token the choice
    forbids) fails its own request with invalid_request naming the token, and is not emitted;
    the other job runs on."""
    eng = llm.llm_engine
    monkeypatch.setattr(eng.structured, "apply_masks", lambda job, logits: [])
    q = chat_ids(llm, [{"role": "user", "content": "Is the sky blue?"}])
    eng.add_request("rejected", q, SamplingParams(temperature=0, max_tokens=20,
                                                  structured_outputs={"choice": ["zqx", "qzx"]}))
    eng.add_request("free", q, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outs: dict[str, list] = {}
    for _ in range(200):
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
        if not eng.has_unfinished_requests():
            break
    bad = outs["rejected"][-1]
    assert bad.error is not None and bad.error.code == "invalid_request", bad
    assert "rejected" in bad.error.message and bad.error.message.startswith("structured_outputs.choice: ")
    assert sum(len(c.token_ids) for o in outs["rejected"] for c in o.outputs) == 0
    free = outs["free"][-1]
    assert free.error is None and free.finished
    assert sum(len(o.outputs[0].token_ids) for o in outs["free"]) == 6
