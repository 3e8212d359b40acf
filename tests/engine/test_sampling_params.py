import json
import re

import pytest

from genpool.engine.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False


def test_defaults_are_not_shared_between_instances():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    a.stop_token_ids.append(3)
    assert b.stop == [] and b.stop_token_ids == []


def test_normalization():
    p = SamplingParams(stop="###", top_k=0, temperature=1, top_p=1, stop_token_ids=(5, 6))
    assert p.stop == ["###"] and p.top_k == -1
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop_token_ids == [5, 6]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
    ({"max_tokens": -3}, "max_tokens must be at least 1 (0 only with prompt_logprobs), got -3"),
    ({"max_tokens": 0}, "max_tokens must be at least 1 (0 only with prompt_logprobs), got 0"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": -2}, "top_k must be -1 or 0 (disabled) or at least 1, got -2"),
    ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
    ({"n": 0}, "n must be at least 1, got 0"),
    ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
    ({"min_tokens": 5, "max_tokens": 4},
     "min_tokens must be <= max_tokens, got min_tokens=5, max_tokens=4"),
    ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
    ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
    ({"n": 1.5}, "n must be an int, got 1.5"),
    ({"n": True}, "n must be an int, got True"),
    ({"top_k": "5"}, "top_k must be an int, got '5'"),
    ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"top_p": None}, "top_p must be a finite number, got None"),
    ({"seed": 1.0}, "seed must be an int or None, got 1.0"),
    ({"max_tokens": 2.0}, "max_tokens must be an int or None, got 2.0"),
    ({"logprobs": True}, "logprobs must be an int or None, got True"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens must be a bool, got 'yes'"),
    ({"stop": 5}, "stop must be a str or a list of str, got int"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty str, got ''"),
    ({"stop": ["ok", 3]}, "stop strings must be non-empty str, got 3"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids must be a list of non-negative ints"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of non-negative ints, got 7"),
])
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0, top_p=1e-9, top_k=1, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, logprobs=0, max_tokens=1, min_tokens=1)
    SamplingParams(logprobs=20, n=4, seed=0, repetition_penalty=0.01)


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0, seed=3).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # float noise around 0 is greedy
    assert SamplingParams().sampling_type == SamplingType.RANDOM
    assert not SamplingParams().is_greedy
    assert SamplingParams(seed=7).sampling_type == SamplingType.RANDOM_SEED


def test_has_penalties():
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


def test_dict_round_trip_is_json_friendly():
    p = SamplingParams(n=2, temperature=0.7, top_k=5, stop="\n\n", stop_token_ids=[2], seed=11,
                       logprobs=3, max_tokens=None, include_stop_str_in_output=True)
    d = p.to_dict()
    d2 = json.loads(json.dumps(d))
    assert d2 == d
    assert d["stop"] == ["\n\n"]
    q = SamplingParams.from_dict(d2)
    assert q == p
    # the dict is a copy, not a view
    d["stop"].append("zzz")
    assert p.stop == ["\n\n"]


def test_from_dict_partial_and_unknown_keys():
    assert SamplingParams.from_dict({"temperature": 0}).temperature == 0.0
    with pytest.raises(ValueError, match="unknown SamplingParams field\\(s\\): best_of, foo"):
        SamplingParams.from_dict({"temperature": 0, "foo": 1, "best_of": 2})
    with pytest.raises(ValueError, match="wants a dict"):
        SamplingParams.from_dict([("n", 1)])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams.from_dict({"temperature": -0.5})


def test_clone():
    p = SamplingParams(temperature=0.5, stop=["x"])
    q = p.clone(seed=5)
    assert q.seed == 5 and q.temperature == 0.5 and q.stop == ["x"] and p.seed is None
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2)
