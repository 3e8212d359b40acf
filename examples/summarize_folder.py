"""Map-reduce summarization of a folder of long documents through a genpool pool.

    genpool worker --model smollm2-135m &        # one or more workers, anywhere
    python examples/summarize_folder.py examples/docs -o examples/output/summaries.json

1. map:    every document is cut into chunks and every chunk is summarized (all at once, at most
           --concurrency jobs in flight);
2. reduce: each document's chunk summaries are combined into one summary;
3. overview: each document summary is boiled down to one sentence; the overview lists them.

A 135M-parameter model follows short, concrete requests and drifts on abstract ones: asked for "a
paragraph about several documents" it described its own instructions. So every request here is
small and concrete (two sentences, one sentence), the overview is assembled from one-sentence
answers rather than written in one go, and every answer is cut back to its last full sentence
when it ran out of tokens (stop rule: never end mid-sentence). Prompts carry no title: given one,
the model answered with the title alone ("Bees in winter.") or glued it in front of its answer.

Every answer then goes through deterministic filters (clean()), sentence by sentence:
- a leading "Summary:" / "Title: ..." label, the document's heading or its title is stripped
  (no "Bees in winter: Bees in winter: ...");
- a sentence about the text rather than its content is dropped ("The text is written in simple
  sentences, and there are no bold or italic text": the model echoing its instructions);
- a sentence naming a number or a capitalized name that the source does not contain, made
  mostly of words the source does not use, or whose word trigrams are mostly new, is dropped (the model's inventions: "a 92-year-old
  man named John", "the ship was a small, three-storied cottage with a single sail");
- list markers go; a sentence that repeats an earlier one is dropped; the overview keeps one sentence per document.
When nothing is left, the request is asked again for RETRY_N sampled answers (seeded, so a run
is reproducible) and the one that keeps the most sentences wins (`retried` in the stats). Only
when none survives does the answer fall back to the source's own opening sentences: each such
answer is named on stderr and in the stats (`fell_back`), and marked in the output, never passed
off as a summary.

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

from genpool.producer import Client
from genpool.producer.pipeline import map_prompts

SYSTEM = (
    "You are a careful editor who writes short, faithful summaries. Use only facts from the "
    "given text. Keep names, places and numbers exactly as written. Do not add opinions, advice "
    "or anything the text does not say. Write plain prose, with no lists or headings."
)
TASKS = {
    # "in your own words" left 6 of the 12 shipped chunks with nothing faithful (their
    # paraphrases invent numbers and invert facts); asking for its facts in its words, 2
    "chunk": "Write the two most important facts of this text as two sentences, using its own "
             "words.",
    "document": "Summarize this text in three sentences, in your own words.",
    "folder": "In one sentence, say what this text is about.",
}
# Greedy, with a frequency penalty against the loops small models fall into. Not
# repetition_penalty: it also penalizes tokens of the prompt, which pushes a summary away from
# the document's own names and numbers.
SAMPLING = {"temperature": 0.0, "frequency_penalty": 0.3}
# An answer the filters emptied is asked again: RETRY_N samples in one job (n), seeded.
RETRY_N = 6
RETRY = {"n": RETRY_N, "temperature": 0.7, "top_p": 0.9, "seed": 7}
MAX_TOKENS = {"chunk": 96, "document": 144, "folder": 64}
SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")
LEADS = re.compile(r"^(?:(?:here is |here's )?(?:a |the )?summary(?: of [^:\n]*)?(?: is)?:|"
                   r"part \d+:|title:[^\n]*)\s*", re.I)
# a sentence about the text, the summary or the instructions, not about the content
META = re.compile(r"\b(?:the|this|that|each|a) (?:text|summary|summaries|passage|excerpt|"
                  r"article|document|prompt|instructions?)\b|\bthe story is\b|\bis written in\b|"
                  r"\bnarrative style\b|\bplain prose\b|\bown words\b|\b(?:one|two|three) "
                  r"sentences\b|\bsimple sentences\b|\b(?:no|any|without|or) (?:lists?|"
                  r"headings?|bold|italic|enumerations?)\b|\b(?:first|second|third|two|most "
                  r"important) facts?\b", re.I)
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
NAME = re.compile(r"(?<=[\s(\"'])[A-Z][a-z]+(?:'s)?")  # a capitalized word not opening the sentence


def tidy(text: str, finish_reason: str | None) -> str:
    """Drop a "Summary:"-style lead; when the answer ran out of tokens, cut it back to its last
    full sentence (a small model's summary that stops mid-sentence reads as broken)."""
    text = text.strip()
    while (m := LEADS.match(text)) and m.end():
        text = text[m.end():].lstrip()
    if finish_reason == "length":
        ends = list(SENTENCE_END.finditer(text))
        if ends:
            text = text[:ends[-1].end()]
    return " ".join(text.split())


def sentences(text: str) -> list[str]:
    out, start = [], 0
    for m in SENTENCE_END.finditer(text):
        out.append(text[start:m.end()].strip())
        start = m.end()
    tail = text[start:].strip()
    return [s for s in out + [tail] if s]


def _norm(s: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", s.lower()))


def strip_titles(text: str, titles: list[str], heading: str = "") -> str:
    """Remove, as often as they repeat, a leading label, title ("Bees in winter:") or the
    source's whole heading line (also when glued to a sentence: "The Keeper of Gannet Point for
    thirty-one years ...")."""
    titles = sorted({t for t in [*titles, heading] if t}, key=len, reverse=True)
    while True:
        before = text
        while (m := LEADS.match(text)) and m.end():
            text = text[m.end():].lstrip()
        for t in titles:
            if text.lower().startswith(t.lower()):
                rest = text[len(t):]
                # a label ("Bees in winter: ...", a heading glued to the next sentence: "... the
                # Beginner A colony"), not the sentence's subject ("Bees in winter can ...")
                if t == heading or not rest or re.match(r"\s*[:.\-\u2013\u2014\n]|\s+[A-Z]", rest):
                    text = rest.lstrip(":.-\u2013\u2014 \n,")
                    break
        if text == before:
            return text


STOPWORDS = frozenset(
    "the a an of and or to in on at by for with from that this was were is are be been it its as "
    "but not their there they them his her he she which who what when where into than then so "
    "had has have".split())
MIN_OVERLAP = 0.6  # share of a sentence's content words that must occur in its source
MIN_TRIGRAMS = 0.6  # share of its word trigrams that must occur in its source


def _trigrams(text: str) -> list[tuple[str, ...]]:
    w = re.findall(r"[a-z0-9']+", text.lower())
    return list(zip(w, w[1:], w[2:]))


def supported(sentence: str, source: str) -> bool:
    """Every number and every capitalized name of the sentence occurs in the source, and most of
    its other words do (a sentence made of new words is the model's invention: "The ship was a
    small, three-storied cottage with a single sail")."""
    words = set(re.findall(r"[A-Za-z]+(?:'s)?", source))
    nums = set(NUMBER.findall(source))
    if any(n not in nums for n in NUMBER.findall(sentence)):
        return False
    if not all(w in words or w.removesuffix("'s") in words for w in NAME.findall(" " + sentence)):
        return False
    lower = {w.lower() for w in words}
    content = [w for w in re.findall(r"[a-z]+", sentence.lower()) if len(w) > 2 and w not in STOPWORDS]
    if content and sum(w in lower for w in content) / len(content) < MIN_OVERLAP:
        return False
    # this model's faithful sentences copy the source's phrasing; its inventions recombine the
    # source's words into new phrases ("The ship was a small museum": 1 of 16 trigrams)
    grams, known = _trigrams(sentence), set(_trigrams(source))
    return not grams or sum(g in known for g in grams) / len(grams) >= MIN_TRIGRAMS


def clean(text: str, source: str, titles: list[str], keep: int | None = None) -> str:
    """The answer without titles, sentences about the text, unsupported facts or repeats; at
    most `keep` sentences. "" when nothing survives (the caller falls back)."""
    kept, seen, heading = [], set(), heading_of(source)
    text = re.sub(r"(?:^|(?<=\s))[-*\u2022]\s+", "", text)  # list markers: "- The queen ..."
    for s in sentences(strip_titles(text, titles, heading)):
        s = strip_titles(s, titles, heading)
        key = _norm(s)
        if len(key.split()) < 4 or key in seen or META.search(s) or not supported(s, source):
            continue
        if not SENTENCE_END.search(s[-3:] + " "):
            continue  # no sentence end: a heading or a cut-off fragment
        seen.add(key)
        kept.append(s[0].upper() + s[1:])
    return " ".join(kept[:keep])


def lead(source: str, n: int, titles: list[str]) -> str:
    """The source's own first `n` sentences (its heading skipped): the fallback summary."""
    body = "\n\n".join(p for p in source.split("\n\n")
                        if SENTENCE_END.search(p.strip()[-3:] + " ") or len(p) > 100)
    return " ".join(sentences(" ".join(strip_titles(body, titles).split()))[:n])


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


def heading_of(text: str) -> str:
    """The document's first line when it is a heading (short, no sentence end), else ""."""
    first = text.strip().split("\n", 1)[0].strip()
    return first if len(first) < 100 and not SENTENCE_END.search(first[-3:] + " ") else ""


def title_of(name: str, text: str = "") -> str:
    """The heading's main part ("The Canal Locks of Millbrook"), else the file name's stem."""
    heading = heading_of(text).split(":")[0].strip()
    return heading or Path(name).stem.replace("_", " ").capitalize()


def titles_of(name: str, text: str) -> list[str]:
    """Every spelling of a document's title that an answer may start with."""
    stem = Path(name).stem.replace("_", " ")
    return [name, stem, heading_of(text), *(part.strip() for part in heading_of(text).split(":"))]


def messages(task: str, material: str) -> dict:
    # The shared part (system message, then the task sentence) comes first; the material, which
    # differs per prompt, comes last so it never breaks the shared prefix. No title: the model
    # answered with it alone, or put it in front of its answer.
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"{TASKS[task]}\n\nText:\n{material}"}],
            "max_tokens": MAX_TOKENS[task]}


