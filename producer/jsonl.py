"""Reading a batch input file, the one way for the client-side runner (producer/batch.py) and the
gateway's Files and Batch API (producer/openai_files.py at upload, producer/batch_driver.py when
the batch runs): what the upload accepts, the driver can parse."""
from __future__ import annotations

import hashlib
import json
from typing import Iterator, Union


def job_id_for(ident: str, custom_id: str) -> str:
    # custom_ids may hold any characters and be long: hash them into the job id alphabet.
    return f"batch-{ident}-{hashlib.sha256(custom_id.encode()).hexdigest()[:32]}"


JSON_WS = " \t\r\n"  # the only whitespace JSON allows around a value (str.strip() takes more)


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of each non-blank line of a JSONL text. Lines end at "\n" alone:
    JSON allows U+2028, U+0085 and the like raw inside a string, where str.splitlines() would
    cut the line (a CRLF's "\r" is JSON whitespace)."""
    for n, raw in enumerate(text.split("\n"), 1):
        if raw.strip(JSON_WS):
            yield n, raw


def line_object(raw: Union[str, bytes]) -> Union[dict, str]:
    """A batch input line's JSON object, with its non-empty string custom_id, or why the line
    is no such object (the client-side runner and the gateway's Files API alike)."""
    try:
        obj = json.loads(raw)  # JSON's own whitespace only: what the batch driver parses
    except (ValueError, UnicodeDecodeError) as e:
        return f"not valid JSON ({e})"
    except RecursionError:
        return "not valid JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return "not a JSON object"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "no custom_id (a non-empty string is required)"
    if not cid.isascii():
        try:
            cid.encode("utf-8")  # it names the line's job id (job_id_for) and output line
        except UnicodeEncodeError:
            return "custom_id is not valid Unicode (it holds a lone surrogate escape)"
    return obj


def parse_lines(text: str) -> list[tuple[int, dict]]:
    """(line number, parsed object) of each non-blank line (checked at upload)."""
    return [(n, json.loads(raw)) for n, raw in jsonl_lines(text)]
