"""Wire models and key names (no Redis, no torch)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from genpool.schemas import (
    ErrorEvent,
    JobRequest,
    JobResult,
    Keys,
    RestartEvent,
    ResultEvent,
    TokenEvent,
    describe_validation_error,
    lane_for,
    parse_event,
    parse_request,
)
from tests.pool_helpers import ROOT


def test_keys_are_prefixed_and_distinct():
    k = Keys("gp")
    names = [k.jobs("high"), k.jobs("normal"), k.jobs("low"), k.job("a"), k.events("a"),
             k.control, k.dead, k.workers, k.worker("w1")]
    assert all(n.startswith("gp:") for n in names)
    assert len(set(names)) == len(names)
    assert k.events("a") == "gp:job:{a}:events" and k.jobs("low") == "gp:jobs:{gp}:low"
    assert k.job("a") == "gp:job:{a}"
    assert k.lane_of_stream(k.jobs("high")) == "high"
    with pytest.raises(ValueError, match="unknown lane"):
        k.jobs("urgent")
    with pytest.raises(ValueError, match="invalid key prefix"):
        Keys("has space")
    with pytest.raises(ValueError, match="invalid key prefix"):
        Keys("a{b}")  # braces would break the hash tags


def test_keys_hash_slots_for_redis_cluster():
    """What a script, MULTI or multi-stream read touches together must share one slot."""
    from redis.crc import key_slot

    def slot(key: str) -> int:
        return key_slot(key.encode())

    k = Keys("gp", lane_shards=4)
    assert slot(k.job("doc-1")) == slot(k.events("doc-1")) != slot(k.job("doc-2"))
    control_plane = {slot(n) for n in (k.control, k.dead, k.workers, k.worker("w1"), k.meta,
                                       *k.shard_lanes(0))}
    assert len(control_plane) == 1
    shard_slots = [{slot(n) for n in k.shard_lanes(s)} for s in range(4)]
    assert all(len(s) == 1 for s in shard_slots)  # one shard's lanes: one slot
    assert len(set().union(*shard_slots)) == 4  # shards: different slots
    assert len(k.all_jobs()) == 12 and len(set(k.all_jobs())) == 12
    # every shard is used, and a job id always maps to the same one
    from genpool.schemas.keys import shard_for
    assert {shard_for(f"job-{i}", 4) for i in range(100)} == {0, 1, 2, 3}
    assert k.submit_stream("x", "high") == k.submit_stream("x", "high")
    assert Keys("gp").submit_stream("x", "high") == Keys("gp").jobs("high")


@pytest.mark.parametrize("prio,lane", [(-5, "high"), (-1, "high"), (0, "normal"), (1, "low"),
                                       (99, "low")])
def test_lanes(prio, lane):
    assert lane_for(prio) == lane
    assert JobRequest(prompt="x", priority=prio).lane == lane


def _err(data) -> str:
    with pytest.raises(ValidationError) as ei:
        parse_request(json.dumps(data) if isinstance(data, dict) else data)
    return describe_validation_error(ei.value)


def test_precise_messages():
    assert _err({"prompt": "x", "max_tokens": -3}) == \
        "max_tokens: Input should be greater than or equal to 0 (got -3)"
    assert "unknown field 'colour'" in _err({"prompt": "x", "colour": "red"})
    assert "exactly one of 'prompt', 'messages' or 'prompt_token_ids' is required (got none)" in _err({"id": "a"})
    both = {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}
    assert "(got prompt and messages)" in _err(both)
    assert "min_tokens (9) must be <= max_tokens (4)" in _err({"prompt": "x", "max_tokens": 4,
                                                                 "min_tokens": 9})
    assert "temperature: Input should be a valid number (got 'hot')" in \
        _err({"prompt": "x", "temperature": "hot"})
    assert "max_tokens: Input should be a valid integer (got '5')" in \
        _err({"prompt": "x", "max_tokens": "5"})  # strict: no silent "5" -> 5
    assert "messages.0.role" in _err({"messages": [{"role": "robot", "content": "x"}]})
    assert "v: Input should be 1" in _err({"prompt": "x", "v": 2})
    assert "id: String should match pattern" in _err({"id": "a b", "prompt": "x"})
    assert "top_p" in _err({"prompt": "x", "top_p": 0})


def test_defaults_match_engine_sampling_params():
    from genpool.engine import SamplingParams

    req = JobRequest(prompt="x", stop="END", seed=3, logprobs=2)
    sp = SamplingParams(**req.sampling_kwargs())
    assert sp.stop == ["END"] and sp.seed == 3 and sp.logprobs == 2
    dflt = SamplingParams()
    for name, value in JobRequest(prompt="x").sampling_kwargs().items():
        assert getattr(dflt, name) == value, name


def test_request_round_trip():
    req = JobRequest(id="j1", messages=[{"role": "user", "content": "hi"}], temperature=0,
                     metadata={"user": 7}, deadline=1e9, priority=-2)
    back = parse_request(req.to_wire())
    assert back == req and back.lane == "high"
    assert "prompt" not in json.loads(req.to_wire())  # exclude_none keeps the wire small


def test_events_round_trip():
    for ev in [TokenEvent(text="a", token_ids=[1], logprobs=[{"1": -0.5}]),
               RestartEvent(reason="r", attempt=2), ResultEvent(text="ab", finish_reason="stop"),
               ErrorEvent(code="expired", message="late")]:
        back = parse_event(ev.model_dump_json())
        assert back == ev and back.v == 1
    # readers ignore fields added later within version 1
    assert parse_event('{"type":"token","text":"x","new_field":1}').text == "x"
    res = JobResult.from_event("j", ErrorEvent(code="cancelled", message="m"))
    assert not res.ok and res.error.code == "cancelled" and res.text == ""


def test_producer_and_schemas_import_without_torch():
    code = ("import sys; import genpool.producer, genpool.schemas, genpool.producer.cli, genpool.producer.aio; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, check=True)


def test_an_unreadable_ending_is_the_jobs_error_and_other_unreadable_entries_are_skipped():
    """What a reader makes of entries no worker of this version writes. A result or error that
    does not parse (on the stream or in the job's hash) is the job's `internal` error; anything
    else it cannot use (garbage, no event, a null where a number belongs, a type it does not
    know) is skipped, the reader moving past it. Never an exception out of a reader (the gateway
    answered a 500, a batch could never finish)."""
    from genpool.producer.protocol import decode_event, events_in, last_terminal, terminal_from_hash
    from genpool.producer.replay import Gaps, read_events

    for fields in ({"event": "{not json"}, {"seq": "3"}, {"event": '{"type":"telemetry","x":1}'},
                   {"event": '{"type":"token","token_ids":[3],"logprobs":[{"3":null}]}'}):
        assert decode_event(fields) is None, fields
    for ending in ('{"type":"result","text":null}', '{"type":"error","code":"bogus","message":"m"}'):
        ev = decode_event({"event": ending})
        assert isinstance(ev, ErrorEvent) and ev.code == "internal" and "cannot be read" in ev.message
        assert last_terminal([("9-0", {"event": ending})]).code == "internal"
    token = TokenEvent(text="a", token_ids=[1]).model_dump_json()
    reply = [("s", [("1-0", {"event": "{not json"}), ("2-0", {"event": token})])]
    assert [ev.type for _, ev in events_in(reply)] == ["token"]
    assert [(i, ev and ev.type) for i, ev in read_events(reply, Gaps("0-0"))] == [("1-0", None), ("2-0", "token")]
    assert last_terminal([("1-0", {"event": '{"type":"telemetry"}'})]) is None
    for stored in ('{"type":"result","text":null}', '{"type":"zzz"}', "garbage"):
        bad = terminal_from_hash(stored, None)
        assert isinstance(bad, ErrorEvent) and bad.code == "internal", stored
