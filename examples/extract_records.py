"""Turn a folder of documents into one JSON record each, through a genpool pool.

    genpool worker --model smollm2-135m &        # one or more workers, anywhere
    python examples/extract_records.py examples/docs -o examples/output/records.jsonl
    python examples/extract_records.py my_docs --schema my_schema.json -o records.jsonl

Every job carries the JSON schema as its structured-output constraint, so the worker can only
generate JSON that the schema accepts: each output line is {"document": ..., "record": {...}}
and every record validates (checked again here with the `jsonschema` package when installed).
All documents run at once (at most --concurrency jobs in flight); the instructions come first in
every prompt so the workers' prefix cache computes them once.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from genpool.producer import Client
from genpool.producer.pipeline import map_prompts

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 80},
        "topic": {"enum": ["nature", "history", "technology", "people", "places", "other"]},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "year": {"type": ["integer", "null"], "minimum": 0, "maximum": 2100},
        "summary": {"type": "string", "minLength": 1, "maxLength": 300},
    },
    "required": ["title", "topic", "people", "places", "summary"],
    "additionalProperties": False,
}
SYSTEM = ("You extract facts from documents into JSON records. Use only facts the document "
          "states; keep names and numbers exactly as written.")


def job(schema: dict, name: str, text: str, max_chars: int) -> dict:
    fields = ", ".join(schema.get("properties", {})) or "the schema's fields"
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Extract a record with {fields} from this "
                                                     f"document.\n\nDocument {name}:\n"
                                                     f"{text[:max_chars]}"}],
            "json_schema": schema}


def validator(schema: dict):
    try:
        import jsonschema
    except ImportError:
        return lambda record: None
    return jsonschema.Draft202012Validator(schema).validate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True, help="JSONL file to write")
    ap.add_argument("--schema", type=Path, default=None, help="JSON schema file (default: a "
                                                                "generic document record)")
    ap.add_argument("--redis", default=None)
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--model", default=None, help="model name (default: whatever serves)")
    ap.add_argument("--max-chars", type=int, default=3000, help="document text per prompt")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args(argv)
    schema = json.loads(a.schema.read_text()) if a.schema else DEFAULT_SCHEMA
    docs = {p.name: p.read_text() for p in sorted(a.folder.iterdir())
            if p.suffix in (".txt", ".md")}
    if not docs:
        raise SystemExit(f"no .txt or .md documents in {a.folder}")
    common = {"temperature": 0.0, "max_tokens": a.max_tokens}
    if a.model:
        common["model"] = a.model
    items = [job(schema, name, text, a.max_chars) for name, text in docs.items()]
    results = map_prompts(Client(a.redis, a.prefix), items, concurrency=a.concurrency, **common)
    check, bad = validator(schema), 0
    a.output.parent.mkdir(parents=True, exist_ok=True)
    with a.output.open("w") as out:
        for name, res in zip(docs, results):
            if res.error is not None or res.finish_reason != "stop":
                bad += 1  # e.g. max_tokens too small for the record: the text is a cut prefix
                why = res.error.message if res.error else f"finish_reason {res.finish_reason}"
                print(f"{name}: no record ({why})", file=sys.stderr)
                continue
            record = json.loads(res.text)
            check(record)
            out.write(json.dumps({"document": name, "record": record}, ensure_ascii=False) + "\n")
    print(f"{len(docs) - bad} records written to {a.output}; {bad} documents without one",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
