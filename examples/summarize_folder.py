"""Map-reduce summarization of a folder of long documents through a genpool pool.

    genpool worker --model smollm2-135m &        # one or more workers, anywhere
    python examples/summarize_folder.py examples/docs -o examples/output/summaries.json

1. map:    every document is cut into chunks and every chunk is summarized (all at once, at most
           --concurrency jobs in flight);
2. reduce: each document's chunk summaries are combined into one summary;
3. reduce: the document summaries are combined into an overview of the folder.

Every prompt opens with the same system message, which holds all the instructions; only the
material to summarize comes last. The worker's prefix cache then computes the KV blocks of that
shared opening once and every later prompt reuses them, so only the new text costs prefill.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from producer import Client  # noqa: E402
from producer.pipeline import map_prompts  # noqa: E402

SYSTEM = (
    "You are a careful editor who writes short, faithful summaries. Use only facts from the "
    "given text. Keep names, places and numbers exactly as written. Do not add opinions, advice "
    "or anything the text does not say. Write plain prose, with no lists or headings."
)
TASKS = {
    "chunk": "Summarize this text in two or three sentences.",
    "document": "These are summaries of consecutive parts of one document. Combine them into one "
                "summary of the whole document in three to five sentences.",
    "folder": "These are summaries of several documents. Write one short paragraph that says "
              "what each document is about.",
}
# Greedy, with a frequency penalty against the loops small models fall into. Not
# repetition_penalty: it also penalizes tokens of the prompt, which pushes a summary away from
# the document's own names and numbers.
SAMPLING = {"temperature": 0.0, "frequency_penalty": 0.3}
MAX_TOKENS = {"chunk": 80, "document": 120, "folder": 160}


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Whole paragraphs packed up to max_chars; an oversized paragraph is split at sentences."""
    pieces: list[str] = []
    for para in (p.strip() for p in text.split("\n\n")):
        if len(para) <= max_chars:
            pieces.append(para)
            continue
        sentences, cur = re.split(r"(?<=[.!?])\s+", para), ""
        for s in sentences:
            if cur and len(cur) + len(s) + 1 > max_chars:
                pieces.append(cur)
                cur = ""
            cur = f"{cur} {s}".strip()
        pieces.append(cur)
    chunks, cur = [], ""
    for p in filter(None, pieces):
        if cur and len(cur) + len(p) + 2 > max_chars:
            chunks.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}".strip()
    return chunks + ([cur] if cur else [])


def messages(task: str, title: str, material: str) -> dict:
    # The shared part (system message, then the task sentence) comes first; the title and the
    # material, which differ per prompt, come last so they never break the shared prefix.
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"{TASKS[task]}\n\nTitle: {title}\n\n"
                                                     f"Text:\n{material}"}],
            "max_tokens": MAX_TOKENS[task]}


def run_stage(client: Client, name: str, items: list[dict], concurrency: int,
              stats: dict) -> list[str]:
    t0 = time.monotonic()
    results = map_prompts(client, items, concurrency=concurrency, **SAMPLING)
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} jobs failed, first: {failed[0].error}")
    stats[name] = {"jobs": len(items), "seconds": round(time.monotonic() - t0, 2),
                   "prompt_tokens": sum(r.usage.prompt_tokens for r in results),
                   "completion_tokens": sum(r.usage.completion_tokens for r in results)}
    print(f"[{name}] {len(items)} jobs in {stats[name]['seconds']} s", file=sys.stderr)
    return [r.text.strip() for r in results]


def summarize(client: Client, docs: dict[str, str], chunk_chars: int, concurrency: int) -> dict:
    stats: dict = {}
    chunks = {name: chunk_text(text, chunk_chars) for name, text in docs.items()}
    flat = [(name, i, c) for name, cs in chunks.items() for i, c in enumerate(cs)]
    part_sums = run_stage(client, "map", [
        messages("chunk", f"{name} (part {i + 1} of {len(chunks[name])})", c)
        for name, i, c in flat], concurrency, stats)
    by_doc: dict[str, list[str]] = {name: [] for name in docs}
    for (name, _, _), s in zip(flat, part_sums):
        by_doc[name].append(s)
    doc_sums = run_stage(client, "reduce", [
        messages("document", name, "\n\n".join(f"Part {i + 1}: {s}" for i, s in enumerate(ss)))
        for name, ss in by_doc.items()], concurrency, stats)
    overview = run_stage(client, "overview", [
        messages("folder", "the folder", "\n\n".join(f"{n}: {s}" for n, s in
                                                     zip(docs, doc_sums)))], 1, stats)[0]
    return {"overview": overview,
            "documents": [{"name": n, "chars": len(docs[n]), "chunks": len(chunks[n]),
                           "summary": s, "chunk_summaries": by_doc[n]}
                          for n, s in zip(docs, doc_sums)],
            "stats": stats, "shared_prefix_chars": len(SYSTEM)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=None, help="write the result as JSON")
    ap.add_argument("--redis", default=None)
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--model", default=None, help="model name (default: whatever serves)")
    ap.add_argument("--chunk-chars", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args(argv)
    docs = {p.name: p.read_text() for p in sorted(a.folder.iterdir())
            if p.suffix in (".txt", ".md")}
    if not docs:
        raise SystemExit(f"no .txt or .md documents in {a.folder}")
    if a.model:
        SAMPLING["model"] = a.model
    result = summarize(Client(a.redis, a.prefix), docs, a.chunk_chars, a.concurrency)
    result["model"] = a.model
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