def run_stage(client: Client, name: str, items: list[dict], concurrency: int,
              stats: dict, extra: dict | None = None) -> list:
    t0 = time.monotonic()
    results = map_prompts(client, items, concurrency=concurrency, **{**SAMPLING, **(extra or {})})
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} jobs failed, first: {failed[0].error}")
    st = stats.setdefault(name, {"jobs": 0, "seconds": 0.0, "prompt_tokens": 0,
                                 "completion_tokens": 0, "retried": 0, "fallbacks": 0,
                                 "fell_back": []})
    st["jobs"] += len(items)
    st["seconds"] = round(st["seconds"] + time.monotonic() - t0, 2)
    st["prompt_tokens"] += sum(r.usage.prompt_tokens for r in results)
    st["completion_tokens"] += sum(r.usage.completion_tokens for r in results)
    print(f"[{name}] {len(items)} jobs in {round(time.monotonic() - t0, 2)} s", file=sys.stderr)
    return results


def answers(r) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of every completion of a result (n > 1: its choices)."""
    return [(c.text, c.finish_reason) for c in r.choices] if r.choices else [(r.text,
                                                                            r.finish_reason)]


def cleaned(results: list, sources: list[str], titles: list[list[str]], fallbacks: list[str],
            stage: dict, keep: int | None = None, labels: list[str] | None = None,
            retry=None) -> tuple[list[str], list[bool]]:
    """clean() each answer against its source; of several (a retry's n), the one that keeps the
    most sentences. An answer with nothing left is asked again through `retry(indices)` (its
    results, n answers each) when given; what is still empty is replaced by its fallback (the
    source's own sentences), counted, and named. Returns the texts and which fell back."""
    def best(r, i):
        texts = [clean(tidy(t, f), sources[i], titles[i], keep) for t, f in answers(r)]
        return max(texts, key=lambda t: len(sentences(t)) if t else 0)

    out = [best(r, i) for i, r in enumerate(results)]
    empty = [i for i, t in enumerate(out) if not t]
    if empty and retry is not None:
        stage["retried"] += len(empty)
        for i, r in zip(empty, retry(empty)):
            out[i] = best(r, i)
    fell = [not t for t in out]
    for i in (i for i, f in enumerate(fell) if f):
        stage["fallbacks"] += 1
        name = labels[i] if labels else str(i)
        stage.setdefault("fell_back", []).append(name)
        print(f"  {name}: no usable summary (every answer was filtered out); using the "
              f"source's opening sentences instead", file=sys.stderr)
        out[i] = fallbacks[i]
    return out, fell


def summarize(client: Client, docs: dict[str, str], chunk_chars: int, concurrency: int) -> dict:
    stats: dict = {}
    chunks = {name: chunk_text(text, chunk_chars) for name, text in docs.items()}
    flat = [(name, i, c) for name, cs in chunks.items() for i, c in enumerate(cs)]
    ts = {name: titles_of(name, text) for name, text in docs.items()}

    def stage(name, items, sources, titles, fallbacks, keep, labels):
        def again(idx):  # the emptied ones, sampled RETRY_N times each
            return run_stage(client, name, [items[i] for i in idx], concurrency, stats, RETRY)
        res = run_stage(client, name, items, concurrency, stats)
        return cleaned(res, sources, titles, fallbacks, stats[name], keep, labels, again)

    part_sums, part_fell = stage("map", [messages("chunk", c) for _, _, c in flat],
                                 [c for _, _, c in flat], [ts[n] for n, _, _ in flat],
                                 [lead(c, 2, ts[n]) for n, _, c in flat], 2,
                                 [f"{n} part {i + 1}" for n, i, _ in flat])
    by_doc: dict[str, list[str]] = {name: [] for name in docs}
    fell_parts: dict[str, list[int]] = {name: [] for name in docs}
    for (name, i, _), s, f in zip(flat, part_sums, part_fell):
        by_doc[name].append(s)
        if f:
            fell_parts[name].append(i + 1)
    # plain consecutive paragraphs: "Part 1:" labels were copied into the summaries. The reduce
    # answer is checked against the whole document (its facts must be the document's).
    names = list(docs)
    doc_sums, doc_fell = stage("reduce", [messages("document", "\n\n".join(by_doc[n])) for n in names],
                               [docs[n] for n in names], [ts[n] for n in names],
                               [" ".join(by_doc[n][:2]) for n in names], 4, names)
    lines, line_fell = stage("overview", [messages("folder", s) for s in doc_sums],
                             [docs[n] for n in names], [ts[n] for n in names],
                             [sentences(s)[0] for s in doc_sums], 1, names)
    overview = " ".join(f"{title_of(n, docs[n])}: {line}" for n, line in zip(names, lines))
    return {"overview": overview,
            "documents": [{"name": n, "chars": len(docs[n]), "chunks": len(chunks[n]),
                           "summary": s, "summary_is_source_opening": df,
                           "overview_line_is_source_opening": lf,
                           "chunk_summaries": by_doc[n],
                           "chunks_with_source_opening": fell_parts[n]}
                          for n, s, df, lf in zip(names, doc_sums, doc_fell, line_fell)],
            "stats": stats, "shared_prefix_chars": len(SYSTEM)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="folder of .txt / .md documents")
    ap.add_argument("-o", "--output", type=Path, default=None,
                    help="also write the result as JSON here (default: none: stdout only)")
    ap.add_argument("--redis", default=None, help="Redis URL (default: as `genpool submit`)")
    ap.add_argument("--prefix", default=None, help="key prefix (default: as `genpool submit`)")
    ap.add_argument("--model", default=None, help="model name (default: whatever serves)")
    ap.add_argument("--chunk-chars", type=int, default=1500,
                    help="characters per map chunk at most (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16,
                    help="jobs in flight at once (default: %(default)s)")
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
