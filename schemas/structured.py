"""The structured-output part of a job (vLLM's `structured_outputs` names), and its front doors.

`StructuredOutputs` is what the wire carries: exactly one of `json` (a JSON schema), `regex`,
`choice`, `grammar` (Lark or GBNF) or `json_object: true`. `from_response_format` maps OpenAI's
`response_format` onto it. `check_structured` runs llguidance's own validator (no tokenizer, no
torch) when llguidance is installed, so a bad schema or regex fails at the caller with the
engine's message; without llguidance the worker reports the same error on the job's stream.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CONSTRAINT_CHARS = 1_000_000  # the engine's limit too (engine/structured_params.py)
# llguidance's parser rows hold at most 2,000 items, and n choices make a row of n + 1: a longer
# list compiled, then failed at its first token ("Current row has 2001 items; max is 2000")
MAX_CHOICES = 1999
# JSON is generated compact: a small model given free whitespace can emit newlines until
# max_tokens. A schema may override this with llguidance's "x-guidance" key.
JSON_DEFAULTS = {"whitespace_flexible": False}


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True,
                              serialize_by_alias=True)
    json_schema: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    regex: Optional[str] = Field(default=None, min_length=1, max_length=MAX_CONSTRAINT_CHARS)
    choice: Optional[list[str]] = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: Optional[str] = Field(default=None, min_length=1, max_length=MAX_CONSTRAINT_CHARS)
    json_object: Optional[bool] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k, v in (("json", self.json_schema), ("regex", self.regex),
                                ("choice", self.choice), ("grammar", self.grammar),
                                ("json_object", self.json_object)) if v not in (None, False)]
        if len(given) != 1:
            raise ValueError("needs exactly one of json, regex, choice, grammar or "
                             f"json_object=true (got {', '.join(given) or 'none'})")
        if self.choice is not None and any(c == "" for c in self.choice):
            raise ValueError("choice strings must be non-empty")
        # A RecursionError is no ValueError: pydantic would pass it through, out of the worker's
        # per-job handling, so too deep a schema becomes this job's error here.
        if isinstance(self.json_schema, str):
            try:
                parsed = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json is not valid JSON text: {e}") from None
            except RecursionError:
                raise ValueError("json is nested too deeply") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("json must be a JSON schema object")
        try:
            text = self.spec()[1]
        except RecursionError:
            raise ValueError("the constraint is nested too deeply") from None
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the constraint is over {MAX_CONSTRAINT_CHARS} characters")
        return self

    def spec(self) -> tuple[str, str]:
        """(kind, text) as llguidance's grammar_from takes them."""
        if self.json_schema is not None:
            s = self.json_schema
            return "json", s if isinstance(s, str) else json.dumps(s, separators=(",", ":"))
        if self.json_object:
            return "json_object", '{"type":"object"}'
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)

    def engine_dict(self) -> dict[str, Any]:
        """Keyword arguments of engine StructuredOutputsParams."""
        return self.model_dump(exclude_none=True, by_alias=True)


def from_response_format(rf: Any) -> Optional[dict[str, Any]]:
    """OpenAI `response_format` -> a `structured_outputs` dict (None for plain text)."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ValueError("response_format must be an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ValueError("response_format.json_schema must be an object like "
                             "{\"name\": ..., \"schema\": {...}, \"strict\": true}")
        # OpenAI: no schema means any JSON; `strict` changes nothing here, output always follows it
        return {"json": js.get("schema") or {"type": "object"}}
    raise ValueError(f"response_format.type must be text, json_object or json_schema (got {kind!r})")


def schema_of(schema: Any) -> Any:
    """A JSON schema dict from a dict, JSON text or a pydantic model class. A model's objects get
    `additionalProperties: false` (as OpenAI's strict mode does): its fields are the record, and
    without it a small model may keep inventing keys until max_tokens."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        out = schema.model_json_schema()
        for obj in [out, *out.get("$defs", {}).values()]:
            if obj.get("type") == "object":
                obj.setdefault("additionalProperties", False)
        return out
    return schema


def llguidance_grammar(kind: str, text: str) -> str:
    """(kind, text) -> llguidance's grammar (raises ValueError on text it cannot read)."""
    from llguidance import LLMatcher, grammar_from

    if kind in ("json", "json_object"):
        return LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    return grammar_from(kind, text)


def describe_error(kind: str, error: str) -> str:
    error = error.strip()
    if len(error) > 2000:
        error = error[:2000] + " ..."
    return f"structured_outputs.{kind}: {error}"


VERDICTS_KEPT = 4096  # recent constraints' verdicts (a digest and a short text each)
_verdicts: OrderedDict[tuple[str, bytes], Optional[str]] = OrderedDict()
_verdicts_lock = threading.Lock()


def check_structured(so: StructuredOutputs) -> Optional[str]:
    """llguidance's verdict on the constraint (None: valid, or llguidance not installed).
    Remembered by the spec's digest: a gateway checks a request's constraint on its check
    threads and its client checks it again on submit, on the event loop, where a big schema's
    check took as long again (0.45 s); a batch's lines share a schema."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return None
    kind, text = so.spec()
    key = (kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    with _verdicts_lock:
        if key in _verdicts:
            _verdicts.move_to_end(key)
            return _verdicts[key]
    try:
        grammar = llguidance_grammar(kind, text)
        msg = LLMatcher.validate_grammar(grammar)
        verdict = describe_error(kind, msg) if msg else None
    except ValueError as e:
        verdict = describe_error(kind, str(e))
    with _verdicts_lock:
        _verdicts[key] = verdict
        if len(_verdicts) > VERDICTS_KEPT:
            _verdicts.popitem(last=False)
    return verdict
