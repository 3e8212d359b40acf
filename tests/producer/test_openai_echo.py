"""vLLM's `prompt_logprobs` extra on /v1/completions (producer/openai_echo.py): a streamed response
has no field to carry the scores, so, as vLLM, a stream that asks for them (k > 0, or -1) is a 400
naming the parameter, and a streamed 0 is accepted and scores nothing; unstreamed, it is kept."""
from __future__ import annotations

import pytest

from genpool.producer.openai_format import APIError, parse_body

BODY = {"model": "m", "prompt": "The lighthouse keeper", "max_tokens": 4}


@pytest.mark.parametrize("k", [2, -1])
def test_a_stream_asking_for_prompt_logprobs_is_refused(k):
    with pytest.raises(APIError) as e:
        parse_body("completion", dict(BODY, stream=True, prompt_logprobs=k))
    assert e.value.status == 400 and e.value.param == "prompt_logprobs"
    assert "stream" in e.value.body()["error"]["message"]


def test_a_streamed_zero_scores_nothing_and_an_unstreamed_k_is_kept():
    streamed = parse_body("completion", dict(BODY, stream=True, prompt_logprobs=0))
    assert streamed.stream and "prompt_logprobs" not in streamed.kwargs
    kept = parse_body("completion", dict(BODY, prompt_logprobs=2))
    assert not kept.stream and kept.kwargs["prompt_logprobs"] == 2
    echoed = parse_body("completion", dict(BODY, stream=True, echo=True, logprobs=1))
    assert echoed.kwargs["prompt_logprobs"] == 1  # a streamed echo still scores its prompt
