"""StructuredOutputsParams: what a request's output must match (vLLM's names).

Exactly one of `json` (a JSON schema, dict or text), `regex`, `choice` (a list of strings),
`grammar` (Lark, or GBNF/EBNF as llama.cpp writes it) or `json_object=True` (any JSON object).
This module only checks the shape; engine/structured.py compiles it with llguidance.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from genpool.schemas.structured import MAX_CHOICES

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# The whole constraint's canonical text may not exceed this (a bound on compile work and memory).
MAX_SPEC_CHARS = 1_000_000


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar "
                             f"or json_object=true (got {', '.join(given) or 'none'})")
        kind = given[0]
        if kind == "json" and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object or its text, "
                             f"got {type(self.json).__name__}")
        if kind in ("regex", "grammar") and not (isinstance(getattr(self, kind), str)
                                                 and getattr(self, kind)):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice" and not (isinstance(self.choice, (list, tuple)) and self.choice
                                     and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if kind == "choice" and len(self.choice) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice has {len(self.choice)} options; the limit "
                             f"is {MAX_CHOICES} (llguidance's, for one rule)")
        if kind == "json_object" and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true")
        if len(self.key[1]) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} is {len(self.key[1])} characters; the limit "
                             f"is {MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @cached_property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar. JSON is
        re-serialized compactly but keeps its key order (properties are generated in order)."""
        kind = self.kind
        if kind == "json":
            spec = self.json
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(spec, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            return kind, json.dumps(spec, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, '{"type":"object"}'
        return kind, getattr(self, kind)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a dict or StructuredOutputsParams, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        choice = value.get("choice")
        return cls(**{**value, **({"choice": list(choice)} if isinstance(choice, tuple) else {})})
