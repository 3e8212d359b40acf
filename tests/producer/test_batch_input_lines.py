"""A batch input file is read the same way at upload and when the batch runs: a file the upload
accepts is one the driver can parse line by line, and every accepted custom_id makes a job id.
(A line the upload's check let through and the driver could not read left its batch in
`validating` for good: not cancellable, not expiring, re-read every pass.)"""
from __future__ import annotations

import json

import pytest

from genpool.producer.batch import parse_line
from genpool.producer.batch_lines import line_job_id
from genpool.producer.jsonl import parse_lines
from genpool.producer.openai_files import check_lines, parse_upload
from genpool.producer.openai_format import APIError


def good(cid: str = "a", prompt: str = "hi", **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": prompt, **extra}}, ensure_ascii=False)


HOSTILE = {
    "no-break space after": good() + "\u00a0",
    "ideographic space before": "\u3000" + good(),
    "em space after": good() + "\u2003",
    "unit separator after": good() + "\x1f",
    "lone surrogate custom_id": good().replace('"a"', '"\\ud800"', 1),
    "url is an array": good().replace('"/v1/completions"', '["/v1/completions"]'),
    "url is an object": good().replace('"/v1/completions"', '{"a": 1}'),
    "custom_id is a number": good().replace('"a"', "7", 1),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_line_the_driver_cannot_run_is_refused_at_upload(name):
    text = good("first") + "\n" + HOSTILE[name] + "\n"
    n, bad = check_lines(text)
    assert [e.line for e in bad] == [2], (name, bad)
    with pytest.raises(APIError) as e:
        parse_upload(text.encode())
    assert e.value.status == 400 and "line 2" in e.value.message


ACCEPTED = {
    # JSON allows these raw inside a string; str.splitlines() broke the line there
    "line separator in a prompt": good(prompt="one\u2028two"),
    "paragraph separator in a prompt": good(prompt="one\u2029two"),
    "next line in a prompt": good(prompt="one\x85two"),
    "CRLF ending": good() + "\r",
    "JSON whitespace around": " \t" + good() + " \t",
    "a custom_id of any script": good(cid="ключ-🙂"),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_accepted_line_parses_the_same_when_the_batch_runs(name):
    raw = ACCEPTED[name]
    text = "\n\n" + raw + "\n" + good("last") + "\n"
    assert check_lines(text) == (2, []), name
    assert parse_upload(text.encode()) == (text, 2)
    parsed = parse_lines(text)
    assert [n for n, _ in parsed] == [3, 4]  # numbered as the upload's errors number them
    assert parsed[0][1] == json.loads(raw)
    for _, obj in parsed:
        assert line_job_id("batch_x", obj["custom_id"]).startswith("batch-")


def test_the_client_side_runner_answers_a_non_string_url_as_the_lines_error():
    for url in (["/v1/completions"], {"a": 1}):
        raw = json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": {}}).encode()
        got = parse_line(raw, 1, "f00d", None, 0)  # raised TypeError (unhashable) for a list
        assert got.error["param"] == "url" and "url must be one of" in got.error["message"]
