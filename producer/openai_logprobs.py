"""OpenAI's logprobs shapes from a job's per-token logprob maps (schemas/events.py).

A job that asked for logprobs carries, per completion, one `{token_id: logprob}` map per generated
token (the top-k ids and the sampled one, from the model's raw distribution) and the text of every
id in them (`token_texts`). Chat answers `{"content": [{token, logprob, bytes, top_logprobs}]}`;
completions answer `{tokens, token_logprobs, top_logprobs, text_offset}`, as OpenAI's legacy API
did. `bytes` is the token text's UTF-8 (a token that is part of a multi-byte character reads as
U+FFFD there, as its text does).
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional


def _top(d: dict[str, float], k: int) -> list[tuple[str, float]]:
    return sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:k]


def chat(ids: list[int], maps: list[dict[str, float]], texts: dict[str, str], k: int) -> dict:
    def entry(tid: str, lp: float) -> dict:
        t = texts.get(tid, "")
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    content = []
    for tok, d in zip(ids, maps):
        e = entry(str(tok), d.get(str(tok), float("-inf")))
        e["top_logprobs"] = [entry(tid, lp) for tid, lp in _top(d, k)]
        content.append(e)
    return {"content": content}


def _by_text(top: list[tuple[str, float]], texts: dict[str, str]) -> dict[str, float]:
    """The legacy API's {text: logprob}: two ids with one text (two halves of a character both
    read U+FFFD) keep the higher, so the sampled greedy token still reads as the top one."""
    out: dict[str, float] = {}
    for tid, lp in top:  # highest first
        out.setdefault(texts.get(tid, ""), lp)
    return out


def advance(offset: int, ids: list[int], texts: dict[str, str]) -> int:
    """Where the text after these tokens starts (completions' `text_offset`)."""
    return offset + sum(len(texts.get(str(t), "")) for t in ids)


def completion(ids: list[int], maps: list[dict[str, float]], texts: dict[str, str], k: int,
               offset: int = 0) -> dict:
    tokens = [texts.get(str(tok), "") for tok in ids]
    offsets = list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if ids else []
    return {"tokens": tokens,
            "token_logprobs": [d.get(str(t), float("-inf")) for t, d in zip(ids, maps)],
            "top_logprobs": [_by_text(_top(d, k), texts) for d in maps],
            "text_offset": offsets}


def body(kind: str, k: Optional[int], ids: list[int], maps: Optional[list[dict[str, float]]],
         texts: Optional[dict[str, str]], offset: int = 0) -> Optional[dict]:
    """The `logprobs` of one choice or chunk; None when not asked (or none came: a job whose
    earlier attempt's log lacked them)."""
    if k is None or maps is None or len(maps) != len(ids):
        return None
    texts = texts or {}
    return chat(ids, maps, texts, k) if kind == "chat" else completion(ids, maps, texts, k, offset)
