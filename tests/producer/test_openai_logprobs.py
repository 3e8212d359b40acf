"""producer/openai_logprobs.py and the closing chunks that carry logprobs (no Redis)."""
from __future__ import annotations

from genpool.producer import openai_logprobs
from genpool.producer.openai_format import completion_body, final_chunks, parse_body
from genpool.schemas import JobResult

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_completion_top_logprobs_keep_the_higher_of_two_ids_with_one_text():
    """Two halves of a character both read U+FFFD: the legacy {text: logprob} map kept the
    later (lower) one, so a greedy token read as below another alternative."""
    texts = {"7": "\ufffd", "8": "x", "9": "\ufffd"}
    body = openai_logprobs.completion([7], [{"7": -0.5, "8": -0.6, "9": -3.0}], texts, 3)
    assert body["top_logprobs"] == [{"\ufffd": -0.5, "x": -0.6}]
    assert body["token_logprobs"] == [-0.5]


def test_a_streamed_answer_held_back_for_tools_keeps_its_logprobs():
    """With tools active the tokens are held back until the end tells text from calls; their
    logprobs came with nothing (null) while the same request unstreamed had them."""
    ask = [{"role": "user", "content": "Weather?"}]
    stream = parse_body("chat", {"model": "m", "messages": ask, "tools": [WEATHER],
                                 "logprobs": True, "top_logprobs": 1, "stream": True})
    plain = parse_body("chat", {"model": "m", "messages": ask, "tools": [WEATHER],
                                "logprobs": True, "top_logprobs": 1})
    for text in ("Sunny.", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'):
        res = JobResult(id="j", text=text, token_ids=[1, 2], finish_reason="stop",
                        logprobs=[{"1": -0.1, "3": -2.0}, {"2": -0.2}],
                        token_texts={"1": "Sun", "2": "ny.", "3": "Rain"})
        chunks = final_chunks(stream, res, 0)
        streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]
                    and c["choices"][0]["logprobs"] is not None]
        assert streamed == [completion_body(plain, res)["choices"][0]["logprobs"]], text
        assert [e["token"] for e in streamed[0]["content"]] == ["Sun", "ny."]


def test_stream_options_need_a_stream():
    """OpenAI and vLLM refuse stream_options without stream: accepted, include_usage was
    silently ignored (no usage chunk exists on an unstreamed answer). A null include_usage is
    the same as false."""
    import pytest

    from genpool.producer.openai_format import APIError

    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError) as e:
        parse_body("chat", {**ask, "stream_options": {"include_usage": True}})
    assert e.value.status == 400 and e.value.param == "stream_options"
    req = parse_body("chat", {**ask, "stream": True, "stream_options": {"include_usage": None}})
    assert req.stream and not req.include_usage
    with pytest.raises(APIError):  # a number is no boolean (1 == True in Python)
        parse_body("chat", {**ask, "stream": True, "stream_options": {"include_usage": 1}})
