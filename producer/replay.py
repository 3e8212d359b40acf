"""Turns a job's raw event log into what a reader should see.

A `restart` event means the job is being rerun from scratch (worker crash, Redis reconnect). Most
reruns are greedy or seeded, so they regenerate the text already shown; repeating it would corrupt a
terminal that printed it. `Replay` therefore swallows re-sent text that matches what was shown and
passes on only the new part. Only when a rerun diverges does the reader get a RestartEvent (its
`.text` is empty), followed by the rerun's full text so far.

A `resume` event means a worker took the job over and continues each completion after the tokens
the log holds. A reader that saw exactly those sees nothing; one that saw more (Redis lost the
tail of the stream) gets a RewindEvent per such completion, naming the token index it goes on
from and the text to drop, before the continuation.

A job's stream is capped (MAXLEN ~16,384 entries), so a reader that falls further behind loses the
oldest events unread. Workers number every entry (field `seq`: 1, 2, ...), and `read_events`
puts a TrimmedEvent where the numbers jump, so such a reader is told, not handed a silent gap.
"""
from __future__ import annotations

from typing import Iterator, Optional, Union

from genpool.schemas import (
    ErrorEvent,
    RestartEvent,
    ResultEvent,
    ResumeEvent,
    RewindEvent,
    TokenEvent,
    TrimmedEvent,
)

from .protocol import decode_event

AnyEvent = Union[TokenEvent, RestartEvent, ResumeEvent, RewindEvent, ResultEvent, ErrorEvent,
                 TrimmedEvent]


class _Track:
    """Text/token ids shown to the reader for one completion index, and the rerun's copy."""

    def __init__(self) -> None:
        self.text, self.ids = "", []
        self.redo_text, self.redo_ids = "", []
        self.replaying = False
        self.marks: list[tuple[int, int]] = [(0, 0)]  # (tokens, chars) shown after each event
        self.redo_marks: list[tuple[int, int]] = [(0, 0)]  # the same for the rerun's copy

    def shown(self, text: str, ids: list[int]) -> None:
        self.text, self.ids = text, list(ids)
        self.marks.append((len(self.ids), len(self.text)))

    def cut(self, k: int) -> Optional[RewindEvent]:
        """Keep the first k tokens shown (a resume goes on from there); the rewind, if any."""
        if self.replaying:  # the rerun's copy is what the log holds: it is cut, not the shown
            self.redo_text, self.redo_ids, self.redo_marks = _cut(
                self.redo_text, self.redo_ids, self.redo_marks, k)
            return None
        if len(self.ids) <= k:
            return None
        text, ids, marks = _cut(self.text, self.ids, self.marks, k)
        ev = RewindEvent(token_index=k, dropped=len(self.ids) - k,
                         dropped_text=self.text[len(text):])
        self.text, self.ids, self.marks = text, ids, marks
        return ev


def _cut(text: str, ids: list[int], marks: list[tuple[int, int]], k: int):
    """(text, ids, marks) of the first k tokens; events end on token boundaries, so the text
    ends at the last mark within them."""
    chars = max(c for n, c in marks if n <= k)
    return text[:chars], ids[:k], [(n, c) for n, c in marks if n <= k]


class Replay:
    def __init__(self) -> None:
        self.tracks: dict[int, _Track] = {}
        self.restarts = 0

    def feed(self, ev: AnyEvent) -> list[AnyEvent]:
        """Events to hand to the reader for one raw event (possibly none)."""
        if isinstance(ev, RestartEvent):
            self.restarts += 1
            for t in self.tracks.values():
                t.replaying, t.redo_text, t.redo_ids, t.redo_marks = True, "", [], [(0, 0)]
            return []
        if isinstance(ev, ResumeEvent):
            return self._resume(ev)
        if isinstance(ev, ResultEvent) and any(
                t.replaying and (t.redo_text, t.redo_ids) != (t.text, t.ids)
                for t in self.tracks.values()):
            return self._diverged() + [ev]  # the rerun ended short of what was shown
        if not isinstance(ev, TokenEvent):
            return [ev]
        t = self.tracks.setdefault(ev.index, _Track())
        if not t.replaying:
            t.shown(t.text + ev.text, t.ids + ev.token_ids)
            return [ev]
        return self._rerun_token(t, ev)

    def _resume(self, ev: ResumeEvent) -> list[AnyEvent]:
        out: list[AnyEvent] = []
        for index, t in sorted(self.tracks.items()):
            k = ev.tokens[index] if index < len(ev.tokens) else 0
            rewind = t.cut(k)
            if rewind is not None:
                rewind.index = index
                out.append(rewind)
        return out

    def _rerun_token(self, t: _Track, ev: TokenEvent) -> list[AnyEvent]:
        t.redo_text += ev.text
        t.redo_ids += ev.token_ids
        t.redo_marks.append((len(t.redo_ids), len(t.redo_text)))
        if t.text.startswith(t.redo_text) and len(t.redo_ids) <= len(t.ids):
            return []  # still inside what the reader has already seen
        if t.redo_text.startswith(t.text) and t.redo_ids[:len(t.ids)] == t.ids:
            new_ids = t.redo_ids[len(t.ids):]
            out = TokenEvent(index=ev.index, text=t.redo_text[len(t.text):], token_ids=new_ids,
                             logprobs=ev.logprobs[-len(new_ids):] if ev.logprobs and new_ids else None)
            t.replaying = False
            t.shown(t.redo_text, t.redo_ids)
            return [out]
        return self._diverged()

    def _diverged(self) -> list[AnyEvent]:
        """The rerun differs from what was shown: the reader drops everything, gets the rerun."""
        out: list[AnyEvent] = [RestartEvent(reason="rerun diverged from the text already streamed",
                                            attempt=self.restarts + 1)]
        for index in sorted(self.tracks):
            t = self.tracks[index]
            if t.replaying:
                t.replaying, t.marks = False, [(0, 0)]
                t.shown(t.redo_text, t.redo_ids)
            if t.text or t.ids:
                out.append(TokenEvent(index=index, text=t.text, token_ids=list(t.ids)))
        return out


class Gaps:
    """Follows the `seq` numbers of one reader's entries (docs/protocol.md, "Reading a job's
    output"): a jump from k to k + 1 + n means n events were trimmed before it read them."""

    def __init__(self, start: str = "0-0"):
        # read from the start: the first entry must be number 1; from elsewhere, the first
        # entry read sets where counting starts
        self.last: Optional[int] = 0 if start in ("0", "0-0") else None

    def check(self, fields) -> Optional[TrimmedEvent]:
        seq = _seq(fields)
        gap = (TrimmedEvent(events=seq - self.last - 1)
               if seq is not None and self.last is not None and seq > self.last + 1 else None)
        self.last = seq  # an entry without one (a worker before `seq`): nothing to count from
        return gap


def read_events(xread_reply, gaps: Gaps) -> Iterator[tuple[Optional[str], Optional[AnyEvent]]]:
    """(entry id, event) for every entry of an XREAD reply, with (None, TrimmedEvent) in front
    of an entry whose number says events before it were trimmed unread; (entry id, None) for an
    entry to skip (protocol.decode_event), so that the reader still moves past it."""
    for _, entries in xread_reply or []:
        for entry_id, fields in entries:
            gap = gaps.check(fields)
            if gap is not None:
                yield None, gap
            yield entry_id, decode_event(fields)


def _seq(fields) -> Optional[int]:
    if isinstance(fields, list):  # redis-py's cluster MULTI leaves stream replies unparsed
        fields = dict(zip(fields[0::2], fields[1::2]))
    raw = fields.get("seq", fields.get(b"seq"))
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None
