"""Hostile stream entries -> precise errors or dead-letter reasons, never an exception."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from genpool.workers.intake import MAX_PAYLOAD_BYTES, Entry, parse_entry

SERVED = frozenset({"tiny", "smollm2-135m"})


def entry(fields) -> Entry:
    return Entry("p:jobs:normal", "normal", "1-0", fields)


def parse(payload) -> object:
    return parse_entry(entry({b"job": payload}), SERVED)


def test_valid_entry():
    p = parse(json.dumps({"id": "j1", "prompt": "hi", "model": "tiny"}).encode())
    assert p.ok and p.job_id == "j1" and p.req.max_tokens == 16


def test_each_kind_of_bad_input():
    cases = {
        b'{"id": "a1", "prompt": "x",': ("a1", "not valid JSON"),
        b'{"id": "a2", "prompt": "\xff\xfe"}': ("a2", "not valid UTF-8: byte 0xff at offset 24"),
        b'{"id": "a3", "prompt": 12}': ("a3", "prompt: Input should be a valid string"),
        b'{"id": "a4", "prompt": "x", "max_tokens": -1}': ("a4", "max_tokens: Input should be"),
        b'{"id": "a5", "prompt": "x", "model": "gpt"}': ("a5", "model 'gpt' is not served"),
        b'{"id": "a6", "prompt": "x", "bogus": 1}': ("a6", "unknown field 'bogus'"),
        b'{"id": "a7", "prompt": "' + b"x" * 1_000_001 + b'"}': ("a7", "at most 1000000"),
    }
    for raw, (job_id, msg) in cases.items():
        p = parse(raw)
        assert not p.ok and p.job_id == job_id and p.dead_reason is None
        assert msg in p.error.message, (raw[:60], p.error.message)
    assert parse(b'{"id": "a5", "prompt": "x", "model": "gpt"}').error.code == "unknown_model"


def test_unrecoverable_entries_are_dead_lettered():
    assert "no 'job' field" in parse_entry(entry({b"foo": b"bar"}), SERVED).dead_reason
    assert "JSON object" in parse(b"[1, 2]").dead_reason
    assert "missing 'id'" in parse(b'{"prompt": "x"}').dead_reason
    assert "invalid 'id'" in parse(b'{"id": "has space", "prompt": "x"}').dead_reason
    assert parse(b"\xff\x00garbage").dead_reason.startswith("job is not valid UTF-8")
    assert "not valid JSON" in parse(b"not json at all").dead_reason
    assert "nested too deeply" in parse(b"[" * 100_000 + b"]" * 100_000).dead_reason
    big = b'{"id": "big", "prompt": "' + b"y" * MAX_PAYLOAD_BYTES + b'"}'
    assert "bytes; the limit is" in parse(big).error.message


def test_a_constraint_nested_too_deeply_is_that_jobs_error():
    """A schema given as JSON text nested past the parser's recursion limit is the job's
    invalid_request, not an exception that stops the worker (a RecursionError is no ValueError,
    so pydantic passed it through)."""
    text = json.dumps({"id": "d1", "prompt": "x", "structured_outputs": {"json": "[" * 5000}}).encode()
    p = parse(text)
    assert not p.ok and p.job_id == "d1" and p.error.code == "invalid_request"
    assert "nested too deeply" in p.error.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                              max_size=4),
    max_leaves=12)
fields = st.sampled_from(["id", "prompt", "messages", "max_tokens", "temperature", "model", "n",
                          "top_k", "stop", "seed", "priority", "deadline", "v", "junk"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=8) | json_values | st.binary(max_size=200))
def test_parse_never_raises_and_always_explains(obj):
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    p = parse(raw)
    if p.ok:
        assert p.req.id == p.job_id
    elif p.job_id:
        assert p.error.code in ("invalid_request", "unknown_model") and p.error.message
    else:
        assert p.dead_reason


def test_a_cost_that_is_no_ascii_number_charges_nothing_and_raises_nothing():
    """A producer writes the entry's `cost`: "²" passes str.isdigit() and then int() raised at
    the job's result (workers/usage.py)."""
    from genpool.schemas import ResultEvent
    from genpool.workers.usage import UsageCount

    done = ResultEvent(text="x", finish_reason="stop", usage={"prompt_tokens": 1, "completion_tokens": 1})
    for cost, charged in (("²".encode(), None), ("١٢".encode(), None), (b"-3", None), (b"12", 12)):
        job = parse_entry(entry({b"job": json.dumps({"id": "c1", "prompt": "hi"}).encode(),
                                 b"cost": cost}), SERVED)
        assert UsageCount.of(job, done).charged == charged, cost


def test_an_unreadable_entry_is_told_to_its_own_job_not_a_nested_id():
    """A job that cannot be parsed is answered under its own top-level id. An "id" inside a
    nested object (metadata, a tool call) is another job's id or none: an error there would land
    on that job's hash (or be dropped as a duplicate) while this one waited for ever."""
    cases = {
        b'{"metadata": {"id": "order-77"}, "id": "job-1", "prompt": "caf\xe9"}': "job-1",
        b'{"tools": [{"id": "call_9"}], "id": "job-2", "prompt": "x",': "job-2",
        b'{"prompt": "\\"id\\": \\"fake\\"", "id": "job-3", "x": "\xff"}': "job-3",
        b'{"metadata": {"id": "order-77"}, "prompt": "\xff"}': None,
        b'[{"id": "in-a-list"}, "\xff"]': None,
    }
    for raw, want in cases.items():
        p = parse(raw)
        assert not p.ok and p.job_id == want, (raw, p.job_id)
        assert (p.dead_reason is None) == (want is not None)
    import time
    t = time.perf_counter()  # the id is looked for in bounded time, even in 8 MB of brackets
    assert parse(b"[" * MAX_PAYLOAD_BYTES + b'"\xff"').dead_reason
    assert time.perf_counter() - t < 1.0


def test_a_flood_of_validation_errors_is_summed_up_fast_and_short():
    """A 3 MB list of bad token ids was a million pydantic errors: seconds of the engine loop and
    a message of tens of MB written to the job's stream and hash. Lists stop at their first bad
    item, and the message names a few problems and counts the rest."""
    import time
    cases = [{"prompt_token_ids": [-1] * 1_000_000}, {"stop_token_ids": [-1] * 200_000, "prompt": "x"},
             {"prompt": "x", **{f"bogus{i}": 1 for i in range(5000)}},
             {"prompt": "x", "logit_bias": {"k" * 100_000 + str(i): 1 for i in range(20)}},
             {"messages": [{"role": "nobody", "content": 1}] * 100_000}]
    for extra in cases:
        raw = json.dumps({"id": "flood", **extra}).encode()
        t = time.perf_counter()
        p = parse(raw)
        took = time.perf_counter() - t
        assert not p.ok and p.job_id == "flood" and p.error.code == "invalid_request"
        assert len(p.error.message) <= 4000, (list(extra)[0], len(p.error.message))
        assert took < 1.0, (list(extra)[0], took)
    many = parse(json.dumps({"id": "m", "prompt": "x", **{f"b{i}": 1 for i in range(50)}}).encode())
    assert "unknown field 'b0'" in many.error.message and "more" in many.error.message
